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


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """cli.main in this process: (exit code, stderr); argparse errors exit through SystemExit."""
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


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
