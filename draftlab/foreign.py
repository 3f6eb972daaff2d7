"""Drafters trained elsewhere, rebuilt as draftlab drafters so `draftlab eval` scores them like its own.

    draftlab eval --checkpoint FOLDER_OR_HUB_ID --prompts FILE --out REPORT.json [--target PATH]

A folder (or Hub model id) holding a config.json but no draftlab checkpoint is recognised from that config:

| format | recognised by | rebuilt as |
|---|---|---|
| speculators EAGLE-3 (vllm-project/speculators) | `speculators_model_type: eagle3` | `EagleHead3` + its norms |
| official EAGLE-3 (SafeAILab/EAGLE, cnets.py) | `draft_vocab_size` or `midlayer.*` | `EagleHead3`, aux [2, L//2, L-3] |
| official EAGLE-1/2 (SafeAILab/EAGLE, cnets1.py) | `fc.weight` of shape [d, 2d] and `layers.*` | `EagleHead` |
| Medusa heads (FasterDecoding/Medusa, TGI) | `medusa_num_heads` | `MedusaHeads` |
| DFlash (z-lab/dflash `DFlashDraftModel`, SGLang, vLLM) | `dflash_config` | `DFlashDrafter` |

Weight names are mapped onto ours and checked strictly (every expected tensor present, nothing left over), the
embedding a checkpoint carries must be the target's (drafters borrow the target's), and the target defaults to the
one the folder names (speculators' verifier, Medusa's base_model_name_or_path). Every problem is one line naming the
folder and the fix. The layouts were read from the projects' sources (named above); no code is taken from them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftlab.checkpoint import CONFIG_NAME, CheckpointError, trainable_state_dict
from draftlab.trees import static_tree_layout

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class ForeignDrafter:
    """A drafter folder in another project's format: `kind` (the format), `target` (the target it names, or None),
    `load(target)` -> a draftlab drafter ready for `.proposer(target)`."""

    def __init__(self, folder: Path, label: str):
        self.folder, self.label = folder, label
        self.config = read_json(folder / "config.json")
        self.kind = detect_format(self.config, weight_shapes(folder), folder)

    @property
    def target(self) -> str | None:
        if self.kind == "speculators":
            return ((self.config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if self.kind == "medusa":
            return self.config.get("base_model_name_or_path")
        return None

    def load(self, target) -> torch.nn.Module:
        build = {"speculators": build_speculators, "eagle3": build_official_eagle3, "eagle": build_eagle,
                 "medusa": build_medusa, "dflash": build_dflash}[self.kind]
        drafter = build(self, target)
        return drafter.to(next(target.parameters()).device).eval()

    def weights(self) -> dict[str, torch.Tensor]:
        for name in (MEDUSA_FILES if self.kind == "medusa" else WEIGHT_FILES):
            path = self.folder / name
            if path.is_file():
                try:
                    if name.endswith(".safetensors"):
                        return load_file(str(path))
                    return torch.load(path, map_location="cpu", weights_only=True)
                except Exception as e:
                    raise CheckpointError(f"{path} is corrupt ({type(e).__name__}): download it again") from None
        wanted = " or ".join(MEDUSA_FILES if self.kind == "medusa" else WEIGHT_FILES)
        raise CheckpointError(f"{self.folder} has no weights: expected {wanted} beside config.json")


def find_foreign(path: str) -> ForeignDrafter | None:
    """The foreign drafter at `path` (a local folder or a Hub model id), or None when `path` is a draftlab
    checkpoint (drafter_config.json, a run folder with `best` or step folders, or an export) or does not exist."""
    local = Path(path).expanduser()
    if local.is_dir():
        native = (local / CONFIG_NAME).is_file() or (local / "best").is_file() or any(local.glob("step_*"))
        return None if native or not (local / "config.json").is_file() else ForeignDrafter(local, str(path))
    from draftlab.hub import looks_like_hub_id

    if not looks_like_hub_id(str(path)):
        return None
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.bin", "*.pt"]))
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} does not exist locally, and as a Hub id it could not be downloaded "
                              f"({type(e).__name__}): check the path or the id, the network, or HF_TOKEN") from None
    if (folder / "best").is_file():          # a draftlab export on the Hub
        return None
    return ForeignDrafter(folder, str(path))


# ----------------------------------------------------------------------------------------------------------
# recognising the format


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read as JSON ({type(e).__name__}): download it again") from None


def weight_shapes(folder: Path) -> dict[str, list[int]]:
    """Name -> shape of the folder's model weights (a safetensors header, or a memory-mapped pytorch_model.bin)."""
    from safetensors import safe_open

    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            try:
                if name.endswith(".safetensors"):
                    with safe_open(str(path), "pt") as f:
                        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                return {k: list(v.shape) for k, v in loaded.items()}
            except Exception as e:
                raise CheckpointError(f"{path} is corrupt ({type(e).__name__}): download it again") from None
    return {}


