"""Acceptance rules: logits processing, the greedy rule, and distributional exactness of stochastic verification.

The statistical tests draw many synthetic rounds on a 6-token vocabulary with a fixed seed and compare the
distribution of the first two emitted tokens with the target's; the same harness must detect a verifier
whose residual step is removed.
"""
import pytest
import torch

from draftlab.trees import DraftTree, chain
from draftlab.verify import Sampling, accept, greedy_accept, stochastic_accept

V = 6


# ------------------------------------------------------------------------------------------------- Sampling

def test_greedy_probs_are_one_hot_argmax():
    logits = torch.randn(3, 10)
    probs = Sampling().probs(logits)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(3))
    assert Sampling().greedy and not Sampling(temperature=0.5).greedy


def test_temperature_top_k_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(Sampling(temperature=2.0).probs(logits), (logits / 2).softmax(-1))
    top2 = Sampling(temperature=1.0, top_k=2).probs(logits)
    assert (top2[0, 2:] == 0).all() and top2[0, :2].sum() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    # top_p: the smallest prefix of the sorted tokens whose mass reaches top_p
    for top_p in (0.5, float(full[0] + full[1]) - 1e-4, 0.95, 0.999):
        kept = (Sampling(temperature=1.0, top_p=top_p).probs(logits)[0] > 0).sum().item()
        need = int((full.cumsum(0) < top_p).sum()) + 1
        assert kept == need
    assert (Sampling(temperature=1.0, top_p=1e-6).probs(logits)[0] > 0).sum() == 1   # always keeps one


def test_sample_is_seeded():
    logits = torch.randn(7, 50)
    s = Sampling(temperature=1.0)
    a = s.sample(logits, torch.Generator().manual_seed(0))
    b = s.sample(logits, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (7,)


# ------------------------------------------------------------------------------------------------- greedy

def logits_with_argmax(argmaxes):
    out = torch.zeros(len(argmaxes), V)
    out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return out


def test_greedy_chain_accepts_the_matching_prefix():
    tree = chain(torch.tensor([1, 2, 3, 4]))
    # target argmax after root, 1, 2, 3, 4
    res = greedy_accept(tree, logits_with_argmax([1, 2, 5, 0, 0]))
    assert res.path == [0, 1] and res.bonus == 5
    res = greedy_accept(tree, logits_with_argmax([1, 2, 3, 4, 0]))
    assert res.path == [0, 1, 2, 3] and res.bonus == 0
    res = greedy_accept(tree, logits_with_argmax([3, 2, 3, 4, 0]))
    assert res.path == [] and res.bonus == 3


def test_greedy_tree_takes_the_longest_path_ties_first():
    # root -> a(0)=1, b(1)=1 (duplicate sibling), c(2)=2; a -> d(3)=3; b -> e(4)=3 -> f(5)=4
    tree = DraftTree(torch.tensor([1, 1, 2, 3, 3, 4]), torch.tensor([-1, -1, -1, 0, 1, 4]))
    # rows: root, a, b, c, d, e, f
    res = greedy_accept(tree, logits_with_argmax([1, 3, 3, 0, 0, 4, 2]))
    assert res.path == [1, 4, 5] and res.bonus == 2            # the deeper branch through b wins
    res = greedy_accept(tree, logits_with_argmax([1, 3, 3, 0, 5, 0, 0]))
    assert res.path == [0, 3] and res.bonus == 5               # equal depth: the first path
    res = greedy_accept(DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)),
                        logits_with_argmax([4]))
    assert res.path == [] and res.bonus == 4


def test_accept_dispatches_on_sampling():
    tree = chain(torch.tensor([1, 2]))
    logits = logits_with_argmax([1, 2, 3]) * 10
    assert accept(tree, logits, Sampling()).path == [0, 1]
    with pytest.raises(ValueError):
        accept(DraftTree(tree.tokens, tree.parents, None, "with_replacement"), logits, Sampling(temperature=1.0))


# ------------------------------------------------------------------------------------------------- stochastic

def tables(seed=0, support=None):
    """p1: target at the root, P2[x]: target after token x, P3: deeper; q1, Q2[x]: the draft's."""
    g = torch.Generator().manual_seed(seed)

    def dist(*shape):
        logits = torch.randn(*shape, V, generator=g) * 1.5
        return Sampling(temperature=1.0, top_k=support or 0).probs(logits)

    return dist(), dist(V), dist(), dist(), dist(V)


