"""What the drafter kinds' exporters share: the config keys serving engines and other tools read.

Each kind writes its own serving format in its `export(src, out, meta)` (drafters/*.py); `hub.py` calls it
with `src`, the checkpoint being exported (`hub.Source`: its drafter config, weights, target and names).
"""
from __future__ import annotations

import json
import os
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


# transformers 4.x's generic fast tokenizer (tokenizer.json as is); 5.x reads the name as its TokenizersBackend
LEGACY_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def add_legacy_keys(folder: Path) -> None:
    """Make a folder saved by transformers 5.x read the same under 4.x. config.json gets the keys 4.x reads instead
    of `rope_parameters` and `dtype` (4.x would otherwise fall back to rope_theta 10,000 and float32): rope_theta,
    rope_scaling, torch_dtype. tokenizer_config.json's `tokenizer_class` "TokenizersBackend" (a 5.x name that 4.x's
    AutoTokenizer refuses) becomes PreTrainedTokenizerFast, which both read from the same tokenizer.json."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    text = config.get("text_config") or config
    extra = legacy_rope(SimpleNamespace(**text))
    if config.get("dtype") and "torch_dtype" not in config:
        extra["torch_dtype"] = config["dtype"]
    write_json(path, {**config, **{k: v for k, v in extra.items() if k not in config}})
    tok_path = folder / "tokenizer_config.json"
    if tok_path.is_file():
        tok = json.loads(tok_path.read_text())
        if tok.get("tokenizer_class") in (None, "TokenizersBackend") and (folder / "tokenizer.json").is_file():
            write_json(tok_path, {**tok, "tokenizer_class": LEGACY_TOKENIZER_CLASS})


def add_weight_index(folder: Path) -> None:
    """Write model.safetensors.index.json for a one-file model.safetensors: tools that find a model's tensors
    through the index only (the official EAGLE code reads the target's embedding that way) then read the folder
    too; transformers still loads the single file."""
    weights = folder / "model.safetensors"
    with weights.open("rb") as f:                      # safetensors: u64 header length, JSON header, tensor data
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    names = sorted(k for k in header if k != "__metadata__")
    write_json(folder / "model.safetensors.index.json",
               {"metadata": {"total_size": weights.stat().st_size - 8 - size},
                "weight_map": dict.fromkeys(names, weights.name)})


def write_json(path: Path, data: dict) -> None:
    """Write JSON through a temporary file and a rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def unwrap_lora(model: torch.nn.Module) -> None:
    """Replace every (already merged) peft LoRA layer by its base layer, leaving a plain transformers model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
