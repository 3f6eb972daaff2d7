"""Bad inputs, second pass (issue 58): every output path of every command checked before any work, locked while it is
written and written atomically; resume as a contract with the run's recorded config; drafter keys that depend on the
target checked when its config.json is read; eval refusing what training refuses; help, signals and GGUF inputs.
Each case: a non-zero exit, exactly one line on stderr and no traceback, no input overwritten, no temporary left."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from draftlab import checkpoint as ckpt
from draftlab import cli, runlock
from test_bad_inputs import run_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def keep_thread_count():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    """Temporaries and locks a command may leave: none may be there after it."""
    return sorted(str(p) for p in Path(folder).rglob("*") if p.name.endswith((".draftlab-tmp", ".draftlab.lock",
                                                                                ".partial", ".tmp"))
                  or p.name.startswith(".draftlab-write-check-"))


def one_line(code: int, err: str, *words: str) -> str:
    """Exit code 2 and exactly one error line, no traceback (progress bars of a model load may come before it)."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("draftlab")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def cli_run(*args: str, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftlab.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def no_target_loads(monkeypatch):
    import draftlab.target

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the bad input was refused")

    monkeypatch.setattr(draftlab.target, "load_target", refuse)


def read_only(folder: Path, monkeypatch) -> None:
    """A folder this user cannot write to (root writes anywhere: its probe write is refused as a user's would be)."""
    if os.geteuid() == 0:
        real = tempfile.NamedTemporaryFile

        def refused(*a, dir=None, **k):
            if dir is not None and Path(dir).resolve() == folder.resolve():
                raise PermissionError(13, "Permission denied")
            return real(*a, dir=dir, **k)

        monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)
    else:
        folder.chmod(0o555)


@pytest.fixture
def run_folder(tiny_target, tmp_path) -> Path:
    from draftlab.drafters.eagle import EagleHead

    model, _ = tiny_target
    run = tmp_path / "run"
    ckpt.save_drafter(EagleHead.from_target(model, None), run / "step_2")
    return run


def eval_argv(run, target_dir, prompts, *options) -> list[str]:
    return ["eval", "--checkpoint", str(run), "--target", target_dir, "--prompts", str(prompts),
            "--max-new-tokens", "4", "--draft-length", "2", "--num-prompts", "1", *options]


# --- 1. outputs: checked before any work, locked, written atomically ---------------------------------------------

@pytest.mark.parametrize("case", ["out is the prompts", "log is the prompts", "out is the calibration prompts",
                                  "log is the report's table", "out is a folder", "log goes through a file",
                                  "out cannot be written"])
def test_eval_outputs_are_checked_before_anything_loads(run_folder, tiny_target_dir, tiny_prompt_file, tmp_path,
                                                        monkeypatch, capsys, case):
    no_target_loads(monkeypatch)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(Path(tiny_prompt_file).read_text())
    out, extra = tmp_path / "r.json", []
    afile, folder = tmp_path / "notes.txt", tmp_path / "reports"
    afile.write_text("kept\n")
    folder.mkdir()
    if case == "out is the prompts":
        out, words = prompts, [f"--out {prompts} is --prompts {prompts}, an input of this command"]
    elif case == "log is the prompts":
        extra, words = ["--log-rounds", str(prompts)], [f"--log-rounds {prompts} is --prompts", "an input"]
    elif case == "out is the calibration prompts":
        extra = ["--calibration-prompts", str(afile), "--draft-length", "auto", "--max-draft-length", "2"]
        words = [f"--out {afile} is --calibration-prompts {afile}"]
        out = afile
    elif case == "log is the report's table":
        extra, words = ["--log-rounds", str(tmp_path / "r.md")], ["--log-rounds", "is the report file --out table"]
    elif case == "out is a folder":
        out, words = folder, [f"--out {folder} is a folder"]
    elif case == "log goes through a file":
        extra, words = ["--log-rounds", str(afile / "rounds.jsonl")], [f"{afile} is a file, not a folder"]
    else:
        read_only(folder, monkeypatch)
        out, words = folder / "r.json", [f"{folder} cannot be written"]
    before = snapshot(tmp_path)
    code, err = run_main(eval_argv(run_folder, tiny_target_dir, prompts, "--out", str(out), *extra), capsys)
    one_line(code, err, *words)
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


