"""One drafting path for every model-based proposer: the chain loop and the tree builder.

A drafter supplies only its next-step distribution, through four members (the `Steps` protocol):
    root() -> Tensor [Vd]                 draft logits after the newest committed token (the tree's root); each
                                          call starts a new proposal, so anything drafted before is discarded
    step(nodes, tree) -> Tensor [n, Vd]   feed draft nodes (indices into `tree`, whose parents were fed before) and
                                          return the draft logits after each of them
    to_target(index) -> Tensor            indices into the logits' last dimension -> target token ids
    expand(logits) -> Tensor [..., V]     the logits over the target vocabulary (-inf outside a draft vocabulary)
and `max_depth` (None, or the deepest level it can draft: Medusa has one head per level).

`propose` builds the shape a TreeSpec asks for (method_specs 1.5, 2.2):
- chain: k tokens, each drafted after the one before it: the argmax (greedy, "topk") or a draw from the
  processed draft distribution q ("with_replacement"). `stop(i)`, when given, is asked after the drafter has
  read token i-1 and ends the chain at i tokens (SpecDec++'s adaptive length).
- static: Medusa-style choice paths, level by level: the rank-r child of a node is its parent's top-r token
  (greedy, "topk"), or the r-th draw without replacement from the parent's q (sampling, "without_replacement").
- dynamic (EAGLE-2): each level expands the top_k best nodes of the level above, top_k children each; a node's
  score is the cumulative draft log-probability of its path, and the total_tokens best nodes are kept, which is
  a subtree because a score never grows along a path. Deterministic ("topk") under sampling too.

A proposer with the attribute `record_draft_stats = True` (STATS_FLAG; the evaluator sets it while it logs rounds)
also gets, for every node, `draft_stats` of the distribution the node was drafted from (top-1 and top-2
probability, entropy, at temperature 1) in `DraftTree.draft_stats`; off, nothing extra is computed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftlab.trees import DraftTree, TreeSpec, node_depths, static_tree_layout
from draftlab.verify import Sampling

STATS_FLAG = "record_draft_stats"
STATS_NAMES = ("top1", "top2", "entropy")


def draft_stats(logits: Tensor) -> Tensor:
    """Draft logits [..., Vd] -> [..., 3]: top-1 probability, top-2 probability and entropy (nats) of the drafter's
    distribution at temperature 1 (what the round log records and DISCO's classifier reads)."""
    logp = F.log_softmax(logits.float(), -1)
    p = logp.exp()
    top = p.topk(min(2, p.shape[-1]), dim=-1).values
    if top.shape[-1] < 2:
        top = torch.cat([top, torch.zeros_like(top)], -1)
    entropy = -(p * logp).nan_to_num().sum(-1, keepdim=True)     # 0 * -inf (masked words) counts 0
    return torch.cat([top, entropy], -1)


class Nodes:
    """The draft nodes made so far in one proposal: token (target id), parent (-1 = root) and depth of each."""

    def __init__(self, record_stats: bool = False):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.q: list[Tensor] = []
        self.record_stats = record_stats
        self.stats: list[Tensor] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, q: Tensor | None = None, stats: Tensor | None = None) -> int:
        """stats: draft_stats [3] of the distribution the token was drafted from (kept when recording)."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        if q is not None:
            self.q.append(q)
        if self.record_stats and stats is not None:
            self.stats.append(stats)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node` (inclusive); [] for the root (-1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def visibility(self, nodes: list[int], prefix: int, fed: list[int], device) -> Tensor:
        """What `nodes`, fed next into a cache of `prefix` committed entries then the draft nodes `fed`, attend to:
        bool [n, prefix + len(fed) + n], the committed prefix, their ancestors among `fed`, and themselves."""
        column = {node: prefix + c for c, node in enumerate(fed)}
        visible = torch.zeros(len(nodes), prefix + len(fed) + len(nodes), dtype=torch.bool)
        visible[:, :prefix] = True
        for r, node in enumerate(nodes):
            visible[r, prefix + len(fed) + r] = True
            for a in self.path(self.parents[node]):
                if a in column:
                    visible[r, column[a]] = True
        return visible.to(device)

    def tree(self, device, proposal: str = "topk") -> DraftTree:
        tokens = torch.tensor(self.tokens, dtype=torch.long, device=device)
        parents = torch.tensor(self.parents, dtype=torch.long, device=device)
        stats = torch.stack(self.stats) if self.stats and len(self.stats) == len(self.tokens) else None
        if self.q and len(self.q) == len(self.tokens):
            return DraftTree(tokens, parents, torch.stack(self.q), proposal, draft_stats=stats)
        return DraftTree(tokens, parents, draft_stats=stats)


def propose(steps, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None = None,
            stop=None) -> DraftTree:
    """The draft tree `spec` asks for, drafted with `steps` (see the module docstring)."""
    if spec.kind == "chain":
        return chain(steps, spec.draft_length, sampling, generator, stop)
    if spec.kind == "static":
        return static(steps, spec.choices, sampling, generator)
    if spec.kind == "dynamic":
        return dynamic(steps, spec.depth, spec.top_k, spec.total_tokens)
    raise ValueError(f"unknown tree kind {spec.kind!r}: expected chain, static or dynamic")


def _deepest(steps, depth: int) -> int:
    limit = getattr(steps, "max_depth", None)
    return depth if limit is None else min(depth, limit)


def chain(steps, length: int, sampling: Sampling, generator: torch.Generator | None = None, stop=None) -> DraftTree:
    """Up to `length` tokens drafted one after another; stop(i) may end the chain at i tokens (i >= 1)."""
    nodes = Nodes(getattr(steps, STATS_FLAG, False))
    logits = steps.root()
    for i in range(_deepest(steps, length)):
        if i > 0:
            logits = steps.step([i - 1], nodes)[0]
            if stop is not None and stop(i):
                break
        stats = draft_stats(logits) if nodes.record_stats else None
        if sampling.greedy:
            nodes.add(int(steps.to_target(logits.argmax())), i - 1, stats=stats)
        else:
            q = sampling.probs(steps.expand(logits))
            nodes.add(int(torch.multinomial(q, 1, generator=generator)[0]), i - 1, q, stats)
    return nodes.tree(logits.device, "with_replacement")


def _children(steps, logits: Tensor, count: int, sampling: Sampling, generator) -> tuple[list[int], Tensor | None]:
    """`count` ranked children of a node from its draft logits: the top tokens (greedy), or draws without
    replacement from q (as many as q's support holds), with q."""
    if sampling.greedy:
        return steps.to_target(logits.topk(min(count, logits.shape[-1])).indices).tolist(), None
    q = sampling.probs(steps.expand(logits))
    count = min(count, int((q > 0).sum()))
    return torch.multinomial(q, count, replacement=False, generator=generator).tolist(), q


def static(steps, choices: list[list[int]], sampling: Sampling, generator: torch.Generator | None = None) -> DraftTree:
    """A static tree from choice paths ([i1, i2, ...] = the rank-i1 child of the root, then its rank-i2 child, ...).
    Levels below `steps.max_depth` are left out; a child whose rank is beyond what its parent can offer is
    left out with its subtree."""
    layout_parents, ranks = static_tree_layout(choices)
    depths = node_depths(layout_parents).tolist()
    layout_parents, ranks = layout_parents.tolist(), ranks.tolist()
    nodes = Nodes(getattr(steps, STATS_FLAG, False))
    made: dict[int, int] = {}                         # layout index -> node index (absent: left out)
    root = steps.root()
    logits_after = {-1: root}                         # node index -> its draft logits
    for level in range(1, _deepest(steps, max(depths, default=0)) + 1):
        members = [i for i, d in enumerate(depths)
                   if d == level and (layout_parents[i] < 0 or layout_parents[i] in made)]
        if level > 1:      # feed the nodes of the level above that have children on this level
            fed = sorted({made[layout_parents[i]] for i in members})
            if fed:
                logits_after.update(zip(fed, steps.step(fed, nodes)))
        by_parent: dict[int, list[int]] = {}
        for i in members:
            by_parent.setdefault(made[layout_parents[i]] if layout_parents[i] >= 0 else -1, []).append(i)
        for parent, kids in by_parent.items():
            drawn, q = _children(steps, logits_after[parent], max(ranks[i] for i in kids) + 1, sampling, generator)
            stats = draft_stats(logits_after[parent]) if nodes.record_stats else None
            for i in kids:
                if ranks[i] < len(drawn):
                    made[i] = nodes.add(drawn[ranks[i]], parent, q, stats)
    return nodes.tree(root.device, "without_replacement")


def dynamic(steps, depth: int, top_k: int, total_tokens: int) -> DraftTree:
    """EAGLE-2: expand the top_k best nodes per level (top_k children each), keep the total_tokens best."""
    nodes = Nodes(getattr(steps, STATS_FLAG, False))
    root = steps.root().float()
    device = root.device
    k = min(top_k, root.shape[-1])
    first = F.log_softmax(root, -1).topk(k)
    root_stats = draft_stats(root) if nodes.record_stats else None
    frontier = [nodes.add(int(t), -1, stats=root_stats) for t in steps.to_target(first.indices).tolist()]
    scores, all_scores = first.values, [first.values]
    for _ in range(1, _deepest(steps, depth)):
        logits = steps.step(frontier, nodes).float()
        child = F.log_softmax(logits, -1).topk(k)                                           # [k, k]
        stats = draft_stats(logits) if nodes.record_stats else None                         # [k, 3]
        # clamp: a log-prob is never positive, so a child never outscores its parent
        cumulative = (scores[:, None] + child.values.clamp(max=0)).flatten()
        tokens = steps.to_target(child.indices).flatten().tolist()
        made = [nodes.add(t, frontier[i // k], stats=stats[i // k] if stats is not None else None)
                for i, t in enumerate(tokens)]
        all_scores.append(cumulative)
        best = cumulative.topk(min(k, len(cumulative))).indices
        frontier, scores = [made[i] for i in best.tolist()], cumulative[best]
    # Stable sort: on ties a parent (made earlier) ranks before its child, so the kept set is closed.
    keep = torch.sort(torch.cat(all_scores), descending=True, stable=True).indices[:total_tokens].sort().values
    kept = Nodes(nodes.record_stats)
    new_index = {}
    for old in keep.tolist():
        parent = nodes.parents[old]
        new_index[old] = kept.add(nodes.tokens[old], new_index[parent] if parent >= 0 else -1,
                                  stats=nodes.stats[old] if nodes.stats else None)
    return kept.tree(device)
