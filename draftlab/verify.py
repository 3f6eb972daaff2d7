"""Acceptance rules: which draft nodes the target accepts, and the token it adds (method_specs 1.2, 1.4).

Pure functions over a `DraftTree` and the target's logits for (root, nodes) [N+1, V]:
- greedy: the longest path whose every token equals the target's argmax at its parent (ties: first);
  the bonus is the target's argmax after that path. Output == target-only greedy decoding.
- stochastic: SpecInfer-style multi-round rejection sampling, lossless for the three proposal kinds
  (i.i.d. children, children without replacement, deterministic top-k); a chain is the one-child case.
Both return an `Acceptance`: the accepted node indices (a root-to-node path) and the bonus token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from draftlab.trees import DraftTree, children_lists


@dataclass
class Sampling:
    """Logits processing shared by draft and target: lossless means w.r.t. these processed probabilities."""

    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """nucleus: keep the smallest set of most likely tokens whose mass reaches top_p (1 = off)."""
    top_k: int = 0
    """keep the top_k most likely tokens (0 = off)."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: Tensor) -> Tensor:
        """logits [..., V] -> processed probabilities [..., V] in float32 (one-hot argmax when greedy)."""
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_p = sorted_logits.softmax(-1)
            # drop a token when the mass of the tokens strictly before it already reaches top_p
            drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= self.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(-1)

    def sample(self, logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """logits [..., V] -> tokens [...]: argmax when greedy, else a draw from `probs`."""
        if self.greedy:
            return logits.argmax(-1)
        p = self.probs(logits)
        return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).reshape(p.shape[:-1])

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


@dataclass
class Acceptance:
    """path: accepted node indices, root to deepest accepted node (len = accepted count); bonus: token id."""

    path: list[int]
    bonus: int


def greedy_accept(tree: DraftTree, target_logits: Tensor) -> Acceptance:
    """Greedy rule. target_logits [N+1, V]: row 0 at the root, row i+1 at node i."""
    argmax = target_logits.argmax(-1)                        # [N+1]
    if len(tree) == 0:
        return Acceptance([], int(argmax[0]))
    parents = tree.parents.tolist()
    match = (tree.tokens.to(argmax.device) == argmax[tree.parents.to(argmax.device) + 1]).tolist()
    accepted = [False] * len(parents)
    best, best_depth = -1, 0
    depths = tree.depths.tolist()
    for i, p in enumerate(parents):
        accepted[i] = match[i] and (p < 0 or accepted[p])
        if accepted[i] and depths[i] > best_depth:          # strict: ties keep the first node found
            best, best_depth = i, depths[i]
    path = []
    node = best
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    return Acceptance(path, int(argmax[best + 1]))


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)); p itself if the residual has no mass (then a rejection had probability 0)."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def stochastic_accept(tree: DraftTree, target_probs: Tensor, generator: torch.Generator | None = None,
                      residual: bool = True) -> Acceptance:
    """Lossless tree verification (method_specs 1.4, generic algorithm).

    target_probs [N+1, V]: processed target probabilities (Sampling.probs) at the root and every node.
    tree.q [N, V] (for sampled proposals): the distribution each node was drawn from, the draft's at its
    parent; for "without_replacement" the verifier zeroes earlier siblings itself (idempotent if q already
    excluded them). Draws use `generator` on target_probs' device. `residual=False` skips the residual
    update after a rejection: that variant is NOT lossless and exists only so tests can show it is caught.
    """
    kids = children_lists(tree.parents)
    tokens = tree.tokens.tolist()
    device = target_probs.device
    path: list[int] = []
    row = 0                                                   # row of the current node in target_probs
    while True:
        p = target_probs[row].float()
        excluded: list[int] = []                              # earlier siblings, for without_replacement
        for c in kids[row]:
            tok = tokens[c]
            if tree.proposal == "topk":
                qj = None                                     # point mass at tok
                ratio = p[tok]
            else:
                qj = tree.q[c].to(device).float()
                if tree.proposal == "without_replacement" and excluded:
                    qj = qj.clone()
                    qj[excluded] = 0
                    qj = qj / qj.sum()
                if qj[tok] <= 0:                              # q could not have drawn it: a proposer bug
                    raise ValueError(f"node {c} (token {tok}) has zero probability under its proposal q")
                ratio = p[tok] / qj[tok]
            u = torch.rand((), device=device, generator=generator)
            if u < ratio:                                     # accept with probability min(1, p/q)
                path.append(c)
                row = c + 1
                break
            if residual:
                if qj is None:
                    p = p.clone()
                    p[tok] = 0
                    p = p / p.sum() if p.sum() > 0 else target_probs[row].float()
                else:
                    p = _residual(p, qj)
            excluded.append(tok)
        else:                                                 # no children left (leaf, or all rejected)
            bonus = torch.multinomial(p, 1, generator=generator)
            return Acceptance(path, int(bonus))


def accept(tree: DraftTree, target_logits: Tensor, sampling: Sampling,
           generator: torch.Generator | None = None) -> Acceptance:
    """Dispatch on sampling: greedy rule at temperature 0, else stochastic verification of processed probs."""
    if sampling.greedy:
        return greedy_accept(tree, target_logits)
    if tree.proposal != "topk" and tree.q is None:
        raise ValueError(f"a {tree.proposal!r} proposal needs q (the draft distributions) to be verified losslessly")
    return stochastic_accept(tree, sampling.probs(target_logits), generator)
