"""Draft trees: the structure a proposer hands to the verifier, and the masks/positions the target needs.

A tree has an implicit *root* (the newest committed token, not yet seen by the target) and N draft nodes.
Node i carries a token and a parent pointer (-1 = the root); parents always precede their children, so a
chain of k drafts is `parents = [-1, 0, 1, ..., k-2]`. Wherever a tensor covers "root + nodes" (the
target's tree forward, its logits), row 0 is the root and row i+1 is node i.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

PROPOSALS = ("topk", "with_replacement", "without_replacement")
TREE_KINDS = ("chain", "static", "dynamic")

# EAGLE-1's default static tree (method_specs 1.5): 25 nodes, depth 5; path [i1, i2, ...] means
# "top-i1 token after the root, then the top-i2 token after that one, ...".
EAGLE_DEFAULT_CHOICES: list[list[int]] = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


@dataclass
class TreeSpec:
    """What shape of draft the evaluator asks a proposer for each round."""

    kind: str = "chain"
    """chain | static | dynamic."""
    draft_length: int = 5
    """chain: k draft tokens per round."""
    choices: list[list[int]] | None = None
    """static: Medusa-style paths of top-i indices per depth; None = EAGLE_DEFAULT_CHOICES."""
    depth: int = 5
    """dynamic (EAGLE-2): deepest draft level; nodes sit at depths 1..depth."""
    top_k: int = 8
    """dynamic: branching per expansion (children per expanded node, and frontier width)."""
    total_tokens: int = 48
    """dynamic: nodes kept after reranking (root excluded)."""

    def __post_init__(self):
        if self.kind not in TREE_KINDS:
            raise ValueError(f"tree kind {self.kind!r} is not one of {TREE_KINDS}")
        if self.kind == "static":
            if self.choices is None:
                self.choices = [list(c) for c in EAGLE_DEFAULT_CHOICES]
            static_tree_layout(self.choices)           # a malformed list fails here, not in the first round

    @property
    def max_depth(self) -> int:
        """The deepest draft level this spec asks for (length of per-position acceptance)."""
        if self.kind == "chain":
            return self.draft_length
        if self.kind == "static":
            return max(len(c) for c in self.choices)
        return self.depth

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class DraftTree:
    """A proposal: N draft nodes below the (implicit) root.

    tokens [N] long; parents [N] long (-1 = root, parents precede children);
    q [N, V] or None: the processed draft distribution node i was drawn from (the draft's distribution at
    its parent), needed for stochastic verification of sampled proposals; None for deterministic ones.
    proposal: "topk" (deterministic: greedy / top-k children), "with_replacement" (children drawn i.i.d.
    from q), "without_replacement" (children drawn one after another with earlier siblings excluded).
    draft_stats [N, 3] or None: (top-1 probability, top-2 probability, entropy in nats) of the drafter's own
    temperature-1 distribution that node i was drafted from, filled in only when the proposer was asked to record
    them (`drafting.STATS_FLAG`): the round log and DISCO's stop classifier read them.
    """

    tokens: Tensor
    parents: Tensor
    q: Tensor | None = None
    proposal: str = "topk"
    draft_stats: Tensor | None = None
    depths: Tensor = field(init=False, repr=False)

    def __post_init__(self):
        if self.proposal not in PROPOSALS:
            raise ValueError(f"proposal {self.proposal!r} is not one of {PROPOSALS}")
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError(f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} must be [N]")
        if self.q is not None and self.q.shape[0] != self.tokens.shape[0]:
            raise ValueError(f"q has {self.q.shape[0]} rows for {self.tokens.shape[0]} nodes")
        self.depths = node_depths(self.parents)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if len(self) else 0


def empty_tree(device: torch.device | str = "cpu") -> DraftTree:
    """A tree with no draft nodes: the round is one plain target step."""
    none = torch.zeros(0, dtype=torch.long, device=device)
    return DraftTree(none, none.clone())


def chain(tokens: Tensor, q: Tensor | None = None, proposal: str | None = None) -> DraftTree:
    """A chain tree: tokens [k] drafted one after another; q [k, V] the distributions they were drawn from."""
    k = int(tokens.shape[0])
    parents = torch.arange(-1, k - 1, device=tokens.device)
    return DraftTree(tokens, parents, q, proposal or ("topk" if q is None else "with_replacement"))


def _ancestor_steps(parents: Tensor):
    """Yield (nodes, ancestors) pairs, one per generation: each node's parent, then grandparent, ... (CPU)."""
    par = parents.cpu()
    n = int(par.shape[0])
    if n and not bool((par < torch.arange(n)).all()):
        bad = int((par >= torch.arange(n)).nonzero()[0])
        raise ValueError(f"node {bad} has parent {int(par[bad])}: parents must precede their children")
    nodes, cur = torch.arange(n), par
    while len(nodes):
        alive = cur >= 0
        nodes, cur = nodes[alive], cur[alive]
        if len(nodes):
            yield nodes, cur
            cur = par[cur]


