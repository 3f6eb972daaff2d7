"""Faults that used to end in a traceback or lose work: a full disk as torch.save and safetensors report it (they
raise no OSError), outputs that cannot be written (checked before anything loads), and misleading messages (a
folder given as the prompt file, a step pruned by a running training while `draftlab eval` loads it, Ctrl-C during
training). Each gives one line, a non-zero exit (2 for errors), loses nothing already written and leaves no `.tmp`."""
from __future__ import annotations

import json
import os
import signal
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save

from draftlab import checkpoint as ckpt
from draftlab import cli, errors
from draftlab.config import load_config
from draftlab.errors import CheckpointError, DiskFullError
from draftlab.train import main
from test_faults import error_lines, keep_thread_count  # noqa: F401 (an autouse fixture)
from test_resume import PAUSING_TRAINER, args

ROOT = Path(__file__).resolve().parents[1]
# what they really raise when the disk fills up (torch 2.x's zip writer, safetensors 0.4+; seen on a full tmpfs)
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 640 vs 598"
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- a full disk, as torch.save and safetensors report it ------------------------------------------------------

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(64))

    def drafter_config(self) -> dict:
        return {"kind": "tiny"}


def free_space(monkeypatch, n: int) -> None:
    """What the disk says it has free (the check and the message both ask)."""
    monkeypatch.setattr(errors, "free_bytes", lambda where: n)
    monkeypatch.setattr(ckpt, "free_bytes", lambda where: n)


def safetensors_fills_the_disk(tensors, path, *a, **k):
    Path(path).write_bytes(save(tensors)[:100])  # part of the file is on disk when the device fills up
    raise SafetensorError(SAFETENSORS_FULL)


def torch_fills_the_disk(obj, path, *a, **k):
    Path(path).write_bytes(b"PK\x03\x04 part of a zip")
    raise RuntimeError(TORCH_FULL)


@pytest.mark.parametrize("writer", ["safetensors", "torch"])
def test_a_full_disk_while_writing_a_checkpoint_is_one_line_and_removes_the_partial_folder(tmp_path, monkeypatch,
                                                                                            writer):
    run = tmp_path / "run"
    ckpt.save_drafter(Tiny(), run / "step_2", trainer_state={"step": 2})
    before = snapshot(run)
    if writer == "safetensors":
        monkeypatch.setattr(ckpt, "save_file", safetensors_fills_the_disk)
    else:  # torch says nothing of the cause: a device with (almost) no space left decides
        monkeypatch.setattr(torch, "save", torch_fills_the_disk)
        free_space(monkeypatch, 12 * 2**10)
    with pytest.raises(DiskFullError) as err:
        ckpt.save_drafter(Tiny(), run / "step_4", trainer_state={"step": 4})
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"no space left on device writing checkpoint {run / 'step_4'}")
    assert "its partial step_4.tmp was removed" in message and "a checkpoint of this run takes about" in message
    if writer == "torch":
        assert "12.0 KB free on that disk now" in message
    assert snapshot(run) == before and not list(run.glob("*.tmp"))  # step_2 untouched, nothing half-written


def test_a_write_failure_that_is_not_a_full_disk_is_one_line_too(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", torch_fills_the_disk)  # plenty of space: an I/O error of the device
    free_space(monkeypatch, 2**40)
    with pytest.raises(CheckpointError) as err:
        ckpt.save_drafter(Tiny(), tmp_path / "step_1", trainer_state={"step": 1})
    assert not isinstance(err.value, DiskFullError) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"writing checkpoint {tmp_path / 'step_1'} failed ({TORCH_FULL})")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch, "save", lambda obj, path: (_ for _ in ()).throw(TypeError("cannot pickle")))
    with pytest.raises(TypeError):  # a bug is not dressed up as a disk problem, but leaves nothing behind either
        ckpt.save_drafter(Tiny(), tmp_path / "step_1", trainer_state={"step": 1})
    assert list(tmp_path.iterdir()) == []


