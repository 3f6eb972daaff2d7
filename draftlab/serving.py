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


# ----------------------------------------------------------------------------------------------------------
# dense draft layers: what every feature-level kind (EAGLE, EAGLE-3, Gumiho, DFlash) stacks, whatever the target


# Rope scalings that every loader of EAGLE-style draft layers builds (the official EAGLE code reads only linear and
# dynamic ones). A draft layer of a target with another one (llama3: Llama 3.1-3.3, YaRN: gpt-oss, longrope: Phi-3
# long) uses plain rope at the target's theta: the draft layer's rope need only be the same in training and serving.
SERVED_ROPE = ("default", "linear", "dynamic")


def full_attention_rope(text) -> dict:
    """The target's rope parameters of its full-attention layers, as one flat dict a Llama layer takes: a per
    layer-type dict (Gemma 3: local and global theta) gives its `full_attention` entry; a partial rotary factor (the
    target's own head layout) is dropped, since the draft layer rotates its whole head; a scaling outside
    SERVED_ROPE becomes plain rope at the target's theta."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    rope.pop("partial_rotary_factor", None)
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None) or 10000.0)
    if rope.get("rope_type", "default") not in SERVED_ROPE:
        return {"rope_type": "default", "rope_theta": theta}
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = theta
    return rope


def dense_width(text) -> int:
    """The draft layer's MLP width: the target's `intermediate_size` (its dense MLP; in MoE configs the width that
    key holds: Qwen3-MoE's dense layers, one Mixtral / gpt-oss expert), else its expert width, else 4 x hidden."""
    for key in ("intermediate_size", "moe_intermediate_size"):
        width = getattr(text, key, None)
        if isinstance(width, int) and width > 0:
            return width
    return 4 * text.hidden_size


def dense_config(text, num_layers: int):
    """A `LlamaConfig` for a `num_layers` draft stack sized from the target's text config `text`: hidden size,
    attention and KV heads, MLP width (`dense_width`), norm epsilon, the full-attention rope, vocabulary and special
    ids. The head size is hidden / heads, the one every loader derives (the official EAGLE code has no head_dim key;
    Qwen3-0.6B's own heads are 128 wide at 1,024 / 16, MLA's head_dim is only its rope part). Whatever the target's own layer is (Gemma's (1+w) norms and soft-capped attention, Phi-3's fused
    projections, OLMo 2's post-norms, MoE blocks, sliding windows), the draft layer is the dense pre-norm Llama layer
    with SiLU that vLLM, SGLang and llama.cpp build for EAGLE heads; tree masks need sdpa or eager attention."""
    from transformers import LlamaConfig

    heads = text.num_attention_heads
    eps = next((v for v in (getattr(text, k, None) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon",
                                                               "norm_eps", "norm_epsilon"))
                if isinstance(v, float)), 1e-6)
    config = LlamaConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=dense_width(text),
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=text.hidden_size // heads, hidden_act="silu",
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 4096,
        initializer_range=getattr(text, "initializer_range", None) or 0.02, rms_norm_eps=eps,
        rope_parameters=full_attention_rope(text), attention_bias=False, mlp_bias=False,
        bos_token_id=getattr(text, "bos_token_id", None), eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


# Where transformers' decoders keep their layers and final norm (Llama-style `model.layers` / `model.norm`; GPT-2,
# Falcon, Bloom `transformer.h` / `ln_f`; GPT-NeoX `final_layer_norm`; Phi `final_layernorm`; Mamba-style `norm_f`).
LAYER_LISTS = ("layers", "h", "blocks")
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")


def text_decoder(model) -> torch.nn.Module:
    """The module mapping input ids to the last hidden states (`last_hidden_state`): `model.get_decoder()`, or, where
    that is the causal LM itself (Llama 4's text model), its child model."""
    from transformers import PreTrainedModel

    decoder = model.get_decoder()
    if decoder is model:
        decoder = next((c for c in model.children() if isinstance(c, PreTrainedModel)), model)
    return decoder


def decoder_layers(model) -> tuple[torch.nn.Module, str]:
    """(the decoder, the attribute name of its list of decoder layers): one of LAYER_LISTS, else its only child
    ModuleList of `num_hidden_layers` modules."""
    decoder = text_decoder(model)
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    named = [(name, getattr(decoder, name, None)) for name in LAYER_LISTS]
    named += list(decoder.named_children())
    for name, module in named:
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return decoder, name
    raise ValueError(f"{type(model).__name__}: no list of its {count} decoder layers found in {type(decoder).__name__}")


def final_norm(model) -> torch.nn.Module:
    """The decoder's final norm (one of FINAL_NORMS), or an Identity for a decoder without one."""
    decoder = text_decoder(model)
    return next((m for m in (getattr(decoder, n, None) for n in FINAL_NORMS) if isinstance(m, torch.nn.Module)),
                torch.nn.Identity())


