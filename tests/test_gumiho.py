"""Gumiho heads: the serial and parallel parts both train, the MLP terms' alignment, drafting past depth s from the
MLP heads (against a no-cache reference), lossless greedy and sampled speculation on chains and trees, tau rising
on a learnable task, save -> load, the recipe with in-loop evaluation and resume, the official layout export."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from draftlab.drafters.gumiho import GumihoHeads
from draftlab.evaluator import speculative_generate, target_generate
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling

SMALL = dict(serial_tokens=2, serial_layers=1, mlp_heads=3, mlp_layers=1)
SPECS = [TreeSpec(kind="chain", draft_length=5), TreeSpec(kind="static"),
         TreeSpec(kind="dynamic", depth=5, top_k=3, total_tokens=12)]


def _heads(model, seed: int = 0, **cfg) -> GumihoHeads:
    torch.manual_seed(seed)
    return GumihoHeads.from_target(model, SimpleNamespace(**{**SMALL, **cfg}))


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text)["input_ids"])


def _features(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states[-1]


def _batch(ids: torch.Tensor, loss_mask=None) -> dict:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids) if loss_mask is None else loss_mask}


def _fit(heads, batch, feats, steps: int, lr: float = 3e-3) -> list[float]:
    opt = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=lr)
    heads.train()
    losses = []
    for _ in range(steps):
        loss, _ = heads.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _grads(heads) -> dict[str, float]:
    """Summed |grad| of the serial part (fc, decoder layers) and of the parallel part (MLP heads)."""
    out = {"serial": 0.0, "parallel": 0.0}
    for name, p in heads.named_parameters():
        if p.requires_grad and p.grad is not None:
            out["parallel" if name.startswith("mlps.") else "serial"] += p.grad.abs().sum().item()
    return out


def test_shapes_frozen_pieces_and_both_parts_get_gradients(tiny_target):
    model, tok = tiny_target
    heads = _heads(model)
    d = model.config.hidden_size
    trainable = [n for n, p in heads.named_parameters() if p.requires_grad]
    assert all(n.startswith(("fc.", "layers.", "mlps.")) for n in trainable)
    assert any(n.startswith("mlps.") for n in trainable) and any(n.startswith("layers.") for n in trainable)
    assert not any("embed" in n or "lm_head" in n for n in heads.state_dict())
    assert len(heads.layers) == 1 and len(heads.mlps) == 3 and heads.mlps[0][0].in_features == 2 * d

    ids = _ids(tok, "Speculative decoding drafts tokens and the target verifies them.")[None].repeat(2, 1)
    batch, feats = _batch(ids), _features(model, ids)
    loss, metrics = heads.loss(batch, feats)
    assert {"loss_reg", "loss_cls", "acc", "acc_mlp0", "acc_mlp2", "loss_reg_mlp1"} <= set(metrics)
    loss.backward()
    grads = _grads(heads)
    assert grads["serial"] > 0 and grads["parallel"] > 0
    for mlp in heads.mlps:                        # every head's input projection is trained
        assert mlp[0].weight.grad.abs().sum() > 0

    # The parallel heads' terms alone reach the serial part (joint training), once a step has made the
    # zero-initialised MLP projections non-zero.
    torch.optim.SGD([p for p in heads.parameters() if p.requires_grad], lr=0.1).step()     # the grads above
    heads.zero_grad()
    sum(scale * (t.reg + t.cls) for scale, t in heads.position_terms(batch, feats)[1:]).backward()
    grads = _grads(heads)
    assert grads["serial"] > 0 and grads["parallel"] > 0
    with pytest.raises(ValueError, match="serial_tokens=0"):
        _heads(model, serial_tokens=0)