def test_training_on_a_disk_that_fills_up_stops_with_one_line_and_keeps_the_saved_steps(
        tiny_target_dir, tiny_chat_file, tmp_path, monkeypatch, capsys):
    out, real, calls = tmp_path / "run", torch.save, {"n": 0}

    def full_at_the_second_trainer_state(obj, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # step_4's trainer_state.pt
            return torch_fills_the_disk(obj, path)
        return real(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", full_at_the_second_trainer_state)
    free_space(monkeypatch, 0)
    capsys.readouterr()
    assert cli.run_guarded(lambda: main(load_config(args(tiny_target_dir, tiny_chat_file, out)))) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"no space left on device writing checkpoint {out / 'step_4'}" in lines[0], lines
    assert "0.0 B free on that disk now" in lines[0]
    assert f"intact checkpoints in {out}: step_2" in lines[0] and "train.resume=auto" in lines[0]
    assert [p.name for p in ckpt.step_folders(out)] == ["step_2"] and not list(out.glob("*.tmp"))
    assert ckpt.checkpoint_problem(out / "step_2", resumable=True) is None


def test_a_full_disk_while_deepspeed_writes_its_shards_is_one_line_too(tiny_target_dir, tiny_chat_file, tmp_path,
                                                                       monkeypatch, capsys):
    """DeepSpeed's own checkpoint (each rank's optimizer shard, written with torch.save into the staging folder)
    failing on a full disk: the same one line as draftlab's own files, the partial folder removed, step_2 kept."""
    import draftlab.train as train
    from draftlab import runtime

    calls = {"n": 0}

    def save_checkpoint(self, save_dir, tag=None, **kw):
        calls["n"] += 1
        Path(save_dir, tag).mkdir(parents=True)
        if calls["n"] == 2:  # step_4's shards
            return torch_fills_the_disk(None, Path(save_dir, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        Path(save_dir, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"shard")

    monkeypatch.setattr(runtime, "is_deepspeed", lambda accelerator: True)
    monkeypatch.setattr(train.DrafterLoss, "save_checkpoint", save_checkpoint, raising=False)
    free_space(monkeypatch, 0)
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli.run_guarded(lambda: main(load_config(args(tiny_target_dir, tiny_chat_file, out)))) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"no space left on device writing checkpoint {out / 'step_4'}" in lines[0], lines
    assert f"intact checkpoints in {out}: step_2" in lines[0] and "train.resume=auto" in lines[0]
    assert [p.name for p in ckpt.step_folders(out)] == ["step_2"] and not list(out.glob("*.tmp"))


# --- outputs that cannot be written: refused before anything loads ----------------------------------------------

def eval_argv(checkpoint, target_dir, prompts, *options) -> list[str]:
    return ["eval", "--checkpoint", str(checkpoint), "--target", target_dir, "--prompts", str(prompts),
            "--max-new-tokens", "4", "--draft-length", "2", "--num-prompts", "1", *options]


@pytest.fixture
def run_folder(tiny_target, tmp_path) -> Path:
    from draftlab.drafters.eagle import EagleHead

    model, _ = tiny_target
    run = tmp_path / "run"
    for step in (2, 4):
        ckpt.save_drafter(EagleHead.from_target(model, None), run / f"step_{step}")
    return run


@pytest.mark.parametrize("case", ["out is a folder", "out goes through a file", "out names the table",
                                  "log is a folder", "out cannot be written", "prompts is a folder"])
def test_eval_refuses_outputs_it_could_not_write_before_anything_loads(run_folder, tiny_target_dir, tiny_prompt_file,
                                                                       tmp_path, monkeypatch, capsys, case):
    import draftlab.target

    def no_loading(*a, **k):
        raise AssertionError("the target was loaded before the outputs were checked")

    monkeypatch.setattr(draftlab.target, "load_target", no_loading)
    folder, afile = tmp_path / "reports", tmp_path / "notes.txt"
    folder.mkdir()
    afile.write_text("kept\n")
    out, prompts, extra = tmp_path / "report.json", tiny_prompt_file, []
    if case == "out is a folder":
        out, words = folder, [f"--out {folder} is a folder", f"--out {folder / 'report.json'}"]
    elif case == "out goes through a file":
        out, words = afile / "report.json", [f"{afile} is a file, not a folder"]
    elif case == "out names the table":
        out, words = tmp_path / "report.md", ["the report's table is written beside it as report.md",
                                              f"--out {tmp_path / 'report.json'}"]
    elif case == "log is a folder":
        extra, words = ["--log-rounds", str(folder)], [f"--log-rounds {folder} is a folder", "rounds.jsonl"]
    elif case == "out cannot be written":
        if os.geteuid() == 0:  # root writes into a read-only folder: its write is refused as a user's would be
            import tempfile

            def refused(*a, **k):
                raise PermissionError(13, "Permission denied")

            monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)
        else:
            folder.chmod(0o555)
        out, words = folder / "report.json", [f"{folder} cannot be written (Permission denied)"]
    else:
        prompts, words = folder, [f"--prompts {folder} is a folder", "pass a .jsonl file"]
    before = snapshot(tmp_path)
    capsys.readouterr()
    code = cli.main(eval_argv(run_folder, tiny_target_dir, prompts, "--out", str(out), *extra))
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert snapshot(tmp_path) == before  # nothing written, nothing lost (not even a probe file)


def test_eval_output_checks_as_a_user_meets_them(run_folder, tiny_target_dir, tiny_prompt_file, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "draftlab.cli",
                           *eval_argv(run_folder, tiny_target_dir, tiny_prompt_file, "--out", str(tmp_path))],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        f"draftlab: error: --out {tmp_path} is a folder: name the file to write, e.g. --out {tmp_path / 'report.json'}"]


def test_out_dir_naming_a_file_is_one_line(tiny_target_dir, tiny_chat_file, tmp_path):
    afile = tmp_path / "run"
    afile.write_text("not a run folder\n")
    for out_dir in (afile, afile / "sub"):
        overrides = args(tiny_target_dir, tiny_chat_file, out_dir)
        for command in (["-m", "draftlab.cli", "train", *overrides], ["draftlab/train.py", "--check", *overrides]):
            proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300, cwd=ROOT)
            assert proc.returncode == 2 and error_lines(proc.stderr) == [
                f"draftlab: error: run folder {out_dir}: {afile} is a file, not a folder: choose another path "
                "(nothing was written)"], proc.stderr[-3000:]
    assert afile.read_text() == "not a run folder\n" and sorted(tmp_path.iterdir()) == [afile]


# --- a step pruned by a running training while `draftlab eval` loads it --------------------------------------------

def test_eval_falls_back_to_a_step_that_exists_when_training_prunes_the_chosen_one(
        run_folder, tiny_target, tiny_target_dir, tiny_prompt_file, tmp_path, monkeypatch, capsys):
    """`draftlab eval --checkpoint RUN` picks RUN's newest step, then loads the target; meanwhile the training saves a
    newer step and keep_last=1 removes the chosen one. The newest step that exists is loaded instead, with a warning."""
    import draftlab.target
    from draftlab.drafters.eagle import EagleHead

    real = draftlab.target.load_target

    def training_goes_on(*a, **k):
        loaded = real(*a, **k)
        ckpt.save_drafter(EagleHead.from_target(tiny_target[0], None), run_folder / "step_6")
        ckpt.prune(run_folder, keep_last=1, best_step=None)
        return loaded

    monkeypatch.setattr(draftlab.target, "load_target", training_goes_on)
    report = tmp_path / "report.json"
    capsys.readouterr()
    code = cli.main(eval_argv(run_folder, tiny_target_dir, tiny_prompt_file, "--out", str(report)))
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert (f"checkpoint: step_4 was removed while it loaded (a training still writing {run_folder} keeps only its "
            "newest steps, train.keep_last); using step_6") in err
    assert json.loads(report.read_text())["drafter"] == str(run_folder / "step_6")


def test_a_step_named_by_the_user_is_never_replaced_by_another(run_folder):
    def removed_meanwhile(step):
        ckpt.shutil.rmtree(step)
        raise CheckpointError(f"checkpoint {step} does not exist")

    with pytest.raises(CheckpointError, match="step_4 does not exist"):
        ckpt.load_step(run_folder / "step_4", removed_meanwhile)
    assert ckpt.load_step(run_folder, lambda step: step.name) == (run_folder / "step_2", "step_2")


# --- Ctrl-C during training: saved like SIGTERM, with the command that continues ------------------------------------

def test_ctrl_c_during_training_saves_the_step_and_prints_the_resume_command(tiny_target_dir, tiny_chat_file,
                                                                             tmp_path):
    """train.save_every=0: nothing would be saved before the end; Ctrl-C (SIGINT) saves the step in progress, exits
    130 like any interruption, and prints the command that continues, which does."""
    out, script = tmp_path / "run", tmp_path / "train.py"
    script.write_text(PAUSING_TRAINER.format(root=str(ROOT)))  # named train.py: the command shown runs it again
    overrides = args(tiny_target_dir, tiny_chat_file, out, "train.save_every=0")
    env = {**os.environ, "MARKER": str(tmp_path / "unused"), "PYTHONPATH": str(ROOT), "SIGNAL": "SIGINT",
           "SIGNAL_AT_MICRO_STEP": "2"}  # while taking the batch of step 3
    proc = subprocess.run([sys.executable, str(script), *overrides], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "draftlab: interrupted" not in proc.stderr
    assert "SIGINT: stopping after this step; it is saved first" in proc.stderr
    command = ["python", str(script), *overrides, "train.resume=auto"]
    line = f"SIGINT received: stopped at step 3 of 6, saved as {out / 'step_3'}; continue with: {shlex.join(command)}"
    assert line in proc.stdout, proc.stdout[-3000:]
    assert [p.name for p in ckpt.step_folders(out)] == ["step_3"] and not list(out.glob("*.tmp"))
    assert ckpt.load_trainer_state(out / "step_3")["step"] == 3
    env = {k: v for k, v in env.items() if k not in ("SIGNAL", "SIGNAL_AT_MICRO_STEP")}
    resumed = subprocess.run([sys.executable, *shlex.split(line.split("continue with: ")[1])[1:]], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'step_3'} at step 3" in resumed.stdout
    assert [p.name for p in ckpt.step_folders(out)] == ["step_3", "step_6"]


def test_a_second_ctrl_c_stops_at_once_but_a_forwarded_copy_does_not():
    from draftlab import runtime

    before = signal.getsignal(signal.SIGINT)
    with runtime.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C, forwarded by a launcher
        time.sleep(0.05)
        assert stop.received == "SIGINT" and stop.exit_code == 130
        stop._at -= 2 * stop.REPEAT_SECONDS  # later: the user presses Ctrl-C again
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # started as a background job: Ctrl-C is not for it
    try:
        with runtime.StopSignals():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_resume_command_repeats_the_command_line_with_resume_auto(monkeypatch):
    from draftlab.runtime import resume_command

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resume_command(["/venv/bin/draftlab", "train", "recipe=eagle_head", "out_dir=my run",
                           "train.resume=/r/step_2"]) == "draftlab train recipe=eagle_head 'out_dir=my run' " \
                                                         "train.resume=auto"
    assert resume_command(["/src/draftlab/cli.py", "train", "recipe=x"]) == \
        "python -m draftlab.cli train recipe=x train.resume=auto"
    assert resume_command(["draftlab/train.py", "recipe=x"]) == "python draftlab/train.py recipe=x train.resume=auto"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_command(["draftlab/train.py", "recipe=x"]) == "the same launch with: recipe=x train.resume=auto"
