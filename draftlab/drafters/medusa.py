"""Medusa heads: K parallel heads on the target's last hidden state (Medusa-1; Medusa-2 is in medusa2.py).

Paper: Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (ICML 2024);
method_specs.md 3 (training) and 1.5 (static trees).

What it optimises (Medusa-1, kind "medusa"): head k (0-based) = ResBlock x medusa_layers -> Linear(d, V), with
ResBlock(x) = x + SiLU(W x + b), W and b zero-initialised (each head starts as the identity) and the Linear
initialised from the target's LM head. From the post-norm state h_t, head k predicts token x_{t+2+k} (the
target's own head predicts x_{t+1}); 1-based, head k predicts x_{t+1+k}. Loss: sum_k medusa_weight *
medusa_decay^(k+1) * CE_k (the official recipe's 1-based decay), each CE over positions whose label is an
assistant token.

Tree choices: while training, the loss keeps a running tally (decayed by 0.99 per step) of the rank at which
each head's top-10 list holds the label. `drafter_config()` turns those per-head, per-rank accuracies into a
static tree of `medusa_tree_nodes` paths (the greedy best-first construction of Medusa: the path
[i1, ..., id] is worth prod_k acc[k, i_k]) and saves both; an untrained head uses a prior. The proposer uses
that tree whenever the evaluator asks for a static tree without choices of its own (TreeSpec's default).

Draft vocabulary (`draft_vocab_size`, draftlab/vocab.py): each head's vocabulary projection keeps only the rows
of the most frequent assistant tokens, initialised from the target's LM-head rows of those tokens and trained as
the full one is (the heads stay Medusa's: ResBlocks then a per-head linear, only narrower), so drafting reads
Vd instead of V rows per head and the trainable heads shrink by the same factor. A label outside the draft
vocabulary has no row: it is left out of the cross-entropy, and counted as a miss in the per-rank accuracies
(the heads can never draft it, so the static tree sees the acceptance it will really get). The Medusa export
format has no place for a draft vocabulary: it gets full [V, d] projections, the trained rows in place and the
target's LM-head rows (their initial value) elsewhere (`full_projections`).
"""
from __future__ import annotations

import dataclasses
import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from draftlab import drafting, packing, vocab
from draftlab.drafters.options import DrafterConfig, DraftVocabOption, check_target_size, setting_names, settings
from draftlab.trees import EAGLE_DEFAULT_CHOICES, DraftTree, static_tree_layout

TOPK = 10                      # ranks tallied per head, and the widest rank a static tree may use
TALLY_DECAY = 0.99             # running accuracies weigh the last ~100 training steps


@dataclass
class MedusaConfig(DraftVocabOption, DrafterConfig):
    """drafter.* keys of drafter.kind=medusa."""
    kind: str = "medusa"
    medusa_heads: int = 4
    """Number of heads (head k, 1-based, predicts token t+1+k)."""
    medusa_layers: int = 1
    """Residual blocks per head."""
    medusa_decay: float = 0.8
    """Head k's loss weight is medusa_weight * medusa_decay^k (k = 1..K)."""
    medusa_weight: float = 0.2
    """lambda_0, the coefficient of the heads' loss."""
    medusa_tree_nodes: int = 63
    """Nodes of the static tree built from the per-head accuracies measured in training."""

    @staticmethod
    def packs(drafter_cfg) -> bool:
        return True


def prior_accuracy(num_heads: int, ranks: int = TOPK) -> Tensor:
    """A stand-in for measured accuracies: acc[k, i] = 0.6^(k+1) * 0.5^i (shape of Medusa's published table)."""
    k, i = torch.arange(num_heads, dtype=torch.float32)[:, None], torch.arange(ranks, dtype=torch.float32)
    return 0.6 ** (k + 1) * 0.5 ** i


