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


def staging_folder(folder: str | Path) -> Path:
    """Where `folder` is written before it is renamed into place: a sibling `NAME.tmp`."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".tmp")


def begin_save(folder: str | Path) -> Path:
    """Create an empty staging folder for `folder` (a leftover from an interrupted save is discarded first).
    Several processes may write into it (e.g. DeepSpeed's sharded optimizer) before `save_drafter(staged=True)`."""
    tmp = staging_folder(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def save_drafter(drafter: torch.nn.Module, folder: str | Path, extra_files: dict[str, str] | None = None,
                 trainer_state: dict | None = None, state_dict: dict[str, torch.Tensor] | None = None,
                 staged: bool = False) -> Path:
    """Write drafter config + trainable weights (+ text files, + trainer state) into `folder` atomically.

    Everything goes to `folder.tmp` first, is flushed to disk, and only then replaces `folder`: a crash at
    any point leaves either the previous complete folder or the new complete one, never a torn one.
    `state_dict` overrides `trainable_state_dict(drafter)` (e.g. weights gathered from ZeRO-3 shards);
    `staged=True` means `begin_save(folder)` was called already and the staging folder may hold other files."""
    folder = Path(folder)
    tmp = staging_folder(folder) if staged else begin_save(folder)
    if not tmp.is_dir():
        raise CheckpointError(f"{tmp} is missing: call begin_save({folder}) before save_drafter(staged=True)")
    save_file(trainable_state_dict(drafter) if state_dict is None else state_dict, str(tmp / WEIGHTS_NAME))
    (tmp / CONFIG_NAME).write_text(json.dumps(drafter.drafter_config(), indent=2))
    for name, tensors in (drafter.checkpoint_tensors() if hasattr(drafter, "checkpoint_tensors") else {}).items():
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp / name))  # e.g. EAGLE-3's d2t/t2d
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if trainer_state is not None:
        torch.save(trainer_state, tmp / STATE_NAME)
    _sync_tree(tmp)
    _replace(tmp, folder)
    return folder


def _sync_tree(folder: Path) -> None:
    """fsync every file in folder (and the folder), so the rename that follows never publishes unwritten data
    after a power loss (a killed process alone cannot tear the files: the kernel still holds them)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _sync_dir(folder)


def _sync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace(tmp: Path, folder: Path) -> None:
    """Move tmp into folder's place; the old folder is removed only after the new one is complete.
    (A crash between the two renames leaves `NAME.old` and no `NAME`: `recover_interrupted_saves` undoes it.)"""
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)
    _sync_dir(folder.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a small text file (e.g. `best`) so that readers see the old or the new content, never a torn one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def recover_interrupted_saves(out_dir: str | Path) -> list[str]:
    """Clean up after a crash during saving: a `step_N.old` whose `step_N` is missing (the crash fell between
    the two renames of a re-save) becomes `step_N` again; staging folders `step_N.tmp` are removed.
    Returns what was done, one line per folder. Call on one process only, before listing step folders."""
    out_dir, done = Path(out_dir), []
    if not out_dir.is_dir():
        return done
    for path in sorted(out_dir.iterdir()):
        base = path.name.rsplit(".", 1)[0]
        if not (path.is_dir() and STEP_RE.match(base)):
            continue
        if path.suffix == ".old" and not (out_dir / base).exists() and (path / CONFIG_NAME).is_file():
            os.replace(path, out_dir / base)
            done.append(f"restored {base} from {path.name} (a save was interrupted between two renames)")
        elif path.suffix in (".tmp", ".old"):
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path.name} (left by an interrupted save)")
    return done


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
    drafter = DRAFTERS[kind].from_config({**config, "folder": str(folder)}, target)  # folder: relative paths
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


def prune(out_dir: str | Path, keep_last: int, best_step: int | None) -> None:
    """Keep the `keep_last` newest step folders (0 = keep all) and the best step, whatever its age."""
    if keep_last <= 0:
        return
    for folder in step_folders(out_dir)[:-keep_last]:
        if best_step is None or folder.name != f"step_{best_step}":
            shutil.rmtree(folder, ignore_errors=True)


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
