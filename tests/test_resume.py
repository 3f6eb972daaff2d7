"""Resume that loses nothing: kill -9 during training, a crash while a checkpoint is written (raised, and killed),
then `train.resume=auto` ends with exactly the weights of an uninterrupted run; save_every / keep_last / best."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab import runtime
from draftlab.config import load_config
from draftlab.drafters import load_drafter
from draftlab.train import main

ROOT = Path(__file__).resolve().parents[1]

# Runs train.main and stops (sleeps) at a chosen point, writing a marker file, so the test can kill -9 it there:
#   PAUSE_AT_MICRO_STEP=k  before taking micro-batch k (training in progress)
#   PAUSE_IN_SAVE=n        inside the n-th weights write, after half of the file is on disk
PAUSING_TRAINER = """
import os, sys, time
sys.path.insert(0, {root!r})
import draftlab.checkpoint as ckpt
import draftlab.runtime as runtime
import draftlab.train as train
from draftlab.config import load_config
from safetensors.torch import save

marker = os.environ["MARKER"]
def pause():
    open(marker, "w").write(str(os.getpid()))
    time.sleep(600)

at = int(os.environ.get("PAUSE_AT_MICRO_STEP", "-1"))
signal_at = int(os.environ.get("SIGNAL_AT_MICRO_STEP", "-1"))
take = runtime.Batches.next
def next_batch(self):
    if self.micro_step == at:
        pause()
    if self.micro_step == signal_at:  # as a scheduler would: the signal arrives while a step is in progress
        import signal
        os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))
    return take(self)
runtime.Batches.next = next_batch

saves = {{"n": 0}}
in_save = int(os.environ.get("PAUSE_IN_SAVE", "-1"))
write = ckpt.save_file
def save_file(tensors, path, *a, **k):
    saves["n"] += 1
    if saves["n"] == in_save:
        data = save(tensors)
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
        pause()
    return write(tensors, path, *a, **k)
ckpt.save_file = save_file
if signal_at >= 0:  # the console entry point: its exit code is under test
    sys.exit(train.cli(sys.argv[1:]))
train.main(load_config(sys.argv[1:]))
"""


def args(target_dir, data, out_dir, *extra):
    # feature noise on: the resumed run must also get the RNG stream back, not only weights and data position
    return ["recipe=eagle_head", f"target.path={target_dir}", f"data.train={data}", f"out_dir={out_dir}",
            "eval.every=0", "tracking=jsonl", "train.keep_last=0", "data.max_length=96", "drafter.feature_noise=0.2",
            "train.batch_size=4", "train.grad_accum=1", "train.lr=2e-3", "train.warmup_steps=2",
            "train.schedule=cosine",
            "train.log_every=1", "train.max_steps=6", "train.save_every=2", "train.num_threads=1", *extra]


@pytest.fixture(autouse=True)
def keep_thread_count():
    """train.num_threads=1 (deterministic CPU kernels in every run) must not leak into other tests."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def uninterrupted(tiny_target_dir, tiny_chat_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    n = torch.get_num_threads()
    main(load_config(args(tiny_target_dir, tiny_chat_file, out)))
    torch.set_num_threads(n)
    return out


def final_weights(out: Path) -> dict:
    return load_file(str(out / "step_6" / ckpt.WEIGHTS_NAME))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k] - b[k]).abs().max().item()}"