def detect_format(config: dict, shapes: dict[str, list[int]], folder: Path) -> str:
    """speculators | eagle3 | eagle | medusa | dflash, from config.json (and the weight names when the config is a
    plain Llama config, as the official EAGLE heads' are)."""
    kind = config.get("speculators_model_type")
    if kind:
        if kind != "eagle3":
            raise CheckpointError(f"{folder} is a speculators '{kind}' checkpoint: draftlab imports speculators "
                                  "EAGLE-3 heads only (speculators_model_type eagle3)")
        return "speculators"
    if "medusa_num_heads" in config:
        return "medusa"
    if "dflash_config" in config or "DFlashDraftModel" in (config.get("architectures") or []):
        return "dflash"
    if "draft_vocab_size" in config or any(n.startswith("midlayer.") for n in shapes):
        return "eagle3"
    fc = shapes.get("fc.weight", [0, 0])
    if fc[1] == 2 * fc[0] > 0 and any(n.startswith("layers.") for n in shapes):   # FC over [embedding; feature]
        return "eagle"
    raise CheckpointError(f"{folder} is not a drafter draftlab can read: no {CONFIG_NAME} (draftlab), and its "
                          "config.json is neither speculators EAGLE-3, official EAGLE-1/2/3 nor Medusa heads, "
                          "nor DFlash")


# ----------------------------------------------------------------------------------------------------------
# rebuilding


def load_strict(drafter: torch.nn.Module, weights: dict[str, torch.Tensor], where: Path) -> torch.nn.Module:
    """Load mapped weights, cast to the drafter's dtype; the names must be exactly the drafter's trainable ones."""
    expected = trainable_state_dict(drafter)
    missing, unexpected = set(expected) - set(weights), set(weights) - set(expected)
    if missing or unexpected:
        raise CheckpointError(f"{where} does not match a '{drafter.kind}' drafter built from its config: missing "
                              f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(value.shape)}, expected "
                                  f"{list(expected[name].shape)} for this target: pass the target it was trained for")
    drafter.load_state_dict({k: v.to(expected[k].dtype) for k, v in weights.items()}, strict=False)
    return drafter


def check_embedding(weights: dict[str, torch.Tensor], target, where: Path) -> None:
    """Drafters borrow the target's token embedding: a stored copy must equal it (up to bf16 rounding)."""
    stored = weights.pop("embed_tokens.weight", None)
    if stored is None:
        return
    own = target.get_input_embeddings().weight.detach().float().cpu()
    if stored.shape != own.shape or not torch.allclose(stored.float(), own, rtol=1e-2, atol=1e-3):
        raise CheckpointError(f"{where}: its embed_tokens.weight is not the target's embedding (trained, or another "
                              "target): pass the --target it was trained for")


def check_target(where: Path, target, hidden_size: int | None, vocab_size: int | None) -> None:
    text = target.config.get_text_config()
    for key, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if value is not None and value != getattr(text, key):
            raise CheckpointError(f"{where} was trained for a target with {key}={value}, but this target has "
                                  f"{key}={getattr(text, key)}: pass the matching --target")


def draft_vocab(weights: dict[str, torch.Tensor], draft_size: int, vocab_size: int, where: Path):
    """(sorted target ids of the draft vocabulary, row order that sorts lm_head) from d2t/t2d; (None, None) for the
    full vocabulary."""
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    if draft_size >= vocab_size:
        return None, None
    if d2t is None:
        raise CheckpointError(f"{where}: draft_vocab_size {draft_size} < vocab_size {vocab_size} but no d2t tensor "
                              "maps the draft vocabulary: the checkpoint is incomplete")
    ids = torch.arange(len(d2t)) + d2t.long()
    if t2d is not None and set(ids.tolist()) != set(t2d.nonzero().flatten().tolist()):
        raise CheckpointError(f"{where}: its d2t and t2d tensors disagree on the draft vocabulary")
    if len(set(ids.tolist())) != len(ids):
        raise CheckpointError(f"{where}: its d2t maps two draft ids to one target token")
    order = torch.argsort(ids)
    return ids[order].tolist(), order