def copy_matching(mine: torch.nn.Module, theirs: torch.nn.Module, widen: int = 0) -> tuple[list[str], list[str]]:
    """Start the draft layer `mine` from the target layer `theirs` where the two compute the same thing: each of
    mine's leaf modules (projections, norms) takes the same-named module's weights when every shape matches; a
    module other than a Linear (a norm) keeps them only if it then gives theirs' output on a random probe (Gemma's
    (1+w) RMSNorm does not). widen > 0: a Linear of mine whose input is `widen` wider than theirs (EAGLE-3's q/k/v
    read [emb; hidden]) takes theirs in its last columns, zeros before. Returns (copied, not copied) module names."""
    copied, skipped = [], []
    theirs_modules = dict(theirs.named_modules())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in mine.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            source = theirs_modules.get(name)
            given = dict(source.named_parameters(recurse=False)) if source is not None else {}
            if set(given) != set(own):
                skipped.append(name)
                continue
            if isinstance(module, torch.nn.Linear) and widen and all(
                    own[k].shape[:-1] == given[k].shape[:-1] and own[k].shape[-1] == given[k].shape[-1] + widen
                    for k in own if k == "weight") and all(own[k].shape == given[k].shape for k in own if k != "weight"):
                own["weight"].zero_()
                own["weight"][..., widen:] = given["weight"]
                for k in own:
                    if k != "weight":
                        own[k].copy_(given[k])
                copied.append(name)
                continue
            if any(own[k].shape != given[k].shape for k in own):
                skipped.append(name)
                continue
            before = {k: v.clone() for k, v in own.items()}
            for k in own:
                own[k].copy_(given[k])
            if not isinstance(module, torch.nn.Linear):
                width = next(iter(own.values())).shape[-1]
                probe = torch.randn(3, width, generator=generator).to(next(iter(own.values())))
                try:
                    same = torch.allclose(module(probe), source(probe), rtol=1e-4, atol=1e-5)
                except Exception:     # a module that needs more than one tensor: no way to tell, keep it fresh
                    same = False
                if not same:
                    for k in own:
                        own[k].copy_(before[k])
                    skipped.append(name)
                    continue
            copied.append(name)
    return copied, [n for n in skipped] + sorted(
        n for n, m in theirs_modules.items() if n and dict(m.named_parameters(recurse=False))
        and n not in dict(mine.named_modules()))


def embed_tokens(embedding: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The target's token embedding rows for ids, unscaled: what an engine's draft layer reads from the shared
    embedding table (a target that scales its embeddings, as Gemma does by sqrt(hidden), does so in its own model
    forward or embedding module, which a served draft model does not run)."""
    return torch.nn.functional.embedding(ids, embedding.weight)


def report_init(kind: str, skipped) -> None:
    """One line naming what `init_from_target` could not take from the target's layers (nothing for Llama-style
    targets, whose layers are the draft layer's own)."""
    if skipped:
        print(f"{kind}: init_from_target: started fresh where the target's layer is not a dense Llama layer's: "
              f"{', '.join(sorted(skipped))}", flush=True)


def layer_config(text, num_layers: int) -> dict:
    """The config keys of a `num_layers` dense draft stack (`dense_config`) as exports write them: the keys of the
    speculators template, today's rope_parameters and the legacy rope keys that older transformers and the
    official EAGLE code read."""
    dense = dense_config(text, num_layers)
    full = dense.to_dict()
    config = {key: full[key] for key in LAYER_CONFIG_KEYS if key in full}
    config.update(num_hidden_layers=num_layers, tie_word_embeddings=False, **legacy_rope(dense))
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


def lora_targets(model: torch.nn.Module) -> list[str]:
    """The modules LoRA adapts: every plain projection (`nn.Linear` and its subclasses that project, GPT-2's
    `Conv1D`) but the LM head. A Linear whose forward returns something else (a MoE router's tuple, as Phi-MoE's)
    and MoE expert tensors are left alone, where peft's "all-linear" wraps them too."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head and _projects(module)]


def _projects(module: torch.nn.Module) -> bool:
    """Whether a Linear (subclass) is a plain projection: one tensor of its output width back (Falcon's FalconLinear
    is; a MoE router returning (weights, experts) is not)."""
    width = module.weight.shape[1] if isinstance(module, torch.nn.Linear) else module.weight.shape[0]
    try:
        with torch.no_grad():
            out = module(torch.zeros(1, width, dtype=module.weight.dtype, device=module.weight.device))
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and out.shape[-1] == (module.out_features if isinstance(module, torch.nn.Linear)
                                                                else module.nf)


def unwrap_lora(model: torch.nn.Module) -> None:
    """Replace every (already merged) peft LoRA layer by its base layer, leaving a plain transformers model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    done: list[str] = []
    for name, module in list(model.named_modules()):
        # a wrapper inside one already replaced (peft nests a ParamWrapper per MoE expert tensor) went with it
        if isinstance(module, BaseTunerLayer) and not any(name.startswith(outer + ".") for outer in done):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
            done.append(name)