def node_depths(parents: Tensor) -> Tensor:
    """parents [N] -> depths [N] (children of the root have depth 1)."""
    depths = torch.ones(parents.shape[0], dtype=torch.long)
    for nodes, _ in _ancestor_steps(parents):
        depths[nodes] += 1
    return depths.to(parents.device)


def tree_attention_mask(parents: Tensor) -> Tensor:
    """parents [N] -> bool [N+1, N+1] over (root, nodes): entry (i, j) is True iff j is an ancestor of i or i.

    One vectorised step per tree level: node i marks its parent, then its grandparent, ...
    """
    n = int(parents.shape[0])
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for nodes, ancestors in _ancestor_steps(parents):
        mask[nodes + 1, ancestors + 1] = True
    return mask.to(parents.device)


def tree_position_ids(parents: Tensor, prefix_len: int) -> Tensor:
    """Position ids [N+1] of (root, nodes): prefix_len + depth, where prefix_len = tokens already cached."""
    depths = node_depths(parents)
    return prefix_len + torch.cat([depths.new_zeros(1), depths])


def tree_attention_bias(parents: Tensor, prefix_len: int, dtype: torch.dtype) -> Tensor:
    """The 4-D additive mask [1, 1, N+1, prefix_len + N+1] for a target forward over (root, nodes).

    The cached prefix is fully visible; within the tree a row sees its ancestors and itself.
    0 = attend, dtype-min = masked (what sdpa/eager attention take as a float mask).
    """
    tree = tree_attention_mask(parents)
    n1 = tree.shape[0]
    bias = torch.zeros(1, 1, n1, prefix_len + n1, dtype=dtype, device=parents.device)
    bias[0, 0, :, prefix_len:].masked_fill_(~tree, torch.finfo(dtype).min)
    return bias


# The attention layers draftlab verifies drafts with: their KV cache can be cropped (or compacted to a tree path)
# after a rejected draft. Sliding-window and chunked layers are kept whole and restricted by their masks (`layer_masks`).
VERIFIABLE_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


def attention_kinds(text) -> set[str]:
    """The kinds of a model's layers (transformers' `layer_types`: full_attention, sliding_attention,
    linear_attention, ...); a config without them is all full attention, or all sliding-window where it sets a
    `sliding_window` (as Mistral, Mixtral, Phi-3 and Qwen3-MoE build their masks)."""
    types = getattr(text, "layer_types", None)
    if types:
        return set(types)
    return {"sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"}


def whole_cache() -> DynamicCache:
    """A KV cache for speculative decoding: every layer keeps every position (a `DynamicCache` built without the
    model's config), sliding-window layers included, which their masks window instead (`layer_masks`, and the
    model's own masks for a chain). A cache that drops old positions, as transformers builds for those layers, can
    be neither cropped back after a rejected draft nor compacted to a tree path."""
    return DynamicCache()


