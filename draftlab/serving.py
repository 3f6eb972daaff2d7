"""What the drafter kinds' exporters share: the config keys serving engines and other tools read.

Each kind writes its own serving format in its `export(src, out, meta)` (drafters/*.py); `hub.py` calls it
with `src`, the checkpoint being exported (`hub.Source`: its drafter config, weights, target and names).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch


def legacy_rope(text) -> dict:
    """rope_theta / rope_scaling as pre-5.0 configs (and the official EAGLE code: {type, factor}) spell them."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    kind = rope.pop("rope_type", "default")
    theta = rope.pop("rope_theta", getattr(text, "rope_theta", 10000.0))
    return {"rope_theta": theta, "rope_scaling": None if kind == "default" else {"type": kind, **rope}}


LAYER_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
                     "rms_norm_eps", "attention_bias", "attention_dropout", "mlp_bias", "pretraining_tp", "use_cache",
                     "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")


def layer_config(text, num_layers: int) -> dict:
    """The target's text config for a `num_layers` draft stack: the keys of the speculators template, today's
    rope_parameters and the legacy rope keys that older transformers and the official EAGLE code read."""
    full = text.to_dict()
    config = {key: full[key] for key in LAYER_CONFIG_KEYS if key in full}
    config.update(num_hidden_layers=num_layers, tie_word_embeddings=False, **legacy_rope(text))
    if full.get("layer_types"):
        config["layer_types"] = full["layer_types"][:num_layers]
    return config


def add_legacy_keys(folder: Path) -> None:
    """Give a transformers 5.x config.json the keys transformers 4.x reads instead of `rope_parameters` and `dtype`
    (4.x would otherwise fall back to rope_theta 10,000 and float32): rope_theta, rope_scaling, torch_dtype."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    text = config.get("text_config") or config
    extra = legacy_rope(SimpleNamespace(**text))
    if config.get("dtype") and "torch_dtype" not in config:
        extra["torch_dtype"] = config["dtype"]
    path.write_text(json.dumps({**config, **{k: v for k, v in extra.items() if k not in config}}, indent=2) + "\n")


def unwrap_lora(model: torch.nn.Module) -> None:
    """Replace every (already merged) peft LoRA layer by its base layer, leaving a plain transformers model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
