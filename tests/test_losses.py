"""Properties of draftlab.losses on random logits: no models, no magic numbers."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from draftlab import losses as L

B, T, V, D = 3, 7, 11, 5


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(seed: int = 0, scale: float = 2.0, shape=(B, T, V)) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)) * scale


def _mask(seed: int = 0) -> torch.Tensor:
    m = torch.rand(B, T, generator=_gen(seed + 100)) > 0.3
    m[0, 0] = True  # never empty
    return m.long()


def _div(name, student, teacher, mask, **kw):
    return L.DIVERGENCES[name](student, teacher, mask, **kw)


# --- divergences ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(L.DIVERGENCES))
def test_identical_distributions_give_zero(name):
    x = _logits(1)
    assert _div(name, x, x.clone(), _mask()).abs().item() < 1e-6


@pytest.mark.parametrize("name", sorted(L.DIVERGENCES))
@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_divergences_nonnegative(name, temperature):
    for seed in range(5):
        value = _div(name, _logits(seed), _logits(seed + 50), _mask(seed), temperature=temperature)
        assert value.item() >= -1e-6
        assert torch.isfinite(value)


def test_total_variation_bounded_by_one():
    # near-disjoint sharp distributions push TVD to its bound, never past it
    student = torch.full((1, 1, V), -30.0)
    teacher = torch.full((1, 1, V), -30.0)
    student[..., 0], teacher[..., 1] = 30.0, 30.0
    mask = torch.ones(1, 1)
    tvd = L.total_variation(student, teacher, mask)
    assert 0.99 < tvd.item() <= 1.0 + 1e-6
    for seed in range(5):
        assert L.total_variation(_logits(seed, 5.0), _logits(seed + 9, 5.0), _mask(seed)).item() <= 1.0 + 1e-6


def test_kl_equals_closed_form_on_hand_made_distributions():
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([0.25, 0.25, 0.5])
    closed_fkl = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # sum p log(p/q)
    closed_rkl = 0.25 * math.log(0.5) + 0.5 * math.log(2)  # sum q log(q/p)
    closed_tvd = 0.25
    m = 0.5 * (p + q)
    closed_jsd = 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()
    student, teacher = q.log().view(1, 1, 3), p.log().view(1, 1, 3)
    mask = torch.ones(1, 1)
    assert L.forward_kl(student, teacher, mask).item() == pytest.approx(closed_fkl, abs=1e-6)
    assert L.reverse_kl(student, teacher, mask).item() == pytest.approx(closed_rkl, abs=1e-6)
    assert L.total_variation(student, teacher, mask).item() == pytest.approx(closed_tvd, abs=1e-6)
    assert L.jsd(student, teacher, mask, beta=0.5).item() == pytest.approx(closed_jsd.item(), abs=1e-6)
    # the symmetric JSD is bounded by log 2 and symmetric in its arguments
    assert L.jsd(teacher, student, mask).item() == pytest.approx(closed_jsd.item(), abs=1e-6)
    # teacher given as probabilities: same values
    probs = p.view(1, 1, 3)
    assert L.forward_kl(student, None, mask, teacher_probs=probs).item() == pytest.approx(closed_fkl, abs=1e-6)
    assert L.reverse_kl(student, None, mask, teacher_probs=probs).item() == pytest.approx(closed_rkl, abs=1e-6)


def test_kl_matches_torch_kl_div_on_random_logits():
    student, teacher, mask = _logits(3), _logits(4), torch.ones(B, T)
    log_q, log_p = F.log_softmax(student, -1), F.log_softmax(teacher, -1)
    fkl = F.kl_div(log_q, log_p, log_target=True, reduction="sum") / (B * T)
    rkl = F.kl_div(log_p, log_q, log_target=True, reduction="sum") / (B * T)
    assert L.forward_kl(student, teacher, mask).item() == pytest.approx(fkl.item(), rel=1e-5)
    assert L.reverse_kl(student, teacher, mask).item() == pytest.approx(rkl.item(), rel=1e-5)


def test_jsd_beta_limits():
    # float64 so that the small-beta differences are not rounding noise
    student, teacher, mask = _logits(5, 1.0).double(), _logits(6, 1.0).double(), _mask(5)
    fkl = L.forward_kl(student, teacher, mask).item()
    rkl = L.reverse_kl(student, teacher, mask).item()
    p, q = F.softmax(teacher, -1), F.softmax(student, -1)
    # closed-form second-order coefficients (derived in the jsd docstring), per token then masked mean
    chi2_pq = L._masked_mean(((p - q) ** 2 / q).sum(-1), mask).item()
    chi2_qp = L._masked_mean(((q - p) ** 2 / p).sum(-1), mask).item()

    # both ends are exactly 0: M collapses onto the distribution that carries all the weight
    assert abs(L.jsd(student, teacher, mask, beta=0.0).item()) < 1e-12
    assert abs(L.jsd(student, teacher, mask, beta=1.0).item()) < 1e-12

    # beta -> 0: JSD / beta -> KL(p||q), the error shrinking linearly with slope -chi2(p||q) / 2
    for beta in [1e-2, 1e-3, 1e-4]:
        value = L.jsd(student, teacher, mask, beta=beta).item()
        assert value / beta == pytest.approx(fkl, rel=beta * chi2_pq)
        assert (value - beta * fkl) / beta**2 == pytest.approx(-chi2_pq / 2, rel=20 * beta)
    # beta -> 1: JSD / (1 - beta) -> KL(q||p), slope -chi2(q||p) / 2
    for g in [1e-2, 1e-3, 1e-4]:
        value = L.jsd(student, teacher, mask, beta=1.0 - g).item()
        assert value / g == pytest.approx(rkl, rel=g * chi2_qp)
        assert (value - g * rkl) / g**2 == pytest.approx(-chi2_qp / 2, rel=20 * g)

    with pytest.raises(ValueError):
        L.jsd(student, teacher, mask, beta=1.5)


def test_divergence_needs_exactly_one_teacher():
    x = _logits()
    with pytest.raises(ValueError):
        L.forward_kl(x, None, _mask())
    with pytest.raises(ValueError):
        L.forward_kl(x, x, _mask(), teacher_probs=F.softmax(x, -1))


@pytest.mark.parametrize("name", sorted(L.DIVERGENCES))
def test_teacher_probs_equal_teacher_logits(name):
    student, teacher, mask = _logits(7), _logits(8), _mask(7)
    for temperature in (1.0, 2.0):
        from_logits = _div(name, student, teacher, mask, temperature=temperature)
        from_probs = _div(name, student, None, mask, temperature=temperature, teacher_probs=F.softmax(teacher, -1))
        assert from_probs.item() == pytest.approx(from_logits.item(), rel=1e-4, abs=1e-6)


def test_sparse_teacher_probs():
    teacher = _logits(9)
    log_p = F.log_softmax(teacher, -1)
    k = 4
    top_lp, top_ids = log_p.topk(k, dim=-1)
    tail = 1.0 - top_lp.exp().sum(-1)
    dense = L.sparse_teacher_probs(top_ids, top_lp, tail, V)
    assert dense.shape == (B, T, V)
    assert torch.allclose(dense.sum(-1), torch.ones(B, T), atol=1e-5)
    assert torch.allclose(dense.gather(-1, top_ids), top_lp.exp(), atol=1e-5)
    # the tail is spread uniformly over the other tokens
    others = torch.ones(B, T, V, dtype=torch.bool).scatter(-1, top_ids, False)
    expected_tail = (tail / (V - k)).unsqueeze(-1).expand(B, T, V)
    assert torch.allclose(dense[others], expected_tail[others], atol=1e-6)
    # tail computed when not given
    assert torch.allclose(L.sparse_teacher_probs(top_ids, top_lp, None, V), dense, atol=1e-6)
    # with the full vocabulary the dense teacher is exact
    all_lp, all_ids = log_p.topk(V, dim=-1)
    full = L.sparse_teacher_probs(all_ids, all_lp, torch.zeros(B, T), V)
    assert torch.allclose(full, log_p.exp(), atol=1e-6)
    # every divergence runs on it, finite, and is 0 against the exact teacher itself
    student, mask = _logits(10), _mask(10)
    for name, fn in L.DIVERGENCES.items():
        assert torch.isfinite(fn(student, None, mask, teacher_probs=dense)), name
        assert abs(fn(teacher, None, mask, teacher_probs=full).item()) < 1e-5, name
    # a sparse teacher with no tail at all: reverse KL stays finite
    no_tail = L.sparse_teacher_probs(top_ids, top_lp - top_lp.exp().sum(-1, keepdim=True).log(), torch.zeros(B, T), V)
    assert torch.isfinite(L.reverse_kl(student, None, mask, teacher_probs=no_tail))


# --- normalisation and masking (every loss) -----------------------------------------------------------------

def _all_losses(seed: int, mask: torch.Tensor, batch_repeat: int = 1):
    """Every scalar loss at once, on inputs built from seed and repeated batch_repeat times along B."""
    rep = lambda t: t.repeat(batch_repeat, *([1] * (t.dim() - 1)))  # noqa: E731
    student, teacher = rep(_logits(seed)), rep(_logits(seed + 1))
    feats, feats_t = rep(_logits(seed + 2, shape=(B, T, D))), rep(_logits(seed + 3, shape=(B, T, D)))
    labels = rep(torch.randint(0, V, (B, T), generator=_gen(seed)))
    acc_logits, soft = rep(torch.randn(B, T, generator=_gen(seed))), rep(torch.rand(B, T, generator=_gen(seed)))
    mask = rep(mask)
    out = {
        "smooth_l1": L.masked_smooth_l1(feats, feats_t, mask),
        "soft_ce": L.soft_cross_entropy(student, teacher, mask, temperature=1.5),
        "topk_ce": L.topk_cross_entropy(student, teacher, mask, k=3),
        "hard_ce": L.hard_cross_entropy(student, labels, mask),
        "acceptance_bce": L.acceptance_bce(acc_logits, soft, mask),
    }
    for name, fn in L.DIVERGENCES.items():
        out[name] = fn(student, teacher, mask)
    return out


def test_duplicating_the_batch_leaves_every_loss_unchanged():
    mask = _mask(11)
    once, twice = _all_losses(11, mask), _all_losses(11, mask, batch_repeat=2)
    for name in once:
        assert twice[name].item() == pytest.approx(once[name].item(), rel=1e-5, abs=1e-7), name


def test_masked_out_positions_do_not_change_any_loss():
    mask = _mask(12)
    base = _all_losses(12, mask)
    # change every input at masked-out positions only: rebuild with other seeds and splice
    other = _all_losses(13, mask)  # different inputs everywhere: must differ (sanity)
    assert any(abs(other[k].item() - base[k].item()) > 1e-4 for k in base)

    student, teacher = _logits(12), _logits(13)
    noise = _logits(99, 50.0)
    off = (mask == 0).unsqueeze(-1)
    for name, fn in L.DIVERGENCES.items():
        ref = fn(student, teacher, mask)
        moved = fn(student + noise * off, teacher - noise * off, mask)
        assert moved.item() == pytest.approx(ref.item(), rel=1e-6), name
    ref = L.soft_cross_entropy(student, teacher, mask)
    assert L.soft_cross_entropy(student + noise * off, teacher, mask).item() == pytest.approx(ref.item(), rel=1e-6)
    labels = torch.randint(0, V, (B, T), generator=_gen(1))
    ref = L.hard_cross_entropy(student, labels, mask)
    assert L.hard_cross_entropy(student, labels.masked_fill(mask == 0, -100), mask).item() == pytest.approx(ref.item())
    acc, soft = torch.randn(B, T, generator=_gen(2)), torch.rand(B, T, generator=_gen(3))
    ref = L.acceptance_bce(acc, soft, mask)
    moved = L.acceptance_bce(acc + 40 * (mask == 0), soft.masked_fill(mask == 0, 0.0), mask)
    assert moved.item() == pytest.approx(ref.item(), rel=1e-6)


def test_empty_mask_gives_zero_with_gradient_and_no_nan():
    empty = torch.zeros(B, T, dtype=torch.long)
    student = _logits(14).requires_grad_()
    feats = _logits(15, shape=(B, T, D)).requires_grad_()
    acc = torch.randn(B, T, generator=_gen(16)).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=_gen(18))
    values = [
        L.masked_smooth_l1(feats, feats.detach() + 1, empty),
        L.soft_cross_entropy(student, _logits(19), empty),
        L.topk_cross_entropy(student, _logits(19), empty),
        L.hard_cross_entropy(student, labels, empty),
        L.acceptance_bce(acc, torch.rand(B, T, generator=_gen(20)), empty),
        *[fn(student, _logits(21), empty) for fn in L.DIVERGENCES.values()],
    ]
    for value in values:
        assert value.item() == 0.0 and value.requires_grad
    torch.stack(values).sum().backward()
    for leaf in (student, feats, acc):
        assert leaf.grad is not None and torch.all(leaf.grad == 0)


# --- individual losses ----------------------------------------------------------------------------------------

def test_soft_ce_equals_hard_ce_for_one_hot_targets():
    student, mask = _logits(22), _mask(22)
    labels = torch.randint(0, V, (B, T), generator=_gen(22))
    one_hot = F.one_hot(labels, V).float() * 1e4  # softmax of this is one-hot to float precision
    assert L.soft_cross_entropy(student, one_hot, mask).item() == pytest.approx(
        L.hard_cross_entropy(student, labels, mask).item(), rel=1e-5)
    # the soft CE is the forward KL plus the teacher entropy
    teacher = _logits(23)
    p = F.softmax(teacher, -1)
    entropy = L._masked_mean(-(p * p.log()).sum(-1), mask)
    assert L.soft_cross_entropy(student, teacher, mask).item() == pytest.approx(
        (L.forward_kl(student, teacher, mask) + entropy).item(), rel=1e-5)


def test_topk_ce_grows_to_soft_ce_with_k():
    student, teacher, mask = _logits(24), _logits(25), _mask(24)
    values = [L.topk_cross_entropy(student, teacher, mask, k=k).item() for k in range(1, V + 1)]
    assert all(b >= a - 1e-6 for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(L.soft_cross_entropy(student, teacher, mask).item(), rel=1e-5)
    assert L.topk_cross_entropy(student, teacher, mask, k=10 * V).item() == pytest.approx(values[-1], rel=1e-6)


def test_smooth_l1_matches_torch_on_full_mask_and_beta():
    pred, target = _logits(26, shape=(B, T, D)), _logits(27, shape=(B, T, D))
    full = torch.ones(B, T)
    for beta in (0.5, 1.0, 2.0):
        ref = F.smooth_l1_loss(pred, target, beta=beta)  # mean over everything = mean over D then positions
        assert L.masked_smooth_l1(pred, target, full, beta=beta).item() == pytest.approx(ref.item(), rel=1e-6)
    assert L.masked_smooth_l1(pred, pred.clone(), full).item() == 0.0


def test_acceptance_labels_on_hand_made_distributions():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]])
    q = torch.tensor([[0.25, 0.6, 0.1, 0.05], [0.1, 0.0, 0.5, 0.4]])
    tokens = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    labels = L.acceptance_labels(p.unsqueeze(1).expand(2, 4, 4), q.unsqueeze(1).expand(2, 4, 4), tokens)
    expected = torch.tensor([[1.0, 0.5, 1.0, 0.0], [1.0, 1.0, 0.8, 1.0]])  # q(x)=0 < p(x) -> 1
    assert torch.allclose(labels, expected)
    # the mean label under x ~ q is the acceptance rate 1 - TVD(p, q)
    p_row, q_row = p[0], q[0]
    alpha = (q_row * L.acceptance_labels(p_row.expand(4, 4), q_row.expand(4, 4), torch.arange(4))).sum()
    assert alpha.item() == pytest.approx(1.0 - 0.5 * (p_row - q_row).abs().sum().item(), abs=1e-6)


def test_acceptance_bce_formula_and_descent():
    z = torch.randn(B, T, generator=_gen(30))
    soft, mask, w = torch.rand(B, T, generator=_gen(31)), _mask(30), 6.0
    m = mask.float()
    sig = torch.sigmoid(z)
    num = (m * (w * (1 - soft) * -torch.log(1 - sig) + soft * -torch.log(sig))).sum()
    den = (m * (w * (1 - soft) + soft)).sum()
    assert L.acceptance_bce(z, soft, mask, reject_weight=w).item() == pytest.approx((num / den).item(), rel=1e-5)
    # moving the logits toward the labels lowers the loss, and a gradient step does too
    target_logit = torch.logit(soft.clamp(0.02, 0.98))
    previous = L.acceptance_bce(z, soft, mask).item()
    for frac in (0.25, 0.5, 0.75, 1.0):
        value = L.acceptance_bce(z + frac * (target_logit - z), soft, mask).item()
        assert value < previous
        previous = value
    zz = z.clone().requires_grad_()
    loss = L.acceptance_bce(zz, soft, mask)
    loss.backward()
    assert L.acceptance_bce(zz.detach() - 0.1 * zz.grad, soft, mask).item() < loss.item()


@pytest.mark.parametrize("name", ["soft_ce", "topk_ce", "hard_ce", "fkl", "rkl", "jsd", "tvd"])
def test_gradients_flow_to_the_student_and_descend(name):
    student = _logits(32).requires_grad_()
    teacher, mask = _logits(33), _mask(32)
    labels = teacher.argmax(-1)
    fns = {
        "soft_ce": lambda s: L.soft_cross_entropy(s, teacher, mask),
        "topk_ce": lambda s: L.topk_cross_entropy(s, teacher, mask, k=3),
        "hard_ce": lambda s: L.hard_cross_entropy(s, labels, mask),
        **{k: (lambda s, f=f: f(s, teacher, mask)) for k, f in L.DIVERGENCES.items()},
    }
    loss = fns[name](student)
    loss.backward()
    grad = student.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert torch.all(grad[mask == 0] == 0)  # masked positions get no gradient
    assert fns[name](student.detach() - 0.5 * grad / grad.norm()).item() < loss.item()


def test_bf16_inputs_give_float32_losses():
    student, teacher, mask = _logits(34).bfloat16(), _logits(35).bfloat16(), _mask(34)
    for fn in L.DIVERGENCES.values():
        value = fn(student, teacher, mask)
        assert value.dtype == torch.float32 and torch.isfinite(value)