def eagle3_weights(weights: dict[str, torch.Tensor], prefix: str, order) -> dict[str, torch.Tensor]:
    """speculators / official EAGLE-3 names -> EagleHead3's: the first layer's input_layernorm normalises the
    embedding (our emb_norm) and hidden_norm the fused state (our layer.input_layernorm)."""
    out = {}
    for name, value in weights.items():
        if name.startswith("verifier_"):
            continue
        if name.startswith(prefix):
            rest = name[len(prefix):]
            name = {"input_layernorm.weight": "emb_norm.weight",
                    "hidden_norm.weight": "layer.input_layernorm.weight"}.get(rest, "layer." + rest)
        out[name] = value
    if order is not None and "lm_head.weight" in out:
        out["lm_head.weight"] = out["lm_head.weight"][order]
    return out


def build_speculators(src: ForeignDrafter, target) -> torch.nn.Module:
    from draftlab.drafters.eagle3 import EagleHead3

    config, where = src.config, src.folder
    layer = config.get("transformer_layer_config") or {}
    if layer.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{where} has {layer['num_hidden_layers']} draft layers: draftlab's EAGLE-3 head has "
                              "one (speculators' default)")
    if config.get("fc_norm"):
        raise CheckpointError(f"{where} uses fc_norm (one norm per aux layer), which draftlab's EAGLE-3 head lacks")
    if config.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise CheckpointError(f"{where}: a draft hidden size different from the target's is not supported")
    check_target(where, target, layer.get("hidden_size"), layer.get("vocab_size"))
    num_layers = target.config.get_text_config().num_hidden_layers
    aux = config.get("eagle_aux_hidden_state_layer_ids") or [2, num_layers // 2, num_layers - 3]
    if max(aux) >= num_layers:
        raise CheckpointError(f"{where} reads aux layer {max(aux)}, the output of the target's last decoder layer "
                              f"before its final norm, which draftlab's features lack (use ids < {num_layers})")
    weights = src.weights()
    check_embedding(weights, target, where)
    ids, order = draft_vocab(weights, config.get("draft_vocab_size", 0), layer.get("vocab_size", 0), where)
    head = EagleHead3(target, aux_layers=list(aux), draft_vocab_size=len(ids) if ids else 0, draft_vocab=ids,
                      **{k: bool(config.get(k, False)) for k in ("norm_before_fc", "norm_before_residual",
                                                                 "norm_output")})
    return load_strict(head, eagle3_weights(weights, "layers.0.", order), where)


def build_official_eagle3(src: ForeignDrafter, target) -> torch.nn.Module:
    """EAGLE-3 as SafeAILab/EAGLE saves it (eagle/model/cnets.py `Model`): midlayer.*, fc, norm, lm_head, d2t,
    t2d; the target's states entering layers 2, L//2 and L-3, in layer order (modeling_llama_kv.py)."""
    from draftlab.drafters.eagle3 import EagleHead3

    config, where = src.config, src.folder
    if config.get("target_hidden_size") not in (None, config.get("hidden_size")):
        raise CheckpointError(f"{where}: a draft hidden size different from the target's is not supported")
    check_target(where, target, config.get("hidden_size"), config.get("vocab_size"))
    num_layers = target.config.get_text_config().num_hidden_layers
    aux = ((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")      # newer EAGLE-3 configs
           or [i for i in range(num_layers) if i in (2, num_layers // 2, num_layers - 3)])
    if max(aux) >= num_layers:
        raise CheckpointError(f"{where} reads aux layer {max(aux)}, past the {num_layers} layers draftlab's features "
                              f"cover (use ids < {num_layers})")
    if len(aux) < 2:
        raise CheckpointError(f"{where}: a {num_layers}-layer target gives EAGLE-3 fewer than two aux layers")
    weights = src.weights()
    check_embedding(weights, target, where)
    vocab = config.get("vocab_size") or target.config.get_text_config().vocab_size
    ids, order = draft_vocab(weights, config.get("draft_vocab_size", vocab), vocab, where)
    head = EagleHead3(target, aux_layers=list(aux), draft_vocab_size=len(ids) if ids else 0, draft_vocab=ids)
    return load_strict(head, eagle3_weights(weights, "midlayer.", order), where)


def build_eagle(src: ForeignDrafter, target) -> torch.nn.Module:
    """EAGLE-1/2 as SafeAILab/EAGLE saves it (cnets1.py `Model`): fc (bias per config `bias`), layers.{i}.* with no
    input_layernorm in layer 0, over the target's post-norm last state: our own names."""
    from draftlab.drafters.eagle import EagleHead

    config, where = src.config, src.folder
    check_target(where, target, config.get("hidden_size"), config.get("vocab_size"))
    weights = src.weights()
    check_embedding(weights, target, where)
    head = EagleHead(target, num_layers=int(config.get("num_hidden_layers", 1)), fc_bias="fc.bias" in weights)
    return load_strict(head, weights, where)


def build_medusa(src: ForeignDrafter, target) -> torch.nn.Module:
    """Medusa-1 heads (medusa_lm_head.safetensors / .pt: {k}.{j}.linear.* per ResBlock, {k}.{L}.weight the
    vocabulary projection). Heads saved without that projection (the legacy layout) use the target's LM head, as
    Medusa's legacy loader does. The static tree comes from medusa_choices.json when the folder has one."""
    from draftlab.drafters.medusa import MedusaHeads

    config, where = src.config, src.folder
    weights = src.weights()
    layers = int(config.get("medusa_num_layers", 1))
    heads = 1 + max((int(n.split(".")[0]) for n in weights if n.split(".")[0].isdigit()), default=-1)
    if heads < 1:
        raise CheckpointError(f"{where}: its Medusa weights name no head ({sorted(weights)[:3]})")
    choices_file = where / "medusa_choices.json"
    choices = read_json(choices_file) if choices_file.is_file() else None
    if choices:
        try:
            static_tree_layout(choices)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{choices_file}: {e}; fix the list or remove the file (the prior tree is used "
                                  "then)") from None
    drafter = MedusaHeads(target, medusa_heads=heads, medusa_layers=layers, tree_choices=choices or None)
    lm_head = target.get_output_embeddings().weight.detach()
    mapped = {f"heads.{n}": v for n, v in weights.items()}
    for k in range(heads):
        mapped.setdefault(f"heads.{k}.{layers}.weight", lm_head)
    return load_strict(drafter, mapped, where)


def build_dflash(src: ForeignDrafter, target) -> torch.nn.Module:
    """DFlash as z-lab/dflash releases it (`DFlashDraftModel`, Qwen3 layers): config.json's dflash_config
    {block_size, mask_token_id, target_layer_ids} (block_size also at the top level), weights fc, hidden_norm,
    layers.{i}.* with q/k norms, norm; the embedding and LM head are the target's. DFlash-2 drafters (convolutions,
    a candidate selector), sliding-window layers and drafters with their own LM head or mask embedding are refused."""
    from draftlab.drafters.dflash import SHAPE_KEYS, DFlashDrafter

    config, where = src.config, src.folder
    own = config.get("dflash_config") or {}
    if "DFlash2DraftModel" in (config.get("architectures") or []) or "conv_kernel_size" in own:
        raise CheckpointError(f"{where} is a DFlash-2 drafter (convolutions and a candidate selector): draftlab "
                              "imports DFlash (DFlashDraftModel) drafters only")
    if config.get("use_sliding_window") or own.get("use_swa"):
        raise CheckpointError(f"{where} uses sliding-window attention, which draftlab's DFlash drafter lacks")
    if (where / "mask_embedding.pt").is_file():
        raise CheckpointError(f"{where} carries its own mask embedding (mask_embedding.pt), which draftlab's DFlash "
                              "drafter does not have: it uses the target's embedding of the mask token")
    check_target(where, target, config.get("hidden_size"), config.get("vocab_size"))
    text = target.config.get_text_config()
    layer_ids = own.get("target_layer_ids", config.get("target_layer_ids"))
    mask_id = own.get("mask_token_id", config.get("mask_token_id"))
    if not layer_ids or mask_id is None:
        raise CheckpointError(f"{where}: its dflash_config lacks target_layer_ids or mask_token_id")
    weights = src.weights()
    check_embedding(weights, target, where)
    head = weights.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head.float(), target.get_output_embeddings().weight.detach().float().cpu()):
        raise CheckpointError(f"{where} has its own lm_head.weight, not the target's: draftlab's DFlash drafter drafts "
                              "with the target's LM head")
    shape = {k: config[k] for k in SHAPE_KEYS if k in config and config[k] != getattr(text, k, None)}
    try:
        drafter = DFlashDrafter(target, num_layers=int(config.get("num_hidden_layers", 1)),
                                block_size=int(own.get("block_size", config.get("block_size", 16))),
                                target_layers=list(layer_ids), mask_token_id=int(mask_id), layer_shape=shape)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return load_strict(drafter, weights, where)
