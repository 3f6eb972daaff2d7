"""Draft trees: structure helpers, the static layout, and the tree attention mask + positions against brute force."""
import pytest
import torch
from transformers import DynamicCache

from draftlab.trees import (EAGLE_DEFAULT_CHOICES, DraftTree, TreeSpec, chain, children_lists, node_depths,
                            static_tree_layout, tree_attention_bias, tree_attention_mask,
                            tree_position_ids)


def random_parents(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([int(torch.randint(-1, i, (), generator=g)) if i else -1 for i in range(n)])


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def test_chain_is_one_child_per_node():
    t = chain(torch.tensor([5, 6, 7, 8]))
    assert t.parents.tolist() == [-1, 0, 1, 2]
    assert t.depths.tolist() == [1, 2, 3, 4] and t.max_depth == 4 and len(t) == 4
    assert t.proposal == "topk"
    assert chain(torch.tensor([1, 2]), torch.full((2, 4), 0.25)).proposal == "with_replacement"


def test_parents_must_precede_children():
    with pytest.raises(ValueError):
        node_depths(torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError):
        DraftTree(torch.tensor([1]), torch.tensor([-1]), proposal="beam")


@pytest.mark.parametrize("seed", range(4))
def test_mask_positions_and_paths_match_brute_force(seed):
    parents = random_parents(12, seed)
    par = parents.tolist()
    mask = tree_attention_mask(parents)
    assert mask[:, 0].all() and mask.diagonal().all()
    for i in range(len(par)):
        anc = ancestors_or_self(par, i)
        assert mask[i + 1, 1:].nonzero().flatten().tolist() == sorted(anc)
    depths = node_depths(parents)
    assert tree_position_ids(parents, 7).tolist() == [7] + [7 + len(ancestors_or_self(par, i)) for i in range(12)]
    kids = children_lists(parents)
    assert sorted(c for k in kids for c in k) == list(range(12))
    assert all(par[c] == i - 1 for i, k in enumerate(kids) for c in k)
    assert all(depths[i] == len(ancestors_or_self(par, i)) for i in range(12))


def test_attention_bias_shape_and_values():
    parents = torch.tensor([-1, -1, 0])
    bias = tree_attention_bias(parents, prefix_len=5, dtype=torch.float32)
    assert bias.shape == (1, 1, 4, 9)
    assert (bias[0, 0, :, :5] == 0).all()
    visible = bias[0, 0, :, 5:] == 0
    assert torch.equal(visible, tree_attention_mask(parents))


def test_static_layout_of_default_choices():
    parents, ranks = static_tree_layout(EAGLE_DEFAULT_CHOICES)
    assert len(parents) == len(EAGLE_DEFAULT_CHOICES) == 25
    depths = node_depths(parents)
    assert depths.max() == 5 and (depths[1:] >= depths[:-1]).all()     # ordered by depth
    # rebuilding each node's path from parents and ranks gives back the choice list
    par, rk = parents.tolist(), ranks.tolist()
    rebuilt = []
    for i in range(len(par)):
        path, node = [], i
        while node >= 0:
            path.append(rk[node])
            node = par[node]
        rebuilt.append(path[::-1])
    assert sorted(rebuilt) == sorted(EAGLE_DEFAULT_CHOICES)
    with pytest.raises(ValueError):
        static_tree_layout([[0], [1, 0]])                       # [1] missing


def test_tree_spec_defaults_and_depth():
    assert TreeSpec().max_depth == 5
    assert TreeSpec("static").choices == EAGLE_DEFAULT_CHOICES and TreeSpec("static").max_depth == 5
    assert TreeSpec("dynamic", depth=3).max_depth == 3
    assert TreeSpec("chain", draft_length=2).to_dict()["draft_length"] == 2
    with pytest.raises(ValueError):
        TreeSpec("beam")


def test_tree_forward_equals_per_branch_forward(tiny_target):
    """One forward over (root, nodes) with the tree mask and positions == a plain forward per branch."""
    model, _ = tiny_target
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(model.config.vocab_size, (9,), generator=g)
    root = torch.randint(model.config.vocab_size, (1,), generator=g)
    parents = random_parents(10, 3)
    tokens = torch.randint(model.config.vocab_size, (10,), generator=g)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix[None], past_key_values=cache, use_cache=True)
        out = model(input_ids=torch.cat([root, tokens])[None], past_key_values=cache, use_cache=True,
                    attention_mask=tree_attention_bias(parents, 9, model.dtype),
                    position_ids=tree_position_ids(parents, 9)[None])
        par = parents.tolist()
        for i in range(-1, 10):
            path = sorted(ancestors_or_self(par, i)) if i >= 0 else []
            seq = torch.cat([prefix, root, tokens[path]])
            ref = model(input_ids=seq[None]).logits[0, -1]
            torch.testing.assert_close(out.logits[0, i + 1], ref, rtol=1e-4, atol=1e-4)
