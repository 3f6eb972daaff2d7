"""Checkpoint folders: drafter weights (safetensors) + config, trainer state, and run-folder resolution.

A step folder `out_dir/step_N/` holds `drafter_config.json`, `model.safetensors` (trainable weights only:
frozen pieces shared with the target are rebuilt from it), `eval.json` when evaluated, and
`trainer_state.pt` for resuming. Folders are written to a temporary sibling and renamed into place, so a
crash while saving leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "model.safetensors"
STATE_NAME = "trainer_state.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which file and why."""


def trainable_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Everything in the drafter's state dict except frozen parameters (which come back from the target):
    trainable parameters and persistent buffers (e.g. a draft-vocabulary map), detached and contiguous."""
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items() if k not in frozen}


def save_drafter(drafter: torch.nn.Module, folder: str | Path, extra_files: dict[str, str] | None = None,
                 trainer_state: dict | None = None) -> Path:
    """Write drafter config + trainable weights (+ text files, + trainer state) into `folder` atomically."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(trainable_state_dict(drafter), str(tmp / WEIGHTS_NAME))
    (tmp / CONFIG_NAME).write_text(json.dumps(drafter.drafter_config(), indent=2))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if trainer_state is not None:
        torch.save(trainer_state, tmp / STATE_NAME)
    _replace(tmp, folder)
    return folder


def _replace(tmp: Path, folder: Path) -> None:
    """Move tmp into folder's place; the old folder is removed only after the new one is complete."""
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)


def read_drafter_config(folder: str | Path) -> dict:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a drafter checkpoint: {CONFIG_NAME} is missing "
                              "(pass a run folder or one of its step_N folders)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupt ({e.msg} at line {e.lineno}): re-save or pick another step") from None


def load_drafter(folder: str | Path, target) -> torch.nn.Module:
    """Rebuild a drafter from its config and the target, then load its trainable weights (strict)."""
    from draftlab.drafters import DRAFTERS
    from draftlab.target import target_fingerprint

    folder = resolve_checkpoint(folder)
    config = read_drafter_config(folder)
    kind = config.get("kind")
    if kind not in DRAFTERS:
        raise CheckpointError(f"{folder / CONFIG_NAME} names drafter kind '{kind}': known kinds are {', '.join(DRAFTERS)}")
    saved = config.get("target") or {}
    current = target_fingerprint(target, None)
    for key in ("vocab_size", "hidden_size"):
        if key in saved and saved[key] != current.get(key):
            raise CheckpointError(f"checkpoint {folder} was trained for a target with {key}={saved[key]}, "
                                  f"but this target has {key}={current.get(key)}: pass the matching --target")
    drafter = DRAFTERS[kind].from_config(config, target)
    try:
        weights = load_file(str(folder / WEIGHTS_NAME))
    except FileNotFoundError:
        raise CheckpointError(f"{folder / WEIGHTS_NAME} is missing: the checkpoint is incomplete") from None
    except Exception as e:
        raise CheckpointError(f"{folder / WEIGHTS_NAME} is corrupt ({type(e).__name__}): pick another step") from None
    expected = set(trainable_state_dict(drafter))
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise CheckpointError(f"{folder / WEIGHTS_NAME} does not match a '{kind}' drafter: "
                              f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    drafter.load_state_dict(weights, strict=False)
    return drafter.to(next(target.parameters()).device)


STEP_RE = re.compile(r"^step_(\d+)$")


def step_folders(out_dir: str | Path) -> list[Path]:
    """Complete step folders of a run, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    steps = [p for p in out_dir.iterdir() if p.is_dir() and STEP_RE.match(p.name) and (p / CONFIG_NAME).is_file()]
    return sorted(steps, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder means its best step (or its latest when none was evaluated); a step folder means itself."""
    path = Path(path)
    if (path / CONFIG_NAME).is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    best = path / "best"
    if best.is_file():
        step = path / best.read_text().strip()
        if (step / CONFIG_NAME).is_file():
            return step
    steps = step_folders(path)
    if not steps:
        raise CheckpointError(f"{path} holds no checkpoint: expected {CONFIG_NAME} or step_N folders")
    return steps[-1]


def save_trainer_state(folder: str | Path, state: dict) -> None:
    torch.save(state, Path(folder) / STATE_NAME)


def load_trainer_state(folder: str | Path) -> dict:
    path = Path(folder) / STATE_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: this step cannot be resumed (it was saved without trainer state)")
    return torch.load(path, map_location="cpu", weights_only=False)
