"""Every training loss of draftlab, as pure functions on tensors.

Conventions shared by all functions here:
- Shapes: B = batch, T = sequence length, V = vocabulary, D = feature width.
- ``mask [B, T]`` marks the positions that count (1 / True). Each loss is a sum over those positions divided by
  their number, so duplicating a batch or padding it with masked-out positions leaves it unchanged. An all-zero
  mask gives an exact 0 that still belongs to the autograd graph (``backward()`` works, gradients are 0, no NaN).
- Arithmetic is done in at least float32 (bf16 / fp16 inputs are upcast, float64 stays float64): log-softmax
  over a large vocabulary in bf16 loses too much precision.
- Nothing here reads a config, a module or a global: the drafters pick the terms and their weights.

References (formulas in ../shared/reference/method_specs.md): EAGLE-1 regression and soft-target CE (2.1),
HASS top-K term (2.4), hard cross-entropy (Medusa heads, 3), distillation divergences (4.1), SpecDec++
acceptance labels and class-weighted BCE (5); DFlash's decayed block cross-entropy (arXiv 2602.06036).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# log of the smallest normal float32: where a teacher gives probability exactly 0, log p is floored here so
# that q * log p stays finite in the reverse KL (e^-87 is far below anything a real model assigns)
_LOG_FLOOR = math.log(torch.finfo(torch.float32).tiny)


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """values [B, T] per-token losses, mask [B, T] -> scalar: sum over valid positions / their number (0 if none)."""
    valid = mask.bool()
    # masked_fill rather than a product: a non-finite value at an ignored position must not turn into NaN
    return values.masked_fill(~valid, 0.0).sum() / valid.sum().clamp(min=1)


def _up(x: Tensor) -> Tensor:
    """At least float32 (bf16/fp16 are upcast; float64 stays float64, which the tests use for tight limits)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _log_softmax(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """logits [..., V] -> log-probabilities [..., V] (at least float32) at the given temperature."""
    return F.log_softmax(_up(logits) / temperature, dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# Feature regression and cross-entropies (EAGLE, HASS, Medusa, black-box distillation)


def masked_smooth_l1(pred: Tensor, target: Tensor, mask: Tensor, beta: float = 1.0) -> Tensor:
    """EAGLE-1 feature regression: SmoothL1 averaged over the feature dimension, masked mean over positions.

    pred, target [B, T, D]; mask [B, T]; beta: the SmoothL1 switch point (quadratic below, linear above).
    Returns a scalar.
    """
    per_token = F.smooth_l1_loss(_up(pred), _up(target), reduction="none", beta=beta).mean(dim=-1)
    return _masked_mean(per_token, mask)


def soft_cross_entropy(logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Cross-entropy against the soft target distribution (EAGLE's classification loss).

    Per position: -sum_v softmax(target_logits / T)(v) * log_softmax(logits / T)(v).
    logits, target_logits [B, T, V]; mask [B, T]. Returns a scalar (masked mean).
    It equals the forward KL plus the target's entropy, so the two have the same gradient in ``logits``.
    """
    p = _log_softmax(target_logits, temperature).exp()
    per_token = -(p * _log_softmax(logits, temperature)).sum(dim=-1)
    return _masked_mean(per_token, mask)


def topk_cross_entropy(logits: Tensor, target_logits: Tensor, mask: Tensor, k: int = 10) -> Tensor:
    """HASS top-K distillation term: the soft CE restricted to the target's K most likely tokens.

    Per position: -sum_{v in TopK(p)} p(v) log q(v), p = softmax(target_logits), q = softmax(logits); p is the
    full-vocabulary probability (not renormalised over the K tokens), as HASS writes it.
    logits, target_logits [B, T, V]; mask [B, T]; k is clipped to V. Returns a scalar (masked mean).
    """
    p = _log_softmax(target_logits).exp()
    top_p, top_ids = p.topk(min(k, p.shape[-1]), dim=-1)  # [B, T, k]
    log_q = _log_softmax(logits).gather(-1, top_ids)
    return _masked_mean(-(top_p * log_q).sum(dim=-1), mask)


def hard_cross_entropy(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """Ordinary next-token cross-entropy with integer labels, masked mean over positions.

    logits [B, T, V]; labels [B, T] (already aligned with logits: no shift here); mask [B, T].
    A negative label (e.g. -100) counts as masked, whatever the mask says. Returns a scalar.
    """
    valid = mask.bool() & (labels >= 0)
    safe_labels = labels.masked_fill(~valid, 0)  # any in-range id: the value is ignored but must index
    per_token = F.cross_entropy(_up(logits).flatten(0, -2), safe_labels.flatten(), reduction="none")
    return _masked_mean(per_token.view_as(labels), valid)


# ---------------------------------------------------------------------------------------------------------------
# Divergences between a teacher p and a student q (white-box distillation, DistillSpec / OSD / GKD)
#
# All take student_logits [B, T, V] and the teacher either as logits (teacher_logits [B, T, V]) or, with
# teacher_logits=None, as probabilities (teacher_probs= [B, T, V], e.g. from sparse_teacher_probs). The
# temperature T divides both logit sets; teacher probabilities are tempered the same way (p**(1/T), renormalised).
# No T**2 factor is applied: scale the loss in the caller if you want Hinton's convention.


def _teacher_student(student_logits: Tensor, teacher_logits: Tensor | None, temperature: float,
                     teacher_probs: Tensor | None) -> tuple[Tensor, Tensor]:
    """-> (log_q, log_p), both [B, T, V]; log_p is floored at _LOG_FLOOR where p is 0."""
    if (teacher_logits is None) == (teacher_probs is None):
        raise ValueError("give the teacher as exactly one of teacher_logits or teacher_probs=")
    log_q = _log_softmax(student_logits, temperature)
    if teacher_probs is None:
        log_p = _log_softmax(teacher_logits, temperature)
    else:
        log_p = _up(teacher_probs).log()
        if temperature != 1.0:
            log_p = F.log_softmax(log_p / temperature, dim=-1)
    return log_q, log_p.clamp(min=_LOG_FLOOR)


def forward_kl(student_logits: Tensor, teacher_logits: Tensor | None, mask: Tensor, temperature: float = 1.0,
               *, teacher_probs: Tensor | None = None) -> Tensor:
    """KL(p || q) = sum_v p (log p - log q), masked mean over positions. Mode-covering. Returns a scalar."""
    log_q, log_p = _teacher_student(student_logits, teacher_logits, temperature, teacher_probs)
    per_token = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return _masked_mean(per_token, mask)


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor | None, mask: Tensor, temperature: float = 1.0,
               *, teacher_probs: Tensor | None = None) -> Tensor:
    """KL(q || p) = sum_v q (log q - log p), masked mean over positions. Mode-seeking. Returns a scalar.

    Where the teacher gives probability 0 (a sparse teacher with no tail mass), log p is floored at about -87,
    so the loss stays finite but large for a student that puts mass there.
    """
    log_q, log_p = _teacher_student(student_logits, teacher_logits, temperature, teacher_probs)
    per_token = (log_q.exp() * (log_q - log_p)).sum(dim=-1)
    return _masked_mean(per_token, mask)


def jsd(student_logits: Tensor, teacher_logits: Tensor | None, mask: Tensor, temperature: float = 1.0,
        beta: float = 0.5, *, teacher_probs: Tensor | None = None) -> Tensor:
    """Generalised Jensen-Shannon divergence, masked mean over positions. Returns a scalar.

    JSD_beta = beta KL(p || M) + (1 - beta) KL(q || M), with M = beta p + (1 - beta) q, beta in [0, 1];
    beta = 0.5 is the symmetric JSD (bounded by log 2).
    Limits (both ends give 0, because M collapses onto the distribution with weight 1):
      beta -> 0:  JSD_beta = beta KL(p||q) - beta^2 chi2(p||q) / 2 + O(beta^3), so JSD_beta / beta -> KL(p||q);
      beta -> 1:  with g = 1 - beta, JSD_beta = g KL(q||p) - g^2 chi2(q||p) / 2 + O(g^3), so
                  JSD_beta / (1 - beta) -> KL(q||p);
    where chi2(p||q) = sum_v (p - q)^2 / q. (Expand log M = log q + log(1 + beta (p - q) / q) to second order.)
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    log_q, log_p = _teacher_student(student_logits, teacher_logits, temperature, teacher_probs)
    # log M computed in log space; log(0) = -inf is fine inside logsumexp at the ends beta = 0 or 1
    log_beta = math.log(beta) if beta > 0 else -math.inf
    log_1m_beta = math.log1p(-beta) if beta < 1 else -math.inf
    log_m = torch.logsumexp(torch.stack([log_p + log_beta, log_q + log_1m_beta]), dim=0)
    kl_p_m = (log_p.exp() * (log_p - log_m)).sum(dim=-1)
    kl_q_m = (log_q.exp() * (log_q - log_m)).sum(dim=-1)
    return _masked_mean(beta * kl_p_m + (1.0 - beta) * kl_q_m, mask)


def total_variation(student_logits: Tensor, teacher_logits: Tensor | None, mask: Tensor, temperature: float = 1.0,
                    *, teacher_probs: Tensor | None = None) -> Tensor:
    """Total variation distance 0.5 * sum_v |p - q| (a sum over V, not a mean), masked mean; in [0, 1].

    1 - TVD(p, q) is the acceptance probability of a draft token sampled from q against target p, so the mean
    TVD is one minus the expected acceptance rate (method_specs 4.1). Returns a scalar.
    """
    log_q, log_p = _teacher_student(student_logits, teacher_logits, temperature, teacher_probs)
    per_token = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(dim=-1)
    return _masked_mean(per_token, mask)


# name -> divergence, all called as fn(student_logits, teacher_logits, mask, temperature, teacher_probs=...);
# jsd also takes beta (bind it with functools.partial(jsd, beta=...) to keep one call shape)
DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tvd": total_variation}


def sparse_teacher_probs(topk_ids: Tensor, topk_logprobs: Tensor, tail_mass: Tensor | None, vocab: int) -> Tensor:
    """Dense teacher probabilities [B, T, V] rebuilt from dumped top-k log-probabilities.

    topk_ids [B, T, k] (distinct ids in [0, vocab)); topk_logprobs [B, T, k] (full-vocabulary log-probabilities
    of those tokens); tail_mass [B, T] = the probability of all other tokens (None: 1 - sum of the top-k).
    The tail is spread uniformly over the vocab - k other tokens, so every token keeps a non-zero probability
    (the reverse KL stays finite) and the top-k tokens keep their exact values. Each row is then renormalised to
    sum to 1, which only absorbs rounding in the dump. Pass the result as ``teacher_probs=`` to any divergence.
    """
    top = _up(topk_logprobs).exp()
    tail = (1.0 - top.sum(dim=-1)) if tail_mass is None else _up(tail_mass)
    others = max(vocab - topk_ids.shape[-1], 1)
    probs = (tail.clamp(min=0.0) / others).unsqueeze(-1).expand(*top.shape[:-1], vocab).clone()
    probs.scatter_(-1, topk_ids.long(), top)
    return probs / probs.sum(dim=-1, keepdim=True)


def block_cross_entropy(logits: Tensor, labels: Tensor, mask: Tensor, offsets: Tensor, gamma: float) -> Tensor:
    """DFlash's block-wise cross-entropy with positional decay (Chen et al. 2026, arXiv 2602.06036).

    Each prediction sits at 1-based position k = offsets inside its block (k = 1 is the first token after the
    anchor) and is weighted w_k = exp(-(k - 1) / gamma), so the early positions, on which every later acceptance
    depends, count most; gamma <= 0 turns the decay off (w = 1).
    Per position: w_k * -log softmax(logits)[label]. logits [..., V]; labels, mask, offsets [...]. Returns a scalar:
    the weighted sum over valid positions divided by their number (not by the sum of the weights, as SpecForge
    does: the two differ by a factor set by how many valid positions each rank has).
    """
    logp = _log_softmax(logits)
    nll = -logp.gather(-1, labels.long().clamp(min=0).unsqueeze(-1)).squeeze(-1)
    weight = torch.ones_like(nll)
    if gamma > 0:
        weight = torch.exp(-(offsets.to(nll.dtype) - 1).clamp(min=0) / gamma)
    return _masked_mean(weight * nll, mask)


# ---------------------------------------------------------------------------------------------------------------
# Acceptance head (SpecDec++)


def acceptance_labels(p_target: Tensor, q_draft: Tensor, tokens: Tensor) -> Tensor:
    """Soft acceptance labels min(1, p(x) / q(x)): the probability that rejection sampling accepts draft token x.

    p_target, q_draft [..., V] probabilities of the target and the draft at the same positions; tokens [...]
    the drafted ids. Returns [...] in [0, 1]. Where q(x) = 0 (x could not have been drafted) the label is
    1 if p(x) > 0 else 0.
    """
    index = tokens.long().unsqueeze(-1)
    px = _up(p_target).gather(-1, index).squeeze(-1)
    qx = _up(q_draft).gather(-1, index).squeeze(-1)
    ratio = (px / qx.clamp(min=torch.finfo(torch.float32).tiny)).clamp(max=1.0)
    return torch.where(qx > 0, ratio, (px > 0).to(px.dtype))


def acceptance_bce(logits: Tensor, soft_labels: Tensor, mask: Tensor, reject_weight: float = 6.0) -> Tensor:
    """SpecDec++ class-weighted soft-label binary cross-entropy. Returns a scalar.

    logits [B, T]: the logit of "accepted" (sigma(z) = P(accept)); soft_labels [B, T] = p_t in [0, 1]; mask [B, T].
    L = sum_t m_t [w (1 - p_t) (-log(1 - sigma(z_t))) + p_t (-log sigma(z_t))] / sum_t m_t [w (1 - p_t) + p_t],
    w = reject_weight (6 in SpecDec++, to balance the rarer rejections). The normaliser is the total class weight
    of the valid positions, as in method_specs 5; an empty mask gives 0.
    """
    z, p = _up(logits), _up(soft_labels)
    valid = mask.bool()
    reject_w = reject_weight * (1.0 - p)
    # -log(1 - sigma(z)) = softplus(z) and -log sigma(z) = softplus(-z), both stable for large |z|
    per_token = reject_w * F.softplus(z) + p * F.softplus(-z)
    total_weight = (reject_w + p).masked_fill(~valid, 0.0).sum()
    return per_token.masked_fill(~valid, 0.0).sum() / total_weight.clamp(min=torch.finfo(torch.float32).tiny)