def choices_from_accuracy(acc: Tensor, num_nodes: int) -> list[list[int]]:
    """Greedy static tree (method_specs 1.5): acc [K, R] = P(head k's rank-i token is the label). Adds, best
    first, the path of largest prod_k acc[k, i_k] among the candidates: the first child of a chosen path and the
    next rank after it, so every prefix of a chosen path and every lower rank under the same parent are chosen
    (a static tree has no rank gaps). Returns num_nodes paths (fewer if K*R allows fewer), by depth then path."""
    acc = acc.float().clamp(min=0).tolist()
    heap = [(-acc[0][0], (0,), 1.0)] if acc and acc[0] else []      # (-value, path, value of its parent)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes:
        neg, path, above = heapq.heappop(heap)
        chosen.append(path)
        level, rank = len(path) - 1, path[-1]
        if rank + 1 < len(acc[level]):                               # the next rank under the same parent
            heapq.heappush(heap, (-above * acc[level][rank + 1], path[:-1] + (rank + 1,), above))
        if level + 1 < len(acc):                                     # the first child
            heapq.heappush(heap, (neg * acc[level + 1][0], path + (0,), -neg))
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


class ResBlock(nn.Module):
    """x + SiLU(W x + b): [..., d] -> [..., d]. identity: W and b start at zero (Medusa's heads begin as the
    identity); otherwise the default Linear initialisation (the acceptance head's blocks)."""

    def __init__(self, d: int, identity: bool = True):
        super().__init__()
        self.linear = nn.Linear(d, d)
        if identity:
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads on the target's post-norm last hidden state (Medusa-1: the target stays frozen)."""

    kind = "medusa"
    card_name = "Medusa-1 heads"
    export_format = "medusa"        # FasterDecoding/Medusa's layout, which TGI reads
    feature_layers = (-1,)
    adapts_target = False
    config_class = MedusaConfig

    def __init__(self, target, medusa_heads: int = MedusaConfig.medusa_heads,
                 medusa_layers: int = MedusaConfig.medusa_layers, medusa_decay: float = MedusaConfig.medusa_decay,
                 medusa_weight: float = MedusaConfig.medusa_weight,
                 medusa_tree_nodes: int = MedusaConfig.medusa_tree_nodes, tree_choices: list | None = None,
                 head_accuracy: list | None = None, draft_vocab_size: int = MedusaConfig.draft_vocab_size,
                 draft_vocab: list[int] | None = None):
        super().__init__()
        if medusa_heads < 1 or medusa_layers < 0:
            raise ValueError(f"drafter.medusa_heads={medusa_heads} must be >= 1 and medusa_layers={medusa_layers} "
                             ">= 0")
        vocab.check_size(draft_vocab_size)
        text = target.config.get_text_config()
        d, vocab_size = text.hidden_size, text.vocab_size
        self.medusa_heads, self.medusa_layers, self.medusa_decay = medusa_heads, medusa_layers, medusa_decay
        self.medusa_weight, self.medusa_tree_nodes = medusa_weight, medusa_tree_nodes
        self.hidden_size, self.vocab_size, self.draft_vocab_size = d, vocab_size, draft_vocab_size
        lm_head = target.get_output_embeddings()
        self.__dict__["target_lm_head"] = lm_head          # held, not owned: the rows a draft vocabulary starts from
        device = lm_head.weight.device
        self.register_buffer("draft_vocab", torch.zeros(0, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("label_index", torch.zeros(0, dtype=torch.long, device=device), persistent=False)
        rows = vocab.as_tensor(draft_vocab, vocab_size, device) if draft_vocab is not None else None
        rows = rows if rows is not None and len(rows) < vocab_size else None
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(d) for _ in range(medusa_layers)],
                                                 self._projection(rows)) for _ in range(medusa_heads))
        if rows is not None:
            self._install_vocab(rows)
        self.to(device=device)
        ranks = min(TOPK, len(rows) if rows is not None else vocab_size)
        self.register_buffer("hits", torch.zeros(medusa_heads, ranks, device=lm_head.weight.device), persistent=False)
        self.register_buffer("seen", torch.zeros(medusa_heads, device=lm_head.weight.device), persistent=False)
        self.saved_accuracy = torch.tensor(head_accuracy) if head_accuracy is not None else None
        self.saved_choices = tree_choices

    def _projection(self, rows: Tensor | None) -> nn.Linear:
        """A head's vocabulary projection [len(rows) or V, d], initialised from the target's LM-head rows."""
        weight = self.target_lm_head.weight
        out = nn.Linear(self.hidden_size, len(rows) if rows is not None else self.vocab_size, bias=False,
                        device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            out.weight.copy_(weight[rows] if rows is not None else weight)
        return out

    def _install_vocab(self, rows: Tensor) -> None:
        self.draft_vocab, self.label_index = rows, vocab.draft_index(rows, self.vocab_size)

    @property
    def reduced(self) -> bool:
        return len(self.draft_vocab) > 0

    def set_vocab(self, token_ids) -> None:
        """Narrow every head's projection to a draft vocabulary (fresh rows from the target's LM head: call before
        training, or load the trained weights after)."""
        rows = vocab.as_tensor(token_ids, self.vocab_size, self.draft_vocab.device)
        if len(rows) >= self.vocab_size:
            return
        for head in self.heads:
            head[-1] = self._projection(rows)
        self._install_vocab(rows)
        self.hits = self.hits.new_zeros(self.medusa_heads, min(TOPK, len(rows)))
        self.seen.zero_()

    def to_target(self, index: Tensor) -> Tensor:
        """Indices into `head_logits`' last dimension -> target token ids."""
        return self.draft_vocab[index] if self.reduced else index

    def logits_from_draft(self, small: Tensor) -> Tensor:
        """Head logits [..., Vd] -> over the target vocabulary [..., V], -inf outside the draft vocabulary."""
        return vocab.expand_logits(small, self.draft_vocab, self.vocab_size) if self.reduced else small

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, cfg=None) -> "MedusaHeads":
        """cfg: a config_class node or any object with its fields (missing ones and None = the defaults)."""
        return cls(target, **settings(cls.config_class, cfg))

    def drafter_config(self) -> dict:
        return {"kind": self.kind, "feature_layers": list(self.feature_layers), "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, **{k: getattr(self, k) for k in setting_names(self.config_class)},
                "head_accuracy": self.head_accuracy().tolist(), "accuracy_measured": bool((self.seen > 0).all()),
                "tree_choices": self.tree_choices(),
                "draft_vocab": self.draft_vocab.tolist() if self.reduced else None}

    def prepare(self, dataset) -> None:
        """Choose the draft vocabulary (drafter.draft_vocab_size) from the training rows' assistant tokens."""
        if self.draft_vocab_size:
            self.set_vocab(vocab.choose(vocab.assistant_token_counts(dataset), self.draft_vocab_size,
                                        self.vocab_size, who=self.kind))

    def checkpoint_tensors(self) -> dict[str, dict[str, Tensor]]:
        """The d2t / t2d maps of a draft vocabulary, for other tools ({} for the full vocabulary)."""
        return vocab.checkpoint_maps(self.draft_vocab, self.vocab_size)

    @classmethod
    def from_config(cls, config: dict, target) -> "MedusaHeads":
        check_target_size(cls.kind, config, target)
        return cls(target, tree_choices=config.get("tree_choices"), head_accuracy=config.get("head_accuracy"),
                   draft_vocab=config.get("draft_vocab"), **settings(cls.config_class, config))

    # --- heads, loss, measured accuracies -----------------------------------------------------------------
    def head_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] -> logits [K, ..., Vd] of every head (Vd = V without a draft vocabulary; `to_target`)."""
        hidden = hidden.to(self.heads[0][-1].weight.dtype)
        return torch.stack([head(hidden) for head in self.heads])

    def heads_loss(self, batch: dict, hidden: Tensor) -> tuple[Tensor, dict[str, float]]:
        """batch: input_ids, attention_mask, loss_mask [B,T]; hidden [B,T,d] post-norm states h_t.
        Head k reads h_t (t real) and is scored on x_{t+2+k} where that token is a real assistant token (and, with
        a draft vocabulary, in it: a label outside has no row, and counts as a miss in the tallied accuracies)."""
        from draftlab.losses import hard_cross_entropy

        ids, docs = batch["input_ids"], packing.doc_ids(batch)
        wanted = batch["loss_mask"].bool() & (docs > 0)
        T = ids.shape[1]
        total = hidden.new_zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        for k, head in enumerate(self.heads):
            shift = 2 + k
            if shift >= T:
                break
            logits = head(hidden[:, :T - shift].to(head[-1].weight.dtype))             # [B, T-shift, Vd]
            labels, mask = ids[:, shift:], wanted[:, shift:] & packing.same_doc(docs, shift)   # same conversation
            if self.reduced:                     # draft indices, -1 (left out of the CE) outside the vocabulary
                labels = self.label_index[labels]
            ce = hard_cross_entropy(logits, labels, mask)
            total = total + self.medusa_weight * self.medusa_decay ** (k + 1) * ce
            with torch.no_grad():
                top = logits.topk(self.hits.shape[1], dim=-1).indices                  # [B, T-shift, R]
                hit = (top == labels[..., None]) & mask[..., None]
                self.hits[k].mul_(TALLY_DECAY).add_(hit.sum((0, 1)).float())
                self.seen[k].mul_(TALLY_DECAY).add_(mask.sum().float())
                metrics[f"loss_{k}"] = ce.item()
                metrics[f"acc_{k}"] = (hit[..., 0].sum() / mask.sum().clamp(min=1)).item()
        return total, metrics

    def loss(self, batch: dict, features: Tensor) -> tuple[Tensor, dict[str, float]]:
        """features [B,T,d]: the target's post-norm last hidden state."""
        return self.heads_loss(batch, features)

    def head_accuracy(self) -> Tensor:
        """[K, R]: P(head k's rank-i token is the label), from training (or as loaded, or the prior)."""
        if bool((self.seen > 0).all()):
            return (self.hits / self.seen[:, None]).cpu()
        if self.saved_accuracy is not None:
            return self.saved_accuracy
        return prior_accuracy(self.medusa_heads, self.hits.shape[1])

    def tree_choices(self) -> list[list[int]]:
        """The static tree for the current accuracies (the loaded one until training measures new ones)."""
        if self.saved_choices is not None and not bool((self.seen > 0).all()):
            try:
                static_tree_layout(self.saved_choices)
                return [list(c) for c in self.saved_choices]
            except ValueError:       # saved before static trees had to be gap-free: rebuilt from the saved accuracies
                pass
        return choices_from_accuracy(self.head_accuracy(), self.medusa_tree_nodes)

    def proposer(self, target=None, **opts) -> "MedusaProposer":
        return MedusaProposer(self)

    # --- export --------------------------------------------------------------------------------------------
    @classmethod
    def export(cls, src, out: Path, meta: dict) -> dict:
        """Medusa heads as FasterDecoding/Medusa writes them (medusa/train/train_legacy.py): config.json with
        medusa_num_heads, medusa_num_layers, base_model_name_or_path, and the `medusa_head` ModuleList's state dict
        ({k}.{j}.linear.weight/bias per ResBlock, {k}.{L}.weight for the vocabulary projection) in
        medusa_lm_head.safetensors (read by TGI and TensorRT-LLM) and medusa_lm_head.pt (read by
        medusa/model/medusa_model*.py). vLLM's `medusa` drafter reads hidden_size and vocab_size (4096 / 32001 when
        missing) and builds the ResBlocks' biases only with medusa_fc_bias: all three are written."""
        heads = {k.removeprefix("heads."): v.contiguous() for k, v in src.weights.items() if k.startswith("heads.")}
        if src.config.get("draft_vocab"):            # the format has no draft vocabulary: full projections, lossless
            heads = full_projections(heads, src.config["draft_vocab"], src.target()[0].get_output_embeddings().weight,
                                     src.config["medusa_layers"])
        save_file(heads, str(out / "medusa_lm_head.safetensors"), {"format": "pt"})
        torch.save(heads, out / "medusa_lm_head.pt")
        base = cls.export_base(src, out, meta)
        config = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
        config.update(medusa_num_heads=src.config["medusa_heads"], medusa_num_layers=src.config["medusa_layers"],
                      base_model_name_or_path=base, version="2", medusa_fc_bias=True)
        config.setdefault("hidden_size", src.config["hidden_size"])
        config.setdefault("vocab_size", src.config["vocab_size"])
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "medusa_choices.json").write_text(json.dumps(src.config.get("tree_choices")) + "\n")
        return {"heads": src.config["medusa_heads"], "layers": src.config["medusa_layers"],
                "merged_target": cls.adapts_target}

    @staticmethod
    def export_base(src, out: Path, meta: dict) -> str:
        """What the export's base_model_name_or_path names: the target."""
        return src.verifier


