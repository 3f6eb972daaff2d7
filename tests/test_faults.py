"""Faults that must lose nothing: two writers on one run folder / store / answers file, a lock left by a killed
process, a full disk (injected ENOSPC) while saving a checkpoint, logging, building a store, exporting or
answering prompts, and a damaged newest checkpoint under train.resume=auto and `draftlab eval`."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftlab import checkpoint as ckpt
from draftlab import cli, runlock, runtime
from draftlab.config import ConfigError, load_config
from draftlab.runlock import FolderLock, LockError
from draftlab.train import main
from test_resume import args, kill9, run_until_paused

ROOT = Path(__file__).resolve().parents[1]
NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(autouse=True)
def keep_thread_count():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def error_lines(err: str) -> list[str]:
    """The error lines of a command's stderr (model-loading and training progress bars come before them)."""
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.splitlines() if line.startswith("draftlab:")]


# --- the lock itself ---------------------------------------------------------------------------------------------

def test_a_second_holder_is_refused_by_name_and_the_lock_leaves_nothing_behind(tmp_path):
    folder = tmp_path / "new_run"
    first = FolderLock(folder / runlock.LOCK_NAME, f"run folder {folder}", "choose another out_dir").acquire()
    assert json.loads((folder / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(LockError) as err:  # flock is per open file: a second open in this process conflicts too
        FolderLock(folder / runlock.LOCK_NAME, f"run folder {folder}", "choose another out_dir").acquire()
    assert str(err.value).startswith(f"run folder {folder} is in use by pid {os.getpid()} on {socket.gethostname()}")
    assert str(err.value).endswith("choose another out_dir")
    with pytest.raises(LockError):
        runtime.run_lock(folder).probe()
    first.release()
    assert not folder.exists()  # the lock made the folder and nothing else was written: it is gone again
    runtime.run_lock(folder).probe()  # free: no error, nothing created
    assert not folder.exists()
    with runtime.run_lock(folder) as again:
        assert again.took_over is None


HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from draftlab.runlock import FolderLock
FolderLock(sys.argv[1], "run folder", "hint").acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path):
    path = tmp_path / "run" / runlock.LOCK_NAME
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT)), str(path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(LockError, match=f"pid {proc.pid} "):
        FolderLock(path, "run folder", "hint").acquire()
    kill9(proc)
    assert path.is_file()  # kill -9 left its lock file behind ...
    lock = FolderLock(path, "run folder", "hint").acquire()  # ... but not its flock
    assert lock.took_over["pid"] == proc.pid
    assert f"took over the lock of pid {proc.pid}" in runlock.stale_note(lock)
    lock.release()


def test_without_flock_the_recorded_pid_is_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "fcntl", None)
    path = tmp_path / runlock.LOCK_NAME
    with FolderLock(path, "store", "hint"):
        with pytest.raises(LockError, match=f"pid {os.getpid()} .*delete {path}"):
            FolderLock(path, "store", "hint").acquire()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    with FolderLock(path, "store", "hint") as lock:  # a dead pid on this host: taken over
        assert lock.took_over["pid"] == dead.pid
    path.write_text(json.dumps({"pid": 1, "host": "another-host"}))  # cannot be checked from here: trusted
    with pytest.raises(LockError, match="pid 1 on another-host"):
        FolderLock(path, "store", "hint").acquire()



@pytest.mark.parametrize("flock", [True, False])
def test_a_waiting_acquire_gets_the_lock_once_it_is_released(tmp_path, monkeypatch, flock):
    """acquire(wait=s) retries while the holder lives: it fails after s seconds, and succeeds once it is released."""
    import threading
    import time

    if not flock:
        monkeypatch.setattr(runlock, "fcntl", None)
    path = tmp_path / runlock.LOCK_NAME
    holder = FolderLock(path, "conversion", "hint").acquire()
    start = time.monotonic()
    with pytest.raises(LockError, match="conversion is in use"):
        FolderLock(path, "conversion", "hint").acquire(wait=0.3, poll=0.05)
    assert time.monotonic() - start >= 0.25
    release = threading.Timer(0.3, holder.release)
    release.start()
    second = FolderLock(path, "conversion", "hint").acquire(wait=None, poll=0.05)
    release.join()
    assert time.monotonic() - start >= 0.55 and second.took_over is None and json.loads(path.read_text())["pid"] == os.getpid()
    second.release()
    assert not path.exists()

# --- one writer per run folder -----------------------------------------------------------------------------------

def test_a_second_training_or_a_resume_into_a_running_run_is_refused(tiny_target_dir, tiny_chat_file, tmp_path,
                                                                       capsys):
    out = tmp_path / "run"
    train_args = args(tiny_target_dir, tiny_chat_file, out)
    running = run_until_paused(tmp_path, train_args, PAUSE_AT_MICRO_STEP="3")  # step 2 saved, step 3 trained
    try:
        before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*")}
        second = subprocess.run([sys.executable, "-m", "draftlab.cli", "train", *train_args], capture_output=True,
                                text=True, timeout=300, cwd=ROOT)
        lines = error_lines(second.stderr)
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert f"run folder {out} is in use by pid {running.pid}" in lines[0] and "choose another out_dir" in lines[0]
        with pytest.raises(LockError, match=f"pid {running.pid}"):  # a resume while it runs: refused too
            main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.resume=auto")))
        assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing of the run was touched
    finally:
        kill9(running)
    capsys.readouterr()
    summary = main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.resume=auto")))
    assert summary["steps"] == 6
    assert f"took over the lock of pid {running.pid}" in capsys.readouterr().out
    assert not (out / runlock.LOCK_NAME).exists()  # released at the end of the run


