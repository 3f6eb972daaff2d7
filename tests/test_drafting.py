"""The shared drafting path (draftlab/drafting.py) against brute force, with toy next-step distributions.

PathSteps: the draft logits after a node are a fixed random function of the node's token path (an autoregressive
drafter); DepthSteps: they depend only on the node's depth (Medusa's heads). Both record what they were fed.
"""
from __future__ import annotations

import pytest
import torch

from draftlab import drafting
from draftlab.trees import EAGLE_DEFAULT_CHOICES, TreeSpec, static_tree_layout
from draftlab.verify import Sampling

V = 12
GREEDY, SAMPLED = Sampling(), Sampling(temperature=1.0)


class PathSteps:
    max_depth = None

    def __init__(self, seed: int = 0):
        self.seed, self.fed = seed, []

    def logits_after(self, path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed,) + path) % (2 ** 31))
        return torch.randn(V, generator=g) * 3

    def root(self):
        self.fed = []
        return self.logits_after(())

    def step(self, nodes, tree):
        for n in nodes:
            assert tree.parents[n] < 0 or tree.parents[n] in self.fed, "a node was fed before its parent"
        self.fed += nodes
        return torch.stack([self.logits_after(tuple(tree.tokens[a] for a in tree.path(n))) for n in nodes])

    def to_target(self, index):
        return index

    def expand(self, logits):
        return logits


class DepthSteps(PathSteps):
    def __init__(self, heads: int):
        super().__init__()
        self.max_depth = heads
        self.logits = torch.randn(heads, V, generator=torch.Generator().manual_seed(1)) * 3

    def root(self):
        return self.logits[0]

    def step(self, nodes, tree):
        return self.logits[[tree.depths[n] for n in nodes]]


def _paths(tree) -> list[tuple[int, ...]]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(len(tokens)):
        path, n = [], i
        while n >= 0:
            path.append(tokens[n])
            n = parents[n]
        out.append(tuple(path[::-1]))
    return out


def test_greedy_chain_follows_the_argmax():
    steps = PathSteps()
    tree = drafting.propose(steps, TreeSpec(draft_length=5), GREEDY)
    path = ()
    for token in tree.tokens.tolist():
        assert token == int(steps.logits_after(path).argmax())
        path += (token,)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3] and tree.proposal == "topk" and tree.q is None


def test_sampled_chain_records_the_distribution_of_each_draw():
    steps = PathSteps()
    tree = drafting.propose(steps, TreeSpec(draft_length=4), SAMPLED, torch.Generator().manual_seed(0))
    assert tree.proposal == "with_replacement" and tree.q.shape == (4, V)
    for row, path in zip(tree.q, [()] + _paths(tree)[:-1]):
        torch.testing.assert_close(row, steps.logits_after(path).softmax(-1))


def test_stop_ends_the_chain_after_the_drafter_read_the_last_token():
    steps, asked = PathSteps(), []
    tree = drafting.chain(steps, 6, GREEDY, stop=lambda i: asked.append(i) or i == 3)
    assert len(tree) == 3 and asked == [1, 2, 3] and steps.fed == [0, 1, 2]


@pytest.mark.parametrize("choices", [EAGLE_DEFAULT_CHOICES, [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]])
def test_greedy_static_tree_takes_each_parents_ranked_tokens(choices):
    steps = PathSteps()
    tree = drafting.propose(steps, TreeSpec("static", choices=choices), GREEDY)
    parents, ranks = static_tree_layout(choices)
    assert tree.parents.tolist() == parents.tolist()
    for path, rank in zip(_paths(tree), ranks.tolist()):
        assert path[-1] == int(steps.logits_after(path[:-1]).argsort(descending=True)[rank])
    assert tree.proposal == "topk"


def test_sampled_static_tree_draws_siblings_without_replacement():
    steps = PathSteps()
    for seed in range(5):
        tree = drafting.propose(steps, TreeSpec("static"), SAMPLED, torch.Generator().manual_seed(seed))
        assert tree.proposal == "without_replacement" and len(tree) == len(EAGLE_DEFAULT_CHOICES)
        paths = _paths(tree)
        assert len(set(paths)) == len(paths)                      # siblings differ
        for row, path in zip(tree.q, paths):
            torch.testing.assert_close(row, steps.logits_after(path[:-1]).softmax(-1))


def test_static_tree_from_depth_only_steps_is_cartesian():
    """Medusa: every node at depth d drafts its children with head d, so rank r at depth d is one token."""
    steps = DepthSteps(heads=5)
    tree = drafting.propose(steps, TreeSpec("static"), GREEDY)
    _, ranks = static_tree_layout(EAGLE_DEFAULT_CHOICES)
    for token, depth, rank in zip(tree.tokens.tolist(), tree.depths.tolist(), ranks.tolist()):
        assert token == int(steps.logits[depth - 1].argsort(descending=True)[rank])


def test_max_depth_caps_every_shape():
    steps = DepthSteps(heads=2)
    assert len(drafting.propose(steps, TreeSpec(draft_length=5), GREEDY)) == 2
    assert drafting.propose(steps, TreeSpec("static"), GREEDY).max_depth == 2
    assert drafting.propose(steps, TreeSpec("dynamic", depth=5, top_k=3, total_tokens=50), GREEDY).max_depth == 2


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_tree_keeps_the_best_scored_closed_subtree(seed):
    """EAGLE-2 against brute force: rebuild every candidate the expansion made, score it by its path's summed
    log-probabilities, and check the kept nodes are exactly the best `total` of them (a closed subtree)."""
    steps, depth, top_k, total = PathSteps(seed), 4, 3, 10
    tree = drafting.propose(steps, TreeSpec("dynamic", depth=depth, top_k=top_k, total_tokens=total), GREEDY)
    assert tree.proposal == "topk" and len(tree) == total

    def score(path):
        return sum(float(steps.logits_after(path[:i]).log_softmax(-1)[path[i]]) for i in range(len(path)))

    candidates, frontier = [], [()]
    for level in range(depth):
        children = [p + (int(t),) for p in frontier for t in steps.logits_after(p).topk(top_k).indices]
        candidates += children
        frontier = sorted(children, key=score, reverse=True)[:top_k]
    best = sorted(candidates, key=score, reverse=True)[:total]
    kept = _paths(tree)
    assert set(kept) == set(best)
    assert all(p[:-1] in set(kept) for p in kept if len(p) > 1)


def test_dynamic_tree_never_keeps_a_child_without_its_parent():
    steps = PathSteps(7)
    for total in (1, 2, 5, 9):
        tree = drafting.propose(steps, TreeSpec("dynamic", depth=3, top_k=3, total_tokens=total), GREEDY)
        parents = tree.parents.tolist()
        assert len(tree) == total and all(p < i for i, p in enumerate(parents))


@pytest.mark.parametrize("choices", [[[0], [2]], [[0], [0, 1]], [[1]], [[0], [-1]]])
def test_static_choices_with_rank_gaps_are_rejected(choices):
    with pytest.raises(ValueError):
        static_tree_layout(choices)
    with pytest.raises(ValueError):
        TreeSpec("static", choices=choices)