class MedusaProposer:
    """Drafts from the heads at the newest target state: root = the newest token (the target's own head made
    it), a node at depth d drafts its children with head d (every node of a level reads the same head, method_specs
    1.5), so drafting goes at most K levels deep. Chains, static and dynamic trees come from `drafting`; a static
    tree without choices of its own (TreeSpec's default) is the drafter's measured tree."""

    feature_layers = (-1,)

    def __init__(self, heads: MedusaHeads):
        self.heads = heads
        self.choices = heads.tree_choices()
        self.max_depth = heads.medusa_heads
        self.last = None

    def reset(self, prompt_ids: Tensor) -> None:
        self.last = None                                          # h at the newest processed position [d]

    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        if features is not None and len(features):
            self.last = features[-1]

    def root(self) -> Tensor:
        if self.last is None:
            raise RuntimeError("MedusaProposer.propose needs commit() with the target's features first")
        self.logits = self.heads.head_logits(self.last).float()   # [K, Vd]: draft indices, mapped by to_target
        return self.logits[0]

    def step(self, nodes: list[int], tree) -> Tensor:
        return self.logits[[tree.depths[i] for i in nodes]]

    def to_target(self, index: Tensor) -> Tensor:
        return self.heads.to_target(index)

    def expand(self, logits: Tensor) -> Tensor:
        return self.heads.logits_from_draft(logits)

    @torch.no_grad()
    def propose(self, spec, sampling, generator: torch.Generator | None = None) -> DraftTree:
        if spec.kind == "static" and [list(c) for c in spec.choices] == EAGLE_DEFAULT_CHOICES:
            spec = dataclasses.replace(spec, choices=self.choices)
        return drafting.propose(self, spec, sampling, generator)


def full_projections(weights: dict[str, Tensor], draft_vocab: list[int], lm_head_weight: Tensor,
                     layers: int) -> dict[str, Tensor]:
    """Head weights named `{k}.{j}...` as exported (heads.* prefix removed) with each draft-vocabulary projection
    `{k}.{layers}.weight` [Vd, d] widened to [V, d] for formats without a draft vocabulary: the trained rows at
    their token ids, the target's LM-head rows elsewhere (what every row started from)."""
    ids = torch.tensor(sorted(draft_vocab), dtype=torch.long)
    out = dict(weights)
    for name, w in weights.items():
        if name.endswith(f".{layers}.weight") and w.shape[0] == len(ids):
            full = lm_head_weight.detach().to("cpu", w.dtype).clone()
            full[ids] = w
            out[name] = full.contiguous()
    return out