def test_every_rank_of_a_two_process_run_stops_at_a_held_lock(tiny_target_dir, tiny_chat_file, tmp_path):
    """Only the main process takes the lock; the other rank learns the outcome and stops too (no hang)."""
    from test_distributed import launch_two

    out = tmp_path / "run"
    with runtime.run_lock(out):
        proc = launch_two(tmp_path, args(tiny_target_dir, tiny_chat_file, out, "train.max_steps=2"))
        assert proc.returncode != 0
        refusal = f"LockError: run folder {out} is in use by pid {os.getpid()}"
        assert proc.stderr.count(refusal) == 2, proc.stderr[-3000:]  # rank 0 and rank 1
        assert json.loads((out / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
        assert [p.name for p in out.iterdir()] == [runlock.LOCK_NAME]


def test_store_builds_and_answer_files_have_one_writer(tiny_target, tiny_chat_file, tiny_prompt_file, tmp_path):
    from draftlab.answers import answer_prompts
    from draftlab.data import ChatDataset, load_prompts, read_conversations
    from draftlab.store import build_store, store_lock

    model, tok = tiny_target
    dataset = ChatDataset(read_conversations(tiny_chat_file)[0][:4], tok, 160)
    with store_lock(tmp_path / "store"):
        with pytest.raises(LockError, match=f"feature store {tmp_path / 'store'} is in use by pid {os.getpid()}"):
            build_store(tmp_path / "store", model, tok, dataset, (-1,), progress=False)
        assert not (tmp_path / "store" / "manifest.json").exists()
    answers = tmp_path / "answers.jsonl"
    with FolderLock(str(answers) + ".lock", "answers", "hint"):
        with pytest.raises(LockError, match=f"pid {os.getpid()}"):
            answer_prompts(model, tok, load_prompts(tiny_prompt_file), str(answers), max_new_tokens=4, progress=False)
        assert not answers.exists()


# --- a full disk -------------------------------------------------------------------------------------------------

def test_full_disk_while_logging_names_the_intact_checkpoints(tiny_target_dir, tiny_chat_file, tmp_path,
                                                              monkeypatch, capsys):
    out, real = tmp_path / "run", runtime.log_metrics

    def fails_at_step_3(out_dir, row, accelerator):
        if row["step"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "metrics.jsonl"))
        real(out_dir, row, accelerator)

    monkeypatch.setattr(runtime, "log_metrics", fails_at_step_3)
    capsys.readouterr()
    assert cli.run_guarded(lambda: main(load_config(args(tiny_target_dir, tiny_chat_file, out)))) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"no space left on device writing {out / 'metrics.jsonl'}" in lines[0]
    assert f"intact checkpoints in {out}: step_2" in lines[0] and "train.resume=auto" in lines[0]
    assert ckpt.checkpoint_problem(out / "step_2", resumable=True) is None
    assert not (out / runlock.LOCK_NAME).exists()


def test_full_disk_while_building_a_store_keeps_the_finished_shards(tiny_target, tiny_chat_file, tmp_path,
                                                                    monkeypatch):
    from draftlab import store as store_mod
    from draftlab.data import ChatDataset, read_conversations
    from draftlab.store import StoreError, build_store

    model, tok = tiny_target
    dataset = ChatDataset(read_conversations(tiny_chat_file)[0][:12], tok, 160)
    path, real, calls = tmp_path / "store", store_mod._write_shard, []

    def full_at_second_shard(tensors, file):
        calls.append(file.name)
        if len(calls) == 2:
            file.with_name(file.name + ".tmp").write_bytes(b"part of a shard")
            raise NO_SPACE
        real(tensors, file)

    monkeypatch.setattr(store_mod, "_write_shard", full_at_second_shard)
    options = dict(feature_layers=(-1,), dtype=torch.float32, shard_tokens=150, progress=False)
    with pytest.raises(StoreError) as err:
        build_store(path, model, tok, dataset, **options)
    message = str(err.value)
    assert "\n" not in message and message.startswith("no space left on device")
    assert f"feature store {path} needs about" in message and "1 finished shards are kept" in message
    assert not list(path.glob("*.tmp")) and (path / "shard_00000.safetensors").is_file()
    assert not (path / runlock.LOCK_NAME).exists()
    kept = (path / "shard_00000.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(store_mod, "_write_shard", real)
    store = build_store(path, model, tok, dataset, **options)  # the same build resumes
    assert store.manifest["complete"] and (path / "shard_00000.safetensors").stat().st_mtime_ns == kept


def test_full_disk_while_exporting_keeps_the_previous_export(tiny_target, tmp_path, monkeypatch, capsys):
    from draftlab import hub, model_card
    from draftlab.drafters.eagle import EagleHead

    model, tok = tiny_target
    run = tmp_path / "run"
    ckpt.save_drafter(EagleHead.from_target(model, None), run / "step_1")
    export = hub.export_checkpoint(run, tmp_path / "export", target=model, tokenizer=tok, base_model="me/tiny")
    before = {p.relative_to(export): p.read_bytes() for p in export.rglob("*") if p.is_file()}

    def no_space(folder):
        (Path(folder) / "README.md").write_text("half a card")
        raise NO_SPACE

    monkeypatch.setattr(model_card, "write_card", no_space)
    with pytest.raises(hub.HubError) as err:
        hub.export_checkpoint(run, tmp_path / "export", target=model, tokenizer=tok, base_model="me/tiny")
    assert str(err.value).startswith("no space left on device: the partial export was removed")
    assert {p.relative_to(export): p.read_bytes() for p in export.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "export.tmp").exists()


def test_full_disk_while_answering_keeps_the_answered_rows(tiny_target, tiny_prompt_file, tmp_path, monkeypatch):
    from draftlab import answers as answers_mod
    from draftlab.data import DataError, load_prompts

    model, tok = tiny_target
    prompts, out = load_prompts(tiny_prompt_file), tmp_path / "answers.jsonl"
    real, calls = os.fsync, []

    def full_at_second_batch(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise NO_SPACE
        real(fd)

    monkeypatch.setattr(answers_mod.os, "fsync", full_at_second_batch)
    with pytest.raises(DataError) as err:
        answers_mod.answer_prompts(model, tok, prompts, str(out), max_new_tokens=4, batch_size=3, progress=False)
    monkeypatch.setattr(answers_mod.os, "fsync", real)
    assert str(err.value).startswith("no space left on device") and f"kept in {out}" in str(err.value)
    assert len(answers_mod.read_done_ids(str(out))) >= 3
    counts = answers_mod.answer_prompts(model, tok, prompts, str(out), max_new_tokens=4, batch_size=3, progress=False)
    assert counts["skipped"] >= 3 and len(answers_mod.read_done_ids(str(out))) == len(prompts)


# --- a damaged newest checkpoint ---------------------------------------------------------------------------------

def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_resume_auto_skips_a_damaged_newest_step_and_says_why(tiny_target_dir, tiny_chat_file, tmp_path, capsys):
    out = tmp_path / "run"
    main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.max_steps=4")))
    truncate(out / "step_4" / ckpt.WEIGHTS_NAME)
    capsys.readouterr()
    summary = main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.resume=auto")))
    printed = capsys.readouterr().out
    assert "resume: skipped step_4: model.safetensors is truncated or corrupt" in printed
    assert f"resumed from {out / 'step_2'} at step 2" in printed
    assert summary["steps"] == 6 and ckpt.checkpoint_problem(out / "step_4") is None  # re-saved whole

    for step in ("step_2", "step_4", "step_6"):
        truncate(out / step / ckpt.STATE_NAME)
    with pytest.raises(ConfigError, match="no step of .* can be resumed .*step_6: trainer_state.pt is truncated"):
        main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.resume=auto", "train.max_steps=8")))
    assert all(ckpt.checkpoint_problem(out / s) is None for s in ("step_2", "step_4", "step_6"))  # weights kept


def test_eval_on_a_run_folder_skips_a_damaged_best_step(tiny_target, tiny_target_dir, tiny_prompt_file, tmp_path,
                                                        capsys):
    from draftlab.drafters.eagle import EagleHead

    model, _ = tiny_target
    run = tmp_path / "run"
    for step in (2, 4, 6):
        ckpt.save_drafter(EagleHead.from_target(model, None), run / f"step_{step}")
    (run / "best").write_text("step_4\n")
    truncate(run / "step_4" / ckpt.WEIGHTS_NAME)
    (run / "step_6" / ckpt.CONFIG_NAME).write_text('{"kind": "eag')  # torn too
    report = tmp_path / "report.json"
    capsys.readouterr()
    code = cli.main(["eval", "--checkpoint", str(run), "--target", tiny_target_dir, "--prompts", tiny_prompt_file,
                     "--out", str(report), "--max-new-tokens", "4", "--draft-length", "2", "--num-prompts", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert (f"checkpoint: skipped step_4: model.safetensors is truncated or corrupt (Error while deserializing "
            f"header: incomplete metadata, file not fully covered); step_6: drafter_config.json is corrupt") in err
    assert f"using {run / 'step_2'}" in err
    assert json.loads(report.read_text())["drafter"] == str(run / "step_2")

    truncate(run / "step_2" / ckpt.WEIGHTS_NAME)
    capsys.readouterr()
    code = cli.main(["eval", "--checkpoint", str(run), "--target", tiny_target_dir, "--prompts", tiny_prompt_file,
                     "--out", str(tmp_path / "r2.json")])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1 and f"{run} holds no loadable checkpoint (step_4:" in lines[0]