HOLDER = textwrap.dedent("""
    import sys, time
    from draftlab.runlock import claim_outputs
    locks = claim_outputs([(sys.argv[1], sys.argv[2])])
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
    locks.release()
""")


def hold(option: str, path: Path) -> subprocess.Popen:
    """Another process writing `path` (it holds its output lock until `done(proc)`)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, option, str(path)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def done(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0


def test_a_second_writer_of_an_eval_output_is_refused_naming_the_first(run_folder, tiny_target_dir,
                                                                        tiny_prompt_file, tmp_path, monkeypatch,
                                                                        capsys):
    no_target_loads(monkeypatch)
    out, log = tmp_path / "r.json", tmp_path / "r.jsonl"
    out.write_text('{"kept": 1}\n')
    for option, path in (("--out", out), ("--log-rounds", log)):
        first = hold(option, path)
        try:
            code, err = run_main(eval_argv(run_folder, tiny_target_dir, tiny_prompt_file, "--out", str(out),
                                           "--log-rounds", str(log)), capsys)
            one_line(code, err, f"{option} {path} is in use by pid {first.pid}", f"choose another {option}")
        finally:
            done(first)
    assert out.read_text() == '{"kept": 1}\n' and not log.exists()


def test_eval_writes_its_report_and_round_log_whole_and_leaves_nothing_else(run_folder, tiny_target_dir,
                                                                            tiny_prompt_file, tmp_path, capsys):
    out, log = tmp_path / "r.json", tmp_path / "r.jsonl"
    code, err = run_main(eval_argv(run_folder, tiny_target_dir, tiny_prompt_file, "--out", str(out),
                                   "--log-rounds", str(log)), capsys)
    assert code == 0, err[-3000:]
    assert json.loads(out.read_text())["round_log"]["rows"] == len(log.read_text().splitlines()) > 0
    assert leftovers(tmp_path) == []


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno

    from draftlab.errors import DiskFullError
    from draftlab.report import write_report
    from draftlab.rounds import RoundLog

    report = tmp_path / "r.json"
    report.write_text('{"old": 1}\n')
    real = Path.write_text

    def full(self, text, *a, **k):
        real(self, text[:5], *a, **k)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(DiskFullError) as err:
        write_report({"new": 1}, report)
    monkeypatch.setattr(Path, "write_text", real)
    assert str(err.value).startswith(f"no space left on device writing report {report} (")
    assert "\n" not in str(err.value) and report.read_text() == '{"old": 1}\n' and leftovers(tmp_path) == []

    log = RoundLog(tmp_path / "rounds.jsonl", atomic=True)

    class Full:
        closed = False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.closed = True

    from dataclasses import fields

    from draftlab.rounds import Round

    log.file.close()
    log.file = Full()
    with pytest.raises(DiskFullError) as err:
        log.write(Round(**{f.name: None for f in fields(Round)}))
    assert str(err.value).startswith(f"no space left on device writing round log {tmp_path / 'rounds.jsonl'} (")
    assert "partial rounds.jsonl.partial was removed" in str(err.value) and leftovers(tmp_path) == []


@pytest.mark.parametrize("case", ["out is a file", "out cannot be written", "lr below zero", "out is the log",
                                  "out is locked"])
def test_disco_refuses_bad_outputs_and_options_before_training(tmp_path, monkeypatch, capsys, case):
    import draftlab.disco as disco

    def no_training(*a, **k):
        raise AssertionError("the classifier was trained before the bad input was refused")

    monkeypatch.setattr(disco, "train_classifier", no_training)
    log = tmp_path / "rounds.jsonl"
    log.write_text("{}\n")
    afile, folder = tmp_path / "notes.txt", tmp_path / "ro"
    afile.write_text("kept\n")
    folder.mkdir()
    out, extra, first = tmp_path / "c", [], None
    before = snapshot(tmp_path)
    if case == "out is a file":
        out, words = afile, [f"--out {afile} is a file, not a folder"]
    elif case == "out cannot be written":
        read_only(folder, monkeypatch)
        out, words = folder / "c", [f"{folder} cannot be written"]
    elif case == "lr below zero":
        extra, words = ["--lr", "-1"], ["--lr -1.0", "above 0"]
    elif case == "out is the log":
        out, words = log, [f"--out {log} is --rounds {log}, an input"]
    else:
        first, words = hold("--out", out), [f"--out {out} is in use by pid"]
    try:
        code, err = run_main(["disco", "--rounds", str(log), "--out", str(out), *extra], capsys)
    finally:
        if first is not None:
            done(first)
    line = one_line(code, err, *words)
    if first is not None:
        assert f"pid {first.pid}" in line
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("case", ["out is a file", "out cannot be written", "out is the held-out prompts"])
def test_serve_learn_refuses_bad_outputs_before_anything_loads(run_folder, tiny_prompt_file, tmp_path, monkeypatch,
                                                               capsys, case):
    no_target_loads(monkeypatch)
    log, heldout = tmp_path / "rounds.jsonl", tmp_path / "heldout.jsonl"
    log.write_text("")
    heldout.write_text(Path(tiny_prompt_file).read_text())
    afile, folder = tmp_path / "notes.txt", tmp_path / "ro"
    afile.write_text("kept\n")
    folder.mkdir()
    if case == "out is a file":
        out, words = afile, [f"--out {afile} is a file, not a folder"]
    elif case == "out cannot be written":
        read_only(folder, monkeypatch)
        out, words = folder / "learned", [f"{folder} cannot be written"]
    else:
        out, words = heldout, [f"--out {heldout} is --heldout {heldout}, an input"]
    before = snapshot(tmp_path)
    code, err = run_main(["serve-learn", "--checkpoint", str(run_folder), "--rounds", str(log), "--heldout",
                          str(heldout), "--out", str(out)], capsys)
    one_line(code, err, *words)
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("case", ["to is the checkpoint", "to holds the checkpoint", "to is a file",
                                  "to cannot be written", "to is locked"])
def test_push_refuses_bad_export_folders_before_writing(run_folder, tiny_target_dir, tmp_path, monkeypatch, capsys,
                                                        case):
    no_target_loads(monkeypatch)
    afile, folder = tmp_path / "notes.txt", tmp_path / "ro"
    afile.write_text("kept\n")
    folder.mkdir()
    checkpoint, first = run_folder / "step_2", None
    before = snapshot(tmp_path)
    if case == "to is the checkpoint":
        to, words = checkpoint, [f"--to {checkpoint} is the checkpoint {checkpoint}, an input"]
    elif case == "to holds the checkpoint":
        to, words = tmp_path, [f"--to {tmp_path} holds the checkpoint {checkpoint}", "replaces that folder whole"]
    elif case == "to is a file":
        to, words = afile, [f"--to {afile} is a file, not a folder"]
    elif case == "to cannot be written":
        read_only(folder, monkeypatch)
        to, words = folder / "export", [f"{folder} cannot be written"]
    else:
        to = tmp_path / "export"
        first, words = hold("--to", to), [f"--to {to} is in use by pid"]
    try:
        code, err = run_main(["push", str(checkpoint), "--to", str(to), "--target", tiny_target_dir], capsys)
    finally:
        if first is not None:
            done(first)
    line = one_line(code, err, *words)
    if first is not None:
        assert f"pid {first.pid}" in line
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


# --- 2. resume is a contract with the run's recorded config.yaml ---------------------------------------------------

@pytest.fixture(scope="module")
def two_step_run(tiny_target_dir, tiny_chat_file, tmp_path_factory) -> Path:
    """A run of 2 steps (step_2 saved), to resume."""
    from test_resume import args

    from draftlab.config import load_config
    from draftlab.train import main

    out = tmp_path_factory.mktemp("resume") / "run"
    main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.max_steps=2")))
    return out


def copy_run(run: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("changes, words", [
    (["drafter.feature_noise=0.5"], ["drafter.feature_noise 0.2 (now 0.5)", "this key shapes"]),
    (["recipe=medusa_heads"], ["drafter.kind 'eagle' (now 'medusa')"]),
    (["target.path={other}"], ["target.path '{target}' (now '{other}')"]),
    (["data.max_length=64", "seed=3"], ["data.max_length 96 (now 64)", "seed 0 (now 3)", "these keys shape"]),
])
def test_resume_refuses_a_change_to_what_shapes_the_run(two_step_run, tiny_target_dir, tiny_chat_file, tmp_path,
                                                        monkeypatch, capsys, changes, words):
    from test_resume import args

    from draftlab.train import cli as train_cli

    no_target_loads(monkeypatch)
    run = copy_run(two_step_run, tmp_path)
    before = snapshot(run)
    other = tmp_path / "other_target"
    fill = {"other": str(other), "target": tiny_target_dir}
    overrides = args(tiny_target_dir, tiny_chat_file, run, "train.max_steps=4", "train.resume=auto")
    overrides += [c.format(**fill) for c in changes]
    if changes[0].startswith("recipe="):  # another recipe, the same other arguments: another kind
        overrides = [a for a in overrides[1:] if not a.startswith("drafter.")]
    capsys.readouterr()
    for entry in (train_cli, lambda a: train_cli(["--check", *a])):   # training, and launch.sh's check first
        code = entry(overrides)
        line = one_line(code, capsys.readouterr().err, *(w.format(**fill) for w in words))
        assert f"start a new run with another out_dir (e.g. out_dir={run}_new" in line
        assert f"resume with the values in {run / 'config.yaml'}" in line
    assert snapshot(run) == before and leftovers(run) == []


def test_resume_applies_and_records_the_keys_that_may_change(two_step_run, tiny_target_dir, tiny_chat_file,
                                                               tmp_path, capsys):
    from test_resume import args

    from draftlab.config import load_saved
    from draftlab.train import cli as train_cli

    run = copy_run(two_step_run, tmp_path)
    capsys.readouterr()
    code = train_cli(args(tiny_target_dir, tiny_chat_file, run, "train.max_steps=4", "train.resume=auto",
                          "train.lr=5e-3", "train.schedule=constant", "train.warmup_steps=0"))
    out = capsys.readouterr().out
    assert code == 0
    assert (f"resume: applied train.lr 0.002 (now 0.005), train.max_steps 2 (now 4), train.schedule 'cosine' (now "
            f"'constant'), train.warmup_steps 2 (now 0); recorded in {run / 'config.yaml'}") in out, out
    saved = load_saved(run / "config.yaml")
    assert (saved.train.lr, saved.train.max_steps, saved.train.schedule, saved.train.resume) == (5e-3, 4, "constant",
                                                                                                 "")
    state = ckpt.load_trainer_state(run / "step_4")
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == [5e-3] * len(state["optimizer"]["param_groups"])


# --- 3. drafter keys: ranges with the config, target-dependent ids when config.json is read -----------------------

@pytest.fixture(scope="module")
def four_layer_target_dir(tiny_target_4_layers, tmp_path_factory) -> str:
    model, tok = tiny_target_4_layers
    path = tmp_path_factory.mktemp("tiny_target_4")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("recipe, keys, words", [
    ("dflash_head", ["drafter.num_anchors=0"], ["'drafter.num_anchors' is 0", "at least 1"]),
    ("dflash_head", ["drafter.block_size=1"], ["'drafter.block_size' is 1"]),
    ("dflash_head", ["drafter.target_layers=[0,9]"], ["drafter.target_layers=[0, 9]", "4 decoder layers", "0..2"]),
    ("dflash_head", ["drafter.target_layers=[-1,2]"], ["'drafter.target_layers' is [-1, 2]", "not a layer id"]),
    ("dflash_head", ["drafter.mask_token_id=999999"], ["drafter.mask_token_id=999999 is not a token of the target"]),
    ("dflash_head", ["drafter.mask_token_id=-5"], ["'drafter.mask_token_id' is -5"]),
    ("dflash_head", ["eval.tree=dynamic", "eval.depth=20"], ["eval.depth=20 exceeds the 15 tokens a DFlash block"]),
    ("eagle3_head", ["drafter.aux_layers=[0,1,17]"], ["drafter.aux_layers=[0, 1, 17]", "[17] outside the target's 4"]),
    ("eagle3_head", ["drafter.aux_layers=[2]"], ["'drafter.aux_layers' is [2]", "at least 2 different"]),
    ("eagle3_head", ["drafter.draft_vocab_size=100000"], ["drafter.draft_vocab_size=100000 is above the target's "
                                                          "vocabulary"]),
    ("distill_layer_skip", ["drafter.target_layers=[0,7]"], ["drafter.target_layers [0, 7]", "[7] outside"]),
    ("eagle_head", ["target.device=cuda"], ["target.device cuda: this machine has no CUDA device"]),
])
def test_drafter_keys_are_refused_before_the_target_loads(recipe, keys, words, four_layer_target_dir, tiny_chat_file,
                                                          tiny_prompt_file, tmp_path, monkeypatch, capsys):
    if "cuda" in keys[0] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from draftlab.train import cli as train_cli

    no_target_loads(monkeypatch)
    out = tmp_path / "run"
    overrides = [f"recipe={recipe}", f"target.path={four_layer_target_dir}", f"data.train={tiny_chat_file}",
                 f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}", "data.regenerate_from=''", *keys]
    for argv in (overrides, ["--check", *overrides]):   # training, and launch.sh's check before any process starts
        capsys.readouterr()
        one_line(train_cli(argv), capsys.readouterr().err, *words)
    assert not out.exists()


@pytest.fixture(scope="module")
def dflash_step(tiny_target, tmp_path_factory) -> Path:
    """A DFlash checkpoint with blocks of 8 (7 draft tokens per block)."""
    from types import SimpleNamespace

    from draftlab.drafters import DRAFTERS

    model, _ = tiny_target
    drafter = DRAFTERS["dflash"].from_target(model, SimpleNamespace(block_size=8, num_layers=1))
    return ckpt.save_drafter(drafter, tmp_path_factory.mktemp("dflash") / "step_0")


@pytest.mark.parametrize("options, words", [
    (["--draft-length", "8"], ["--draft-length 8 exceeds the 7 tokens a DFlash block of 8 drafts", "drafter.block_size=8"]),
    (["--tree", "dynamic", "--depth", "9"], ["--depth 9 exceeds the 7 tokens"]),
])
def test_eval_refuses_what_training_refuses(dflash_step, tiny_target_dir, tiny_prompt_file, tmp_path, monkeypatch,
                                            capsys, options, words):
    no_target_loads(monkeypatch)
    code, err = run_main(["eval", "--checkpoint", str(dflash_step), "--target", tiny_target_dir, "--prompts",
                          tiny_prompt_file, "--out", str(tmp_path / "r.json"), *options], capsys)
    one_line(code, err, *words)
    assert list(tmp_path.iterdir()) == []


def test_eval_on_a_device_this_machine_lacks_is_one_line(tiny_target_dir, tiny_prompt_file, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = cli_run("eval", "--proposer", "prompt_lookup", "--target", tiny_target_dir, "--prompts", tiny_prompt_file,
                   "--out", str(tmp_path / "r.json"), "--device", "cuda")
    one_line(proc.returncode, proc.stderr, "--device cuda: this machine has no CUDA device", "use cpu or auto")
    assert list(tmp_path.iterdir()) == []


def test_recipes_show_checks_ranges(capsys):
    code, err = run_main(["recipes", "--show", "dflash_head", "drafter.num_anchors=0"], capsys)
    one_line(code, err, "'drafter.num_anchors' is 0")


# --- 4. help, signals, inputs from elsewhere -----------------------------------------------------------------------

def test_train_help_prints_help():
    proc = cli_run("train", "--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: draftlab train recipe=NAME") and "train.resume=auto" in proc.stdout
    assert "drafter.block_size=16" in proc.stdout and "train.lr=0.0001" in proc.stdout


@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_eval_stopped_by_a_signal_says_what_it_kept(run_folder, tiny_target_dir, tiny_prompt_file, tmp_path,
                                                   signame, code):
    import signal

    out, log = tmp_path / "r.json", tmp_path / "r.jsonl"
    partial = tmp_path / "r.jsonl.partial"
    proc = subprocess.Popen([sys.executable, "-m", "draftlab.cli", "eval", "--checkpoint", str(run_folder),
                             "--target", tiny_target_dir, "--prompts", tiny_prompt_file, "--out", str(out),
                             "--log-rounds", str(log), "--max-new-tokens", "400", "--repeats", "3"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    import time

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.is_file() and partial.read_text().count("\n") >= 2:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    proc.send_signal(getattr(signal, signame))
    stdout, stderr = proc.communicate(timeout=120)
    line = one_line(2, stderr)  # exactly one line, no traceback
    assert proc.returncode == code, stderr[-3000:]
    assert line.startswith(f"draftlab: interrupted ({signame}): no report was written ({out} is as it was); the "
                           "round log of the "), line
    assert f"prompt(s) decoded so far is kept as {partial} (" in line and "a rerun replaces it" in line
    assert not out.exists() and not log.exists() and partial.is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".draftlab.lock", ".draftlab-tmp"))]


@pytest.fixture
def gguf_files(tmp_path) -> dict:
    import gguf

    def write(name: str, hidden: int, layers: int, vocab: int) -> Path:
        path = tmp_path / name
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_embedding_length(hidden)
        writer.add_block_count(layers)
        writer.add_vocab_size(vocab)
        writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    import numpy as np

    text = tmp_path / "target.gguf"
    text.write_text("hello\n")
    return {"text": text, "wide": write("wide.gguf", 999, 2, 100), "dir": tmp_path}


@pytest.mark.parametrize("which, words", [
    ("text", ["--target-gguf", "is not a GGUF file (it does not start with GGUF's magic bytes)"]),
    ("wide", ["is not a GGUF of the target this checkpoint was trained for", "hidden_size 999 (the checkpoint's "
                                                                             "target: 64)"]),
])
def test_push_gguf_refuses_a_target_gguf_of_another_model_before_converting(run_folder, gguf_files, tmp_path,
                                                                           capsys, which, words):
    export = tmp_path / "export"
    before = snapshot(tmp_path)
    code, err = run_main(["push", str(run_folder), "--format", "gguf", "--target-gguf", str(gguf_files[which]),
                          "--to", str(export)], capsys)
    one_line(code, err, *words)
    assert snapshot(tmp_path) == before and not export.exists() and leftovers(tmp_path) == []


def test_a_damaged_disco_classifier_is_one_line_before_anything_loads(run_folder, tiny_target_dir, tiny_prompt_file,
                                                                      tmp_path, monkeypatch, capsys):
    from draftlab import disco

    no_target_loads(monkeypatch)
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / disco.CONFIG_NAME).write_text(json.dumps({"format": "draftlab.disco", "version": disco.FORMAT_VERSION,
                                                        "features": list(disco.FEATURES), "hidden": 8, "layers": 1}))
    (folder / disco.WEIGHTS_NAME).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": cut off")
    code, err = run_main(eval_argv(run_folder, tiny_target_dir, tiny_prompt_file, "--out", str(tmp_path / "r.json"),
                                   "--draft-length", "disco", "--max-draft-length", "3", "--disco", str(folder)), capsys)
    one_line(code, err, f"--disco {folder}: {folder / disco.WEIGHTS_NAME} cannot be loaded", "train it again")
    assert not (tmp_path / "r.json").exists() and leftovers(tmp_path) == []


def test_an_export_is_readable_like_any_new_file_and_leaves_no_lock(run_folder, tiny_target_dir, tmp_path, capsys):
    export = tmp_path / "export"
    code, err = run_main(["push", str(run_folder), "--to", str(export), "--target", tiny_target_dir], capsys)
    assert code == 0, err[-3000:]
    umask = os.umask(0)
    os.umask(umask)
    files = [p for p in export.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    assert all(p.stat().st_mode & 0o777 == 0o666 & ~umask for p in files), [(p, oct(p.stat().st_mode)) for p in files]
    assert leftovers(tmp_path) == []


def test_engine_help_and_an_unusable_build_folder(tmp_path, capsys, monkeypatch):
    """`draftlab engine --help` prints the usage; a llama.cpp cache root that is a file is one line, exit 2, before
    anything downloads or compiles."""
    capsys.readouterr()
    assert cli.main(["engine", "--help"]) == 0
    assert "draftlab engine build" in capsys.readouterr().out
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("DRAFTLAB_LLAMA_CPP_CACHE", str(tmp_path / "cache"))
    from draftlab import llama_cpp_tools

    monkeypatch.setattr(llama_cpp_tools, "missing_build_tools", lambda: "")
    code, err = run_main(["engine", "build"], capsys)
    assert "DRAFTLAB_LLAMA_CPP_CACHE" in one_line(code, err)
    assert (tmp_path / "cache").read_text() == "not a folder"