def run_until_paused(tmp_path: Path, train_args: list[str], **pause: str) -> subprocess.Popen:
    """Start the pausing trainer, wait until it pauses, return the still running process."""
    script, marker = tmp_path / "pausing_trainer.py", tmp_path / "paused"
    script.write_text(PAUSING_TRAINER.format(root=str(ROOT)))
    env = {**os.environ, "MARKER": str(marker), "PYTHONPATH": str(ROOT), **pause}
    proc = subprocess.Popen([sys.executable, str(script), *train_args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} before pausing: {proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("trainer did not reach the pause point in time")
        time.sleep(0.2)
    return proc


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def metrics_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_kill_9_mid_training_then_resume_auto_matches_an_uninterrupted_run(
        uninterrupted, tiny_target_dir, tiny_chat_file, tmp_path):
    out = tmp_path / "run"
    # killed while taking the batch of step 6: step 4 is saved, step 5 is trained but not saved
    kill9(run_until_paused(tmp_path, args(tiny_target_dir, tiny_chat_file, out), PAUSE_AT_MICRO_STEP="5"))
    assert [p.name for p in ckpt.step_folders(out)] == ["step_2", "step_4"]
    summary = main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.resume=auto")))
    assert summary["steps"] == 6
    assert_same_weights(final_weights(out), final_weights(uninterrupted))
    # the trainer state matches too (optimizer moments, data position)
    a, b = ckpt.load_trainer_state(out / "step_6"), ckpt.load_trainer_state(uninterrupted / "step_6")
    assert a["micro_step"] == b["micro_step"] == 6
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    # metrics.jsonl reads as one run: the re-run step 5 is logged once, the launches are in run_info.json
    assert metrics_steps(out) == [1, 2, 3, 4, 5, 6]
    launches = json.loads((out / "run_info.json").read_text())["launches"]
    assert len(launches) == 2 and launches[1]["resumed_from"].endswith("step_4")


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_saves_the_step_in_progress_then_resume_matches_an_uninterrupted_run(
        uninterrupted, tiny_target_dir, tiny_chat_file, tmp_path, name):
    """What a cluster sends before preempting a job: the step in progress finishes and is saved, the process
    exits with the signal's code (128 + its number), and train.resume=auto continues as if nothing happened."""
    out, script = tmp_path / "run", tmp_path / "trainer.py"
    script.write_text(PAUSING_TRAINER.format(root=str(ROOT)))
    env = {**os.environ, "MARKER": str(tmp_path / "unused"), "PYTHONPATH": str(ROOT), "SIGNAL": name,
           "SIGNAL_AT_MICRO_STEP": "2"}  # while taking the batch of step 3
    proc = subprocess.run([sys.executable, str(script), *args(tiny_target_dir, tiny_chat_file, out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + getattr(signal, name), proc.stderr[-3000:]
    assert f"{name} received: stopped at step 3 of 6" in proc.stderr + proc.stdout
    assert [p.name for p in ckpt.step_folders(out)] == ["step_2", "step_3"]
    assert ckpt.load_trainer_state(out / "step_3")["step"] == 3
    summary = main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.resume=auto")))
    assert summary["steps"] == 6 and summary["stopped_by"] is None
    assert_same_weights(final_weights(out), final_weights(uninterrupted))
    assert metrics_steps(out) == [1, 2, 3, 4, 5, 6]


def test_stop_signals_record_the_first_signal_and_put_the_old_handler_back():
    before = signal.getsignal(signal.SIGUSR1)
    with runtime.StopSignals() as stop:
        assert stop.received is None and stop.exit_code == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        assert stop.received == "SIGUSR1" and stop.exit_code == 128 + signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before


def test_crash_raised_while_writing_a_checkpoint(uninterrupted, tiny_target_dir, tiny_chat_file, tmp_path,
                                                 monkeypatch, tiny_target, capsys):
    """The third weights write (step 6) fails half-way on a full disk: the partial folder is removed, the run stops
    with one line (exit 2) naming the intact checkpoints and the resume setting, step 4 stays complete and
    loadable, resume=auto picks it."""
    from draftlab.cli import run_guarded

    from safetensors.torch import save

    out, calls, real = tmp_path / "run", {"n": 0}, ckpt.save_file

    def failing_save_file(tensors, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            data = save(tensors)
            Path(path).write_bytes(data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(ckpt, "save_file", failing_save_file)
    capsys.readouterr()
    assert run_guarded(lambda: main(load_config(args(tiny_target_dir, tiny_chat_file, out)))) == 2
    monkeypatch.setattr(ckpt, "save_file", real)
    err = capsys.readouterr().err  # progress bars, then the error
    lines = [line for line in err.splitlines() if line.startswith("draftlab:")]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert "no space left on device" in lines[0] and "step_6" in lines[0], lines
    assert f"intact checkpoints in {out}: step_2, step_4" in lines[0] and "train.resume=auto" in lines[0]

    assert not (out / "step_6.tmp").exists() and not (out / "step_6").exists()  # the partial folder is gone
    assert [p.name for p in ckpt.step_folders(out)] == ["step_2", "step_4"]
    assert ckpt.resolve_checkpoint(out).name == "step_4"
    target, _ = tiny_target
    assert load_drafter(out, target) is not None  # the last good checkpoint loads
    main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.resume=auto")))
    assert not (out / "step_6.tmp").exists()
    assert_same_weights(final_weights(out), final_weights(uninterrupted))


def test_kill_9_while_writing_a_checkpoint(uninterrupted, tiny_target_dir, tiny_chat_file, tmp_path):
    out = tmp_path / "run"
    # paused inside the second weights write (step 4), half of model.safetensors on disk
    kill9(run_until_paused(tmp_path, args(tiny_target_dir, tiny_chat_file, out), PAUSE_IN_SAVE="2"))
    torn = out / "step_4.tmp" / ckpt.WEIGHTS_NAME
    assert torn.is_file() and not (out / "step_4").exists()
    with pytest.raises(Exception):
        load_file(str(torn))  # really torn
    assert [p.name for p in ckpt.step_folders(out)] == ["step_2"]
    main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.resume=auto")))
    assert_same_weights(final_weights(out), final_weights(uninterrupted))
    assert metrics_steps(out) == [1, 2, 3, 4, 5, 6]


def test_resume_auto_on_an_empty_folder_starts_fresh(tiny_target_dir, tiny_chat_file, tmp_path):
    summary = main(load_config(args(tiny_target_dir, tiny_chat_file, tmp_path / "new", "train.resume=auto",
                                    "train.max_steps=2")))
    assert summary["steps"] == 2


def test_keep_last_prunes_old_steps(tiny_target_dir, tiny_chat_file, tmp_path):
    out = tmp_path / "run"
    main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.save_every=1", "train.keep_last=2",
                          "train.max_steps=4")))
    assert [p.name for p in ckpt.step_folders(out)] == ["step_3", "step_4"]


def test_prune_never_deletes_the_best(tmp_path):
    for step in (1, 2, 3, 4, 5):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / ckpt.CONFIG_NAME).write_text("{}")
    ckpt.prune(tmp_path, keep_last=2, best_step=1)
    assert [p.name for p in ckpt.step_folders(tmp_path)] == ["step_1", "step_4", "step_5"]
    ckpt.prune(tmp_path, keep_last=0, best_step=None)  # 0 = keep all
    assert len(ckpt.step_folders(tmp_path)) == 3


def test_recover_after_a_crash_between_the_two_renames(tmp_path):
    """Re-saving step_2: the old folder was moved aside, the new one not yet moved in."""
    old = tmp_path / "step_2.old"
    old.mkdir()
    (old / ckpt.CONFIG_NAME).write_text("{}")
    (tmp_path / "step_2.tmp").mkdir()
    done = ckpt.recover_interrupted_saves(tmp_path)
    assert len(done) == 2
    assert [p.name for p in ckpt.step_folders(tmp_path)] == ["step_2"]
    assert not (tmp_path / "step_2.tmp").exists() and not old.exists()


def test_atomic_text_write_replaces_whole_content(tmp_path):
    path = tmp_path / "best"
    ckpt.write_text_atomic(path, "step_2\n")
    ckpt.write_text_atomic(path, "step_10\n")
    assert path.read_text() == "step_10\n" and not (tmp_path / "best.tmp").exists()


def test_resume_position_when_the_global_batch_changed():
    same, warning = runtime.resume_position({"micro_step": 10, "batch_size": 4, "world_size": 2}, 4, 2)
    assert (same, warning) == (10, None)
    moved, warning = runtime.resume_position({"micro_step": 10, "batch_size": 4, "world_size": 2}, 4, 4)
    assert moved == 5 and "80 rows" in warning  # same number of rows seen
    old_format, _ = runtime.resume_position({"micro_step": 3}, 4, 1)  # checkpoints without the layout
    assert old_format == 3


def test_rng_restore_picks_this_ranks_stream():
    torch.manual_seed(1)
    first = runtime.rng_state()
    torch.manual_seed(2)
    second = runtime.rng_state()
    assert runtime.restore_rng([first, second], rank=1, seed=0, step=0) is None
    assert torch.equal(torch.get_rng_state(), second["torch"])
    assert runtime.restore_rng(first, rank=0, seed=0, step=0) is None  # an older checkpoint: one dict
    assert torch.equal(torch.get_rng_state(), first["torch"])
    assert "fresh" in runtime.restore_rng([first], rank=3, seed=0, step=5)


def test_max_minutes_stops_saves_and_counts_across_resumes(tiny_target_dir, tiny_chat_file, tmp_path):
    """train.max_minutes: the run stops at the first step past the budget and saves it as its final checkpoint;
    a resumed run counts the time already spent, so it does not train further."""
    out = tmp_path / "run"
    summary = main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.max_minutes=1e-6")))
    assert summary["steps"] == 1 and (out / "step_1" / ckpt.WEIGHTS_NAME).is_file()
    state = ckpt.load_trainer_state(out / "step_1")
    assert state["train_seconds"] > 0
    resumed = main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.max_minutes=1e-6",
                                    "train.resume=auto")))
    assert resumed["steps"] == 1 and not (out / "step_2").exists()
    more = main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.resume=auto")))  # budget lifted
    assert more["steps"] == 6 and (out / "step_6").is_dir()
