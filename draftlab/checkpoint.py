"""Checkpoint folders: drafter weights (safetensors) + config, trainer state, and run-folder resolution.

A step folder `out_dir/step_N/` holds `drafter_config.json`, `model.safetensors` (trainable weights only:
frozen pieces shared with the target are rebuilt from it), `eval.json` when evaluated, and
`trainer_state.pt` for resuming. Folders are written to a temporary sibling and renamed into place, so a
crash while saving leaves the previous checkpoint intact.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftlab.errors import (CheckpointError, DiskFullError, disk_full_errno, free_bytes, human_bytes,
                             is_write_failure)

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "model.safetensors"
STATE_NAME = "trainer_state.pt"


def intact_steps_text(out_dir: str | Path) -> str:
    """Which checkpoints of a run survived, for messages: 'intact checkpoints in DIR: step_2, step_4'."""
    steps = [p.name for p in step_folders(out_dir) if checkpoint_problem(p, resumable=True) is None]
    return f"intact checkpoints in {out_dir}: {', '.join(steps) if steps else 'none yet'}"


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
    try:
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
    except BaseException as e:
        failure = write_failure(e, folder)
        if failure is None:
            shutil.rmtree(staging_folder(folder), ignore_errors=True)  # a crash: nothing half-written stays behind
            raise
    else:
        replace_folder(tmp, folder)
        return folder
    raise failed_save(folder, *failure)


def write_failure(e: BaseException, folder: Path) -> tuple[int | None, str] | None:
    """(errno of a full disk or quota, or None; the first line of the error) when `e` is a failed write into
    `folder`'s staging folder, None when it is anything else (a crash, to be raised as it is)."""
    full, reason = disk_full_errno(e, Path(folder).parent), str(e).splitlines()[0] if str(e) else type(e).__name__
    return None if full is None and not is_write_failure(e) else (full, reason)


def failed_save(folder: Path, full: int | None, reason: str) -> CheckpointError:
    """Remove the partial staging folder of a failed write and return the one-line error to raise. Call it once the
    exception is handled: the file handles its traceback held are gone then, so on a full disk the message's
    advice, free some space, is enough. Earlier steps were not touched."""
    folder = Path(folder)
    shutil.rmtree(staging_folder(folder), ignore_errors=True)
    if full is not None:
        free, size = free_bytes(folder.parent), _newest_step_size(folder)
        return DiskFullError(
            f"{'disk quota exceeded' if full == errno.EDQUOT else 'no space left on device'} writing checkpoint "
            f"{folder} (its partial {staging_folder(folder).name} was removed; "
            f"{'?' if free is None else human_bytes(free)} free on that disk now"
            + (f", a checkpoint of this run takes about {human_bytes(size)}" if size else "") + ")")
    return CheckpointError(f"writing checkpoint {folder} failed ({reason}); its partial {staging_folder(folder).name} "
                           f"was removed and earlier steps are untouched: check that {folder.parent} is writable "
                           "and its device healthy")


def _newest_step_size(folder: Path) -> int:
    """Bytes of the newest complete step folder beside `folder` (0 when there is none): what one more needs."""
    try:
        steps = [p for p in step_folders(folder.parent) if p != folder]
        return sum(f.stat().st_size for f in steps[-1].rglob("*") if f.is_file()) if steps else 0
    except OSError:
        return 0


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


def replace_folder(tmp: Path, folder: Path) -> None:
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
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: the old content stays, no torn temporary file
        raise
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
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupt ({e.msg} at line {e.lineno}): re-save or pick another step") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is corrupt (not UTF-8 text): re-save or pick another step") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is corrupt (not a JSON object): re-save or pick another step")
    return config


def restore_drafter(folder: str | Path, target, kinds: dict) -> torch.nn.Module:
    """Rebuild a drafter from its config and the target, then load its trainable weights (strict).
    kinds: the drafter classes it may be, by kind (draftlab.drafters.load_drafter passes every kind)."""
    from draftlab.target import target_fingerprint

    folder = resolve_checkpoint(folder)
    config = read_drafter_config(folder)
    kind = config.get("kind")
    if kind not in kinds:
        raise CheckpointError(f"{folder / CONFIG_NAME} names drafter kind '{kind}': expected {', '.join(kinds)}")
    saved = config.get("target") or {}
    current = target_fingerprint(target, None)
    for key in ("vocab_size", "hidden_size"):
        if key in saved and saved[key] != current.get(key):
            raise CheckpointError(f"checkpoint {folder} was trained for a target with {key}={saved[key]}, "
                                  f"but this target has {key}={current.get(key)}: pass the matching --target")
    drafter = kinds[kind].from_config({**config, "folder": str(folder)}, target)  # folder: relative paths
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