def layer_masks(config, bias: Tensor, query_pos: Tensor, key_pos: Tensor) -> Tensor | dict[str, Tensor]:
    """An explicit additive mask bias [1, 1, q, k] (a tree mask over a `whole_cache`) as the model's layers need it.
    query_pos [q] / key_pos [k]: the positions of the queries and of every cached + new key. Sliding-window layers
    also mask every key `sliding_window` or more positions before its query (transformers' rule, on positions: a
    tree node at depth d sits at prefix + d), chunked layers every key outside the query's chunk of positions; a
    model with several kinds of layers (Gemma 3, gpt-oss, Llama 4: `layer_types`) gets one mask per kind, the
    mapping transformers' models take instead of a single mask."""
    text = config.get_text_config(decoder=True)
    kinds = attention_kinds(text)
    hidden = {"full_attention": None}      # per kind: the keys it does not see beyond the tree mask (None: none)
    if "sliding_attention" in kinds:
        hidden["sliding_attention"] = key_pos[None, :] <= query_pos[:, None] - text.sliding_window
    if "chunked_attention" in kinds:      # Llama 4: only keys of the query's own chunk of positions
        chunk = text.attention_chunk_size
        hidden["chunked_attention"] = (key_pos[None, :] // chunk) != (query_pos[:, None] // chunk)
    masks = {kind: bias if hidden.get(kind) is None else bias.masked_fill(hidden[kind], torch.finfo(bias.dtype).min)
             for kind in kinds}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def tree_masks(config, parents: Tensor, prefix: int, dtype: torch.dtype) -> Tensor | dict[str, Tensor]:
    """`tree_attention_bias` of a verification forward over (root, nodes) after `prefix` cached positions, as the
    target's layers need it (`layer_masks`)."""
    query = tree_position_ids(parents, prefix)
    key = torch.cat([torch.arange(prefix, device=query.device), query])
    return layer_masks(config, tree_attention_bias(parents, prefix, dtype), query, key)


def additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean visibility [..., q, k] -> the additive float mask attention takes (0 = attend, dtype-min = masked),
    shaped [B, 1, q, k] (B = 1 for a 2-D input)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask if mask.dim() == 4 else mask.view(-1, 1, *mask.shape[-2:])


def children_lists(parents: Tensor) -> list[list[int]]:
    """parents [N] -> N+1 lists of children (node indices), entry 0 for the root, entry i+1 for node i."""
    kids: list[list[int]] = [[] for _ in range(int(parents.shape[0]) + 1)]
    for i, p in enumerate(parents.tolist()):
        kids[p + 1].append(i)
    return kids


def static_tree_layout(choices: list[list[int]]) -> tuple[Tensor, Tensor]:
    """Medusa-style choice list -> (parents [N], ranks [N]) with nodes ordered by depth, then path.

    Node for path [i1, ..., id] has the node of [i1, ..., i(d-1)] as parent and rank id (its top-id index).
    Every prefix of a path must itself be in the list, and so must every lower rank under the same parent
    (a rank-r child is the r-th draw of its parent when sampling: verification goes through the draws in order).
    """
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(paths)}
    parents, ranks = [], []
    for c in paths:
        if not c or min(c) < 0:
            raise ValueError(f"tree choice {list(c)}: a path is a non-empty list of ranks >= 0")
        if len(c) > 1 and c[:-1] not in index:
            raise ValueError(f"tree choice {list(c)} has no parent {list(c[:-1])} in the list")
        if c[-1] > 0 and c[:-1] + (c[-1] - 1,) not in index:
            raise ValueError(f"tree choice {list(c)} skips rank {c[-1] - 1}: {list(c[:-1] + (c[-1] - 1,))} must be "
                             "in the list too")
        parents.append(index[c[:-1]] if len(c) > 1 else -1)
        ranks.append(c[-1])
    return torch.tensor(parents, dtype=torch.long), torch.tensor(ranks, dtype=torch.long)
