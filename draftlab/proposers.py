"""Proposers that are not trained drafters: baselines and references for the evaluator.

- PromptLookupProposer: training-free n-gram lookup in the committed sequence (a chain, deterministic).
- CausalLMProposer: drafts with a causal LM through its own KV cache: the target itself (under greedy decoding
  every draft on the greedy path is accepted, so a chain of k gives tau == k+1 exactly: the reference drafter),
  or a small_lm drafter.
- LookupFirstProposer: prompt lookup in front of a trained drafter (lookup where the sequence repeats itself).
- RandomProposer: uniformly random tokens: a useless drafter (tau close to 1) for tests and benchmarks.
All follow the Proposer protocol in ARCHITECTURE.md (feature_layers, reset, commit, propose).
"""
from __future__ import annotations

import torch
from torch import Tensor

from draftlab import drafting, vocab
from draftlab.trees import DraftTree, TreeSpec, additive, chain, empty_tree, layer_masks, static_tree_layout, whole_cache
from draftlab.verify import Sampling


class PromptLookupProposer:
    """Prompt lookup decoding: find the latest earlier occurrence of the sequence's last n tokens
    (n = max_ngram down to min_ngram) and propose the tokens that followed it.

    num_tokens: draft length (None = spec.draft_length). May propose fewer tokens, or none (then the
    round is one plain target step). Proposals are deterministic ("topk"): no q needed.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, num_tokens: int | None = None, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens
        self.seq: list[int] = []
        self.device = torch.device("cpu")

    def reset(self, prompt_ids: Tensor) -> None:
        self.seq = prompt_ids.tolist()
        self.device = prompt_ids.device

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        self.seq.extend(tokens.tolist())

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest matching suffix n-gram."""
        seq = torch.tensor(self.seq)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(self.seq) <= n:
                continue
            windows = seq[:-1].unfold(0, n, 1)                 # [L-n, n]: every n-gram ending before the last token
            hits = (windows == seq[-n:]).all(-1).nonzero().flatten()
            if len(hits):
                start = int(hits[-1]) + n
                return self.seq[start:start + k]
        return []

    def propose(self, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        tokens = self.lookup(self.num_tokens or spec.max_depth)
        if not tokens:
            return empty_tree(self.device)
        return chain(torch.tensor(tokens, device=self.device))


class LookupFirstProposer:
    """A drafter's proposer with prompt lookup in front: when the committed sequence ends with an n-gram
    (n >= min_ngram) that occurred before, the tokens that followed it are the chain (no model runs); otherwise
    the drafter drafts. Targets that repeat themselves (small models in loops, code, extraction) give long exact
    matches, which a trained drafter can miss and lookup gets for free. For a tree spec a lookup hit drafts its
    chain of up to the tree's depth instead of the tree (verifying a short chain also costs less than a tree);
    without a hit the drafter drafts the tree.

    Lookup chains are deterministic ("topk"), which the verifier accepts with the target's own probability
    under sampling, so output stays lossless either way. `lookup_rounds` counts the rounds lookup drafted.
    """

    def __init__(self, inner, min_ngram: int = 3, max_ngram: int = 4, min_tokens: int = 2):
        self.inner, self.min_tokens = inner, min_tokens
        self.lookup = PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram)
        self.feature_layers = tuple(inner.feature_layers)
        self.lookup_rounds = 0

    def reset(self, prompt_ids: Tensor) -> None:
        self.inner.reset(prompt_ids)
        self.lookup.reset(prompt_ids)

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        self.inner.commit(tokens, features)
        self.lookup.commit(tokens, None)

    def propose(self, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        length = spec.max_depth
        tokens = self.lookup.lookup(length)
        if len(tokens) >= min(self.min_tokens, length):
            self.lookup_rounds += 1
            return chain(torch.tensor(tokens, device=self.lookup.device))
        return self.inner.propose(spec, sampling, generator)


class RandomProposer:
    """Uniformly random draft tokens in the spec's shape (chain, static layout, or a random dynamic-size
    tree). Under sampling q is uniform and the proposal i.i.d. ("with_replacement")."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.own = torch.Generator().manual_seed(seed)
        self.device = torch.device("cpu")

    def reset(self, prompt_ids: Tensor) -> None:
        self.device = prompt_ids.device

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        pass

    def propose(self, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        if spec.kind == "chain":
            parents = torch.arange(-1, spec.draft_length - 1)
        elif spec.kind == "static":
            parents, _ = static_tree_layout(spec.choices)
        else:   # random shape: each node hangs under the root or an earlier node that is not at the last level
            par, depth = [], []
            for i in range(spec.total_tokens):
                options = [-1] + [j for j in range(i) if depth[j] < spec.depth]
                p = options[int(torch.randint(len(options), (), generator=self.own))]
                par.append(p)
                depth.append(1 if p < 0 else depth[p] + 1)
            parents = torch.tensor(par, dtype=torch.long)
        tokens = torch.randint(self.vocab_size, parents.shape, generator=self.own)
        q = None if sampling.greedy else torch.full((len(tokens), self.vocab_size), 1.0 / self.vocab_size)
        return DraftTree(tokens.to(self.device), parents.to(self.device),
                         q.to(self.device) if q is not None else None, "topk" if q is None else "with_replacement")


class CausalLMProposer:
    """Drafts with a causal LM over its own KV cache: the target itself (the reference drafter: under greedy
    decoding every draft on the greedy path is accepted, so a chain of k reaches tau == k+1 exactly), or a
    small_lm drafter. Chains, static and dynamic trees come from `drafting`; this class supplies the next-step
    distribution.

    head: a vocab.DraftHead on the model's LM head: only the draft vocabulary's rows are computed and drafted
    (q zero outside), and `hidden` keeps the decoder's last state (after the final norm); None = the model's own
    logits (its whole forward). The cache keeps whatever prefix of (committed tokens + drafts fed as a chain)
    still matches the committed sequence, so accepted chain drafts are not recomputed; tree levels are fed with
    a tree mask and dropped at the next round.
    """

    feature_layers: tuple[int, ...] = ()
    max_depth = None

    def __init__(self, model, head=None):
        self.model, self.head = model, head
        self.hidden: Tensor | None = None
        self.reset(torch.zeros(0, dtype=torch.long))

    def reset(self, prompt_ids: Tensor) -> None:
        self.seq = prompt_ids.reshape(-1).tolist()
        self.cache = whole_cache()
        self.cached: list[int | None] = []        # the token of each cache entry (None: a tree entry)
        self.positions: list[int] = []            # the position of each cache entry (sliding-window masks)
        self.verified = 0                         # cached[:verified] are committed tokens
        self.fed: list[int] = []                  # this round's draft nodes, in cache order

    def commit(self, tokens: Tensor, features: Tensor | None = None) -> None:
        self.seq.extend(tokens.reshape(-1).tolist())

    def _forward(self, ids: list[int], keep: int, **inputs) -> Tensor:
        """Feed `ids` after the cache; draft logits [keep or len(ids), Vd] in float32 (`hidden`: the last state)."""
        ids = torch.tensor([ids], device=self.model.device)
        if self.head is None:
            logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **inputs).logits[0]
            return logits[-keep:].float() if keep else logits.float()
        hidden, logits = vocab.lm_step(self.model, self.head, keep, input_ids=ids, past_key_values=self.cache,
                                       use_cache=True, **inputs)
        self.hidden = hidden[0, -1]
        return logits[0].float()

    def root(self) -> Tensor:
        """Drop cached entries that the committed sequence does not continue, feed the rest (at least the root)."""
        limit = min(len(self.cached), len(self.seq) - 1)
        keep = min(self.verified, limit)
        while keep < limit and self.cached[keep] == self.seq[keep]:
            keep += 1
        if len(self.cached) > keep:
            self.cache.crop(-(len(self.cached) - keep))
            del self.cached[keep:], self.positions[keep:]
        logits = self._forward(self.seq[keep:], 1)[-1]
        self.cached.extend(self.seq[keep:])
        self.positions.extend(range(keep, len(self.seq)))
        self.verified, self.prefix, self.fed = len(self.seq), len(self.cached), []
        return logits

    def step(self, nodes: list[int], tree) -> Tensor:
        ids = [tree.tokens[n] for n in nodes]
        if len(nodes) == 1 and tree.path(tree.parents[nodes[0]]) == self.fed:
            logits = self._forward(ids, 1)             # the chain so far: the model's own causal mask
            self.cached.extend(ids)
            self.positions.append(len(self.positions))
        else:
            device = self.model.device
            visible = tree.visibility(nodes, self.prefix, self.fed, device)
            depths = [self.prefix - 1 + tree.depths[n] for n in nodes]
            positions = torch.tensor([depths], device=device)
            mask = layer_masks(self.model.config, additive(visible, self.model.dtype), positions[0],
                               torch.tensor(self.positions + depths, device=device))
            logits = self._forward(ids, 0, attention_mask=mask, position_ids=positions)
            self.cached.extend([None] * len(nodes))
            self.positions.extend(depths)
        self.fed += nodes
        return logits

    def to_target(self, index: Tensor) -> Tensor:
        return self.head.to_target(index) if self.head is not None else index

    def expand(self, logits: Tensor) -> Tensor:
        return self.head.expand(logits) if self.head is not None else logits

    @torch.inference_mode()
    def propose(self, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
        return drafting.propose(self, spec, sampling, generator)