def checkpoint_problem(folder: str | Path, resumable: bool = False) -> str | None:
    """Why a step folder cannot be loaded, or None when it can: a missing or unparsable drafter config, a
    safetensors file whose header is unreadable or whose size disagrees with it (a torn write), and with
    `resumable` a missing trainer state or one that is not a complete torch archive. Reads headers only."""
    from safetensors import safe_open

    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file():
        return f"{CONFIG_NAME} is missing"
    try:
        if not isinstance(json.loads((folder / CONFIG_NAME).read_text()), dict):
            return f"{CONFIG_NAME} is not a JSON object"
    except (ValueError, OSError) as e:
        return f"{CONFIG_NAME} is corrupt ({type(e).__name__})"
    if not (folder / WEIGHTS_NAME).is_file():
        return f"{WEIGHTS_NAME} is missing"
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as e:
            return f"{file.name} is truncated or corrupt ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if resumable:
        if not (folder / STATE_NAME).is_file():
            return f"{STATE_NAME} is missing"
        try:
            zipfile.ZipFile(folder / STATE_NAME).close()
        except (zipfile.BadZipFile, OSError) as e:
            return f"{STATE_NAME} is truncated or corrupt ({e})"
    return None


def newest_usable(candidates: list[Path], resumable: bool = False) -> tuple[Path | None, list[str]]:
    """The first loadable step folder of `candidates` (in the order given) and 'step_N: why' for each one
    skipped before it."""
    skipped = []
    for folder in candidates:
        problem = checkpoint_problem(folder, resumable)
        if problem is None:
            return folder, skipped
        skipped.append(f"{folder.name}: {problem}")
    return None, skipped


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder means its best step (or its latest when none was evaluated); a step folder means itself.
    A damaged best / newest step of a run folder is skipped, with a warning on stderr naming it and why, for
    the newest step that loads."""
    path = Path(path)
    if (path / CONFIG_NAME).is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    best = path / "best"  # names a step folder (a run) or the native folder (an export)
    best = path / best.read_text(errors="replace").strip() if best.is_file() else None
    order = [best] if best is not None and best.parent == path and best.is_dir() else []
    order += [p for p in reversed(step_folders(path)) if p not in order]
    if not order:
        raise CheckpointError(f"{path} holds no checkpoint: expected {CONFIG_NAME} or step_N folders")
    chosen, skipped = newest_usable(order)
    if chosen is None:
        raise CheckpointError(f"{path} holds no loadable checkpoint ({'; '.join(skipped)}): re-run or resume "
                              "the training that wrote it")
    if skipped:
        _warn_once(f"checkpoint: skipped {'; '.join(skipped)}; using {chosen}")
    return chosen


def load_step(path: str | Path, load, chosen: Path | None = None, attempts: int = 5):
    """(step folder, load(step folder)) for the step `path` resolves to (`chosen`: already resolved, e.g. for checks
    made before a slow target load). A run folder that a training still writes can lose that step between choosing
    and loading (train.keep_last prunes the oldest steps as new ones are saved): when loading fails and the step is
    gone or incomplete, the run's step is chosen again and loaded, with a warning naming both. A step folder given
    by its own name is never replaced by another."""
    path = Path(path)
    folder = chosen or resolve_checkpoint(path)
    for _ in range(attempts - 1):
        try:
            return folder, load(folder)
        except Exception:
            if folder == path or checkpoint_problem(folder) is None:
                raise  # an intact step that does not load, or one named by the user: its own error
        gone, folder = folder, resolve_checkpoint(path)
        _warn_once(f"checkpoint: {gone.name} was removed while it loaded (a training still writing {path} keeps only "
                   f"its newest steps, train.keep_last); using {folder.name}")
    return folder, load(folder)


_warned: set[str] = set()


def _warn_once(line: str) -> None:
    """Print a warning line to stderr once per process (a run folder is often resolved more than once)."""
    if line not in _warned:
        _warned.add(line)
        print(line, file=sys.stderr, flush=True)


def load_trainer_state(folder: str | Path) -> dict:
    path = Path(folder) / STATE_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: this step cannot be resumed (it was saved without trainer state)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"{path} is corrupt ({type(e).__name__}): resume from an earlier step_N "
                              "folder (train.resume=PATH)") from None


def checkpoint_target(folder: Path) -> str:
    """The target path a checkpoint was trained with: its run's config.yaml, else its drafter config."""
    import yaml

    for cfg_file in (folder / "config.yaml", folder.parent / "config.yaml"):
        if cfg_file.is_file():
            try:
                path = ((yaml.safe_load(cfg_file.read_text()) or {}).get("target") or {}).get("path")
            except (yaml.YAMLError, AttributeError, OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{cfg_file} is not a readable run config ({type(e).__name__}): fix it or pass "
                                      "--target PATH") from None
            if path:
                return str(path)
    name = (read_drafter_config(folder).get("target") or {}).get("name_or_path")
    if not name:
        raise CheckpointError(f"cannot tell which target {folder} belongs to: pass --target PATH")
    return name