def draw(q, m, kind, g):
    if kind == "topk":
        return q.topk(m).indices.tolist()
    return torch.multinomial(q, m, replacement=(kind == "with_replacement"), generator=g).tolist()


def one_round(kind, tabs, g, residual):
    """Draft a tree from q the way `kind` says, verify it, return the first two emitted tokens as one index."""
    p1, P2, P3, q1, Q2 = tabs
    if kind == "chain":
        x1 = int(torch.multinomial(q1, 1, generator=g))
        x2 = int(torch.multinomial(Q2[x1], 1, generator=g))
        tree = chain(torch.tensor([x1, x2]), torch.stack([q1, Q2[x1]]))
    else:           # 3 children under the root, 2 under each of them, drawn as `kind` says
        first = draw(q1, 3, kind, g)
        tokens, parents, qs = list(first), [-1] * 3, [q1] * 3
        for i, a in enumerate(first):
            tokens += draw(Q2[a], 2, kind, g)
            parents += [i, i]
            qs += [Q2[a]] * 2
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents),
                         None if kind == "topk" else torch.stack(qs), kind)
    rows = [p1] + [P2[t] if d == 1 else P3 for t, d in zip(tree.tokens.tolist(), tree.depths.tolist())]
    res = stochastic_accept(tree, torch.stack(rows), g, residual=residual)
    out = tree.tokens[res.path].tolist() + [res.bonus]
    if len(out) == 1:            # the next round would sample the second token from the target
        out.append(int(torch.multinomial(P2[out[0]], 1, generator=g)))
    return out[0] * V + out[1]


def emitted_tvd(kind, residual=True, n=12000, support=None):
    """(TVD between the empirical and the target's first-two-token distribution, a 3x noise bound)."""
    tabs = tables(support=support)
    expected = (tabs[0][:, None] * tabs[1]).flatten()
    g = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.tensor([one_round(kind, tabs, g, residual) for _ in range(n)]), minlength=V * V)
    tvd = 0.5 * (counts.float() / n - expected).abs().sum().item()
    # E|freq - p| <= sqrt(p(1-p)/n) per cell, so E[TVD] <= half the sum; allow three times that
    bound = 1.5 * (expected * (1 - expected) / n).sqrt().sum().item()
    return tvd, bound


KINDS = ["chain", "with_replacement", "without_replacement", "topk"]


@pytest.mark.parametrize("kind", KINDS)
def test_stochastic_verification_emits_the_target_distribution(kind):
    tvd, bound = emitted_tvd(kind, n=12000)
    assert tvd < bound, f"{kind}: TVD {tvd:.4f} >= {bound:.4f}"
    broken, bound = emitted_tvd(kind, residual=False, n=6000)
    assert broken > bound, f"{kind}: a verifier without the residual step went undetected ({broken:.4f})"


def test_chain_with_truncated_supports_stays_exact():
    """top-k processed p and q with different supports: zeros in q and in p."""
    tvd, bound = emitted_tvd("chain", support=3, n=10000)
    assert tvd < bound


def test_identical_draft_is_always_accepted():
    p = tables()[0]
    tree = chain(torch.tensor([2, 4, 1]), p.expand(3, V))
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert len(stochastic_accept(tree, p.expand(4, V) + 0, g).path) == 3


def test_stochastic_accept_is_seeded():
    tabs = tables()
    runs = []
    for seed in (5, 5, 6):
        g = torch.Generator().manual_seed(seed)
        runs.append([one_round("without_replacement", tabs, g, True) for _ in range(30)])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_without_replacement_accepts_either_q_convention():
    """q rows may hold the parent's full distribution or the one with earlier siblings already removed."""
    p1, P2, _, q1, _ = tables()
    tokens = torch.tensor([3, 0, 5])
    conditioned = []
    for j in range(3):
        qj = q1.clone()
        qj[tokens[:j]] = 0
        conditioned.append(qj / qj.sum())
    probs = torch.stack([p1, P2[3], P2[0], P2[5]])
    for seed in range(20):
        full = stochastic_accept(DraftTree(tokens, torch.full((3,), -1), q1.expand(3, V), "without_replacement"),
                                 probs, torch.Generator().manual_seed(seed))
        cond = stochastic_accept(DraftTree(tokens, torch.full((3,), -1), torch.stack(conditioned),
                                           "without_replacement"), probs, torch.Generator().manual_seed(seed))
        assert full == cond
