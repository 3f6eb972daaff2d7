"""Reduced draft vocabularies: a drafter proposes only the most frequent target tokens (FR-Spec, EAGLE-3).

On a small target the LM head is most of a draft step (SmolLM2: 49,152 x 576, about a quarter of a target
forward), while a few thousand tokens cover almost every token the target writes. A drafter with a draft
vocabulary computes logits for those rows only; a token outside it is never drafted. Verification is
untouched: the target still judges every draft token against its full distribution, so output stays lossless
(under sampling, the draft distribution q is the draft logits renormalised on the draft vocabulary, zero
outside, and the verifier's min(1, p/q) rule needs nothing more).

The vocabulary is chosen from the training data: the `size` most frequent assistant tokens (loss_mask), ties
broken by id, stored ascending. size: N > 0, 0 = the full vocabulary (no reduction), -1 = auto
(min(AUTO_DRAFT_VOCAB, every distinct assistant token)). An explicit N above the distinct count is an error.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

AUTO_DRAFT_VOCAB = 32000         # -1: EAGLE-3's 32k, or every distinct assistant token when the data holds fewer


def check_size(size: int) -> None:
    if size < -1:
        raise ValueError(f"drafter.draft_vocab_size={size}: give N > 0, 0 (full vocabulary) or -1 "
                         f"(auto: min({AUTO_DRAFT_VOCAB}, distinct assistant tokens))")


def assistant_token_counts(dataset) -> Counter:
    """Counts of the assistant tokens (loss_mask = 1) over a dataset whose rows hold input_ids and loss_mask."""
    counts: Counter = Counter()
    for i in range(len(dataset)):
        row = dataset[i]
        counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    return counts


def choose(counts: Counter, size: int, vocab_size: int, who: str = "drafter") -> list[int]:
    """The draft vocabulary (ascending ids) for `size` (N, or -1 = auto) from assistant-token counts."""
    check_size(size)
    if size == -1:
        size = min(AUTO_DRAFT_VOCAB, len(counts))
    if size >= vocab_size:
        return list(range(vocab_size))
    if len(counts) < size:
        raise ValueError(f"drafter.draft_vocab_size={size} but the training data has only {len(counts)} distinct "
                         f"assistant tokens: set drafter.draft_vocab_size to at most {len(counts)} (-1 = auto, 0 = "
                         "the full vocabulary), or train on more data")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    covered = sum(c for _, c in ranked) / max(sum(counts.values()), 1)
    print(f"{who} draft vocabulary: {size} of {len(counts)} distinct assistant tokens, covering {covered:.1%} of "
          "assistant tokens", flush=True)
    return sorted(t for t, _ in ranked)


def as_tensor(token_ids, vocab_size: int, device=None) -> Tensor:
    """A draft vocabulary as an ascending long tensor, checked against the target's vocabulary size."""
    ids = torch.tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long, device=device)
    if len(ids) and (ids[0] < 0 or ids[-1] >= vocab_size):
        raise ValueError(f"draft vocabulary ids must lie in 0..{vocab_size - 1}")
    return ids


def vocab_maps(draft_vocab: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """draft_vocab [Vd] (ascending target ids) -> d2t [Vd] offsets (target = draft + d2t[draft]), t2d [V] bool,
    the two maps under EAGLE-3's names."""
    d2t = draft_vocab - torch.arange(len(draft_vocab), device=draft_vocab.device)
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=draft_vocab.device)
    t2d[draft_vocab] = True
    return d2t, t2d


def expand_logits(small: Tensor, draft_vocab: Tensor, vocab_size: int) -> Tensor:
    """Logits over the draft vocabulary [..., Vd] -> over the target vocabulary [..., V], -inf elsewhere."""
    full = small.new_full((*small.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy(-1, draft_vocab, small)


def checkpoint_maps(draft_vocab: Tensor, vocab_size: int) -> dict[str, dict[str, Tensor]]:
    """The d2t / t2d maps as a checkpoint file for other tools (`checkpoint_tensors`); {} for an empty (full)
    draft vocabulary."""
    if not len(draft_vocab):
        return {}
    d2t, t2d = vocab_maps(draft_vocab, vocab_size)
    return {"d2t_t2d.safetensors": {"d2t": d2t, "t2d": t2d}}


def draft_index(draft_vocab: Tensor, vocab_size: int) -> Tensor:
    """draft_vocab [Vd] -> [V] long: the draft index of every target id, -1 outside the draft vocabulary
    (maps labels onto the rows of a reduced head)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_vocab.device)
    index[draft_vocab] = torch.arange(len(draft_vocab), device=draft_vocab.device)
    return index


class DraftHead(torch.nn.Module):
    """An LM head (held, not owned: never trained, saved or moved through this module) read on a draft vocabulary.

    `small(h)` [..., Vd] are the logits of the draft tokens (all V rows when the vocabulary is the full one);
    `full(h)` [..., V] the same with -inf outside; `to_target(i)` maps draft indices to target ids. The rows of
    a frozen head are gathered once and kept (9 MB for 4,096 x 576 in fp32); a trainable head's are gathered at
    every call so gradients reach it.
    """

    def __init__(self, lm_head: torch.nn.Module, vocab_size: int):
        super().__init__()
        self.__dict__["lm_head"] = lm_head
        self.vocab_size = vocab_size
        self.register_buffer("draft_vocab", torch.zeros(0, dtype=torch.long, device=lm_head.weight.device),
                             persistent=False)
        self._rows: Tensor | None = None
        self._rows_key: tuple | None = None

    @property
    def reduced(self) -> bool:
        return len(self.draft_vocab) > 0

    def set_vocab(self, token_ids) -> None:
        """Install a draft vocabulary (any order, kept ascending); an empty one (or all V ids) means the full one."""
        ids = as_tensor(token_ids, self.vocab_size, self.lm_head.weight.device)
        self.draft_vocab = ids if len(ids) < self.vocab_size else ids[:0]
        self._rows = None

    def rows(self) -> Tensor:
        """The head's weight rows of the draft vocabulary [Vd, d]: gathered at every call while gradients flow to
        a trainable head, otherwise gathered once per weight version (an optimiser step bumps it) and kept."""
        weight = self.lm_head.weight
        index = self.draft_vocab.to(weight.device)
        if weight.requires_grad and torch.is_grad_enabled():
            return weight[index]
        key = (weight.data_ptr(), weight.device, weight.dtype, weight._version)
        if self._rows is None or self._rows_key != key:
            # a normal tensor even when first read under inference_mode (a drafter evaluated before it trains):
            # an inference tensor could not be saved for the backward of a later training loss
            with torch.inference_mode(False), torch.no_grad():
                self._rows = weight[index].detach()
            self._rows_key = key
        return self._rows

    def small(self, hidden: Tensor) -> Tensor:
        hidden = hidden.to(self.lm_head.weight.dtype)
        if not self.reduced:
            return self.lm_head(hidden)
        bias = getattr(self.lm_head, "bias", None)
        return torch.nn.functional.linear(hidden, self.rows(), bias[self.draft_vocab] if bias is not None else None)

    def full(self, hidden: Tensor) -> Tensor:
        return self.expand(self.small(hidden))

    def to_target(self, index: Tensor) -> Tensor:
        """Draft-vocabulary indices -> target token ids."""
        return self.draft_vocab[index] if self.reduced else index

    def expand(self, small: Tensor) -> Tensor:
        """Draft logits [..., Vd] -> logits over the target vocabulary [..., V], -inf outside the draft vocabulary."""
        return expand_logits(small, self.draft_vocab, self.vocab_size) if self.reduced else small

    def maps(self) -> dict[str, dict[str, Tensor]]:
        """The d2t / t2d maps as a checkpoint file for other tools ({} for the full vocabulary)."""
        return checkpoint_maps(self.draft_vocab, self.vocab_size)


def lm_step(model, head: DraftHead, keep: int = 1, **inputs) -> tuple[Tensor, Tensor]:
    """One forward of a causal LM read through a draft head: the decoder (`model.get_decoder()`, which a
    peft-wrapped model forwards too) over `inputs` (input_ids, attention_mask, position_ids, past_key_values,
    use_cache), then the head on the last `keep` positions only (0 = every position), so the full vocabulary
    projection never runs. Returns (hidden [B, keep, d] after the final norm, logits [B, keep, Vd]).

    Whatever a model family's own forward applies after its LM head (logit soft-capping or scaling) is skipped:
    the draft distribution is then the one computed here, which is all verification needs to stay lossless.
    """
    from draftlab.serving import text_decoder

    hidden = text_decoder(model)(**inputs).last_hidden_state
    hidden = hidden[:, -keep:] if keep else hidden
    return hidden, head.small(hidden)
