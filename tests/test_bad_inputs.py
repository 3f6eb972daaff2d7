"""Bad inputs, one table per entry point: each gives one line that names the problem and exit code 2, before any
model loads or anything is written (config keys, `draftlab eval` / `push` options, recipe YAML, data rows,
launch.sh)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from draftlab import cli
from draftlab.config import RANGES, ConfigError, RunConfig, load_config
from draftlab.data import ChatDataset, DataError, load_prompts, read_conversations
from draftlab.drafters import CONFIGS

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ["recipe=eagle_head", "target.path=/x", "data.train=/x.jsonl", "data.eval_prompts=/p.jsonl"]


def with_required(args: list[str]) -> list[str]:
    """REQUIRED + args; a drafter key is set on a kind that has it (the first in CONFIGS), not on eagle_head."""
    keys = [a.split("=", 1)[0] for a in args]
    mine = [k.split(".", 1)[1] for k in keys if k.startswith("drafter.") and k != "drafter.kind"]
    if "drafter.kind" in keys:
        return [*REQUIRED[1:], *args]
    if not mine:
        return [*REQUIRED, *args]
    kind = next(k for k, c in CONFIGS.items() if mine[0] in {f.name for f in fields(c)})
    return [*REQUIRED[1:], f"drafter.kind={kind}", *(["drafter.base=/b"] if kind == "acceptance" else []), *args]


def config_error(args: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(args)
    message = str(err.value)
    assert "\n" not in message
    return message


# --- config keys -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["train=3"], ["override train=3", "'train' is a section", "train.max_steps="]),
    (["train=null"], ["'train' is a section"]),
    (["eval=[1,2]"], ["'eval' is a section", "eval.every="]),
    (["seed=-1"], ["'seed' is -1", "[0, 4294967295]"]),
    (["train.log_every=0"], ["'train.log_every' is 0", "at least 1"]),
    (["train.lr=-0.1"], ["'train.lr'", "not be negative"]),
    (["train.lr=inf"], ["'train.lr' is inf", "finite"]),
    (["eval.temperature=nan"], ["'eval.temperature' is nan", "finite"]),
    (["train.adam_beta2=1.0"], ["'train.adam_beta2'", "[0, 1)"]),
    (["drafter.ttt_decay=0"], ["'drafter.ttt_decay'", "(0, 1]"]),
    (["drafter.distill_temperature=0"], ["'drafter.distill_temperature'", "> 0"]),
    (["drafter.adaptive_threshold=1.5"], ["'drafter.adaptive_threshold'", "[0, 1]"]),
    (["drafter.draft_vocab_size=-2"], ["'drafter.draft_vocab_size'", "at least -1"]),
    (["hub.repo_id=me/bad--name"], ["hub.repo_id", "'me/bad--name'", "not a Hub model id"]),
    (["hub.repo_id=me/name.git"], ["hub.repo_id", "not a Hub model id"]),
    (["hub.repo_id=datasets/me/x"], ["hub.repo_id", "dataset repository"]),
    (["drafter.kind=medusa2", "drafter.lora_r=0"], ["'drafter.lora_r' is 0", "medusa2"]),
    (["eval.tree=dynamic", "eval.auto_draft_length=true"], ["eval.auto_draft_length=true", "eval.tree=chain"]),
    (["eval.calibration_prompts=0"], ["'eval.calibration_prompts' is 0", "at least 1"]),
])
def test_config_values_out_of_range(args, words):
    message = config_error(with_required(args))
    for word in words:
        assert word in message, (word, message)


def _field_type(key: str):
    node = RunConfig
    *sections, name = key.split(".")
    if sections == ["drafter"]:
        return next({f.name: f for f in fields(c)}[name].type for c in CONFIGS.values()
                    if name in {f.name for f in fields(c)})
    for part in sections:
        node = {f.name: f for f in fields(node)}[part].default_factory
    return {f.name: f for f in fields(node)}[name].type


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_ranged_key_refuses_a_value_outside_its_range(key):
    """Each numeric key, just outside its interval (below the low end, or at an open low end), is refused by name."""
    interval = RANGES[key]
    low = float(interval[1:-1].split(",")[0])
    bad = low if interval[0] == "(" else low - 1
    value = int(bad) if _field_type(key) in ("int", int) else bad
    message = config_error(with_required([f"{key}={value}"]))
    assert f"'{key}' is {value}" in message


def test_recipe_yaml_errors_keep_line_and_column(tmp_path):
    syntax = tmp_path / "syntax.yaml"
    syntax.write_text("train:\n  lr: 1\n lr2: 3\n")
    message = config_error([f"recipe={syntax}"])
    assert f"{syntax}:3:2:" in message and "did not find expected key" in message
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("train:\n  schedule: caf\xe9\n".encode("latin-1"))
    message = config_error([f"recipe={latin1}"])
    assert f"{latin1}:2:16:" in message and "not valid UTF-8" in message and "0xe9" in message
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("defaults: [eagle_head]\ntrain:\n")  # an empty section would wipe all its defaults
    assert "'train' is a section" in config_error([f"recipe={scalar}"])


# --- draftlab eval / push options ------------------------------------------------------------------------------

def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """cli.main in this process: (exit code, stderr); argparse errors exit through SystemExit."""
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, *words: str) -> None:
    """Exit code 2 and one error line (progress bars of a model load may come before it)."""
    lines = [line for line in err.splitlines() if line.startswith("draftlab")]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])


EVAL = ["eval", "--checkpoint", "/no/such/run", "--prompts", "/no/such.jsonl"]


@pytest.mark.parametrize("options, words", [
    (["--temperature", "-1"], ["--temperature is -1.0", "not be negative"]),
    (["--temperature", "nan"], ["--temperature is nan", "finite"]),
    (["--top-p", "0"], ["--top-p is 0.0", "(0, 1]"]),
    (["--top-p", "1.5"], ["--top-p is 1.5", "(0, 1]"]),
    (["--draft-length", "0"], ["--draft-length is 0", "at least 1"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens is 0"]),
    (["--draft-length", "9", "--max-new-tokens", "4"], ["--draft-length 9 is above --max-new-tokens 4"]),
    (["--tree", "dynamic", "--depth", "0"], ["--depth is 0"]),
    (["--tree", "dynamic", "--depth", "9", "--max-new-tokens", "4"], ["--depth 9 is above --max-new-tokens 4"]),
    (["--tree", "dynamic", "--top-k", "0"], ["--top-k is 0"]),
    (["--tree", "dynamic", "--total-tokens", "0"], ["--total-tokens is 0"]),
    (["--sampling-top-k", "-1"], ["--sampling-top-k is -1"]),
    (["--num-prompts", "0"], ["--num-prompts is 0"]),
    (["--seed", "-3"], ["--seed is -3"]),
    (["--adaptive-threshold", "2"], ["--adaptive-threshold is 2.0", "[0, 1]"]),
    (["--min-draft", "0"], ["--min-draft is 0"]),
    (["--fixed-k", "2,200"], ["--fixed-k 200 is above --max-new-tokens 128"]),
    (["--temperature", "warm"], ["draftlab eval: error:", "invalid float value: 'warm'", "--help"]),
    (["--tree", "forest"], ["draftlab eval: error:", "invalid choice"]),
])
def test_eval_options_out_of_range(options, words, capsys, tmp_path):
    code, err = run_main([*EVAL, "--out", str(tmp_path / "r.json"), *options], capsys)
    assert_one_line(code, err, *words)
    assert not (tmp_path / "r.json").exists()


def test_eval_top_k_above_the_vocabulary(tiny_target_dir, tiny_prompt_file, capsys, tmp_path):
    code, err = run_main(["eval", "--proposer", "prompt_lookup", "--target", tiny_target_dir, "--prompts",
                          tiny_prompt_file, "--out", str(tmp_path / "r.json"), "--sampling-top-k", "100000"], capsys)
    assert_one_line(code, err, "--sampling-top-k 100000 is above the target's vocabulary size")


@pytest.fixture(scope="module")
def head_checkpoint(tiny_target, tmp_path_factory):
    from draftlab.checkpoint import save_drafter
    from draftlab.drafters.eagle import EagleHead

    target, _ = tiny_target
    return str(save_drafter(EagleHead.from_target(target, None), tmp_path_factory.mktemp("ckpt") / "step_0"))


@pytest.mark.parametrize("options, words", [
    (["--repo-id", "me/bad--name"], ["--repo-id 'me/bad--name' is not a Hub model id"]),
    (["--repo-id", "me/-lead"], ["not a Hub model id"]),
    (["--repo-id", "me/" + "x" * 97], ["not a Hub model id"]),
    (["--repo-id", "spaces/me/x"], ["space repository"]),
    (["--repo-id", "me/ok", "--base-model", "not an id"], ["--base-model not an id is neither a Hub model id"]),
    (["--repo-id", "me/ok", "--revision", "my branch"], ["--revision 'my branch' is not a valid branch name"]),
    (["--repo-id", "me/ok", "--revision", "a..b"], ["--revision 'a..b'"]),
    (["--format", "onnx", "--to", "/tmp/x"], ["draftlab push: error:", "invalid choice"]),
    # an EAGLE-1 head has no GGUF form in llama.cpp: refused before anything is written
    (["--format", "gguf", "--to", "/tmp/x"], ["--format gguf: llama.cpp serves no 'eagle' drafter exactly",
                                              "nothing was written"]),
])
def test_push_options_the_hub_would_reject(options, words, head_checkpoint, capsys):
    code, err = run_main(["push", head_checkpoint, *options], capsys)
    assert_one_line(code, err, *words)


def test_push_to_a_folder_that_is_not_an_export_is_refused(head_checkpoint, tiny_target_dir, capsys, tmp_path):
    mine = tmp_path / "my_notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, err = run_main(["push", head_checkpoint, "--to", str(mine), "--target", tiny_target_dir], capsys)
    assert_one_line(code, err, f"export folder {mine} already exists and is not a draftlab export")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"


# --- data rows ---------------------------------------------------------------------------------------------------

def test_a_row_that_is_not_utf8_is_a_bad_row(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(good.encode() + b"\n" + good.encode()[:-9] + b"caf\xe9\"}]}\n" + good.encode() + b"\n")
    convs, stats = read_conversations(str(path))
    assert len(convs) == 2 and stats.rows == 3
    assert stats.malformed == [(f"{path}:2", stats.malformed[0][1])] and "not valid UTF-8" in stats.malformed[0][1]
    assert f"{path}:2" in str(stats)
    with pytest.raises(DataError, match=f"{path}:2: not valid UTF-8"):
        read_conversations(str(path), strict=True)
    # a JSON list: the row holding the bad bytes is the bad one
    listed = tmp_path / "list.json"
    listed.write_bytes(b"[" + good.encode() + b", " + good.encode()[:-9] + b"caf\xe9\"}]}]")
    convs, stats = read_conversations(str(listed))
    assert len(convs) == 1 and stats.malformed[0][0] == f"{listed}[1]" and "UTF-8" in stats.malformed[0][1]
    # a prompt file names the line
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=f"{prompts}:2: not valid UTF-8"):
        load_prompts(str(prompts))


def test_rows_dropped_for_length_are_counted_with_their_reason(tiny_tokenizer):
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    long_prompt = [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]
    ds = ChatDataset([short, long_prompt, long_prompt], tiny_tokenizer, max_length=40)
    assert len(ds) == 1
    summary = ds.summary()
    assert "2 of 3 conversations dropped (2 because the prompt alone exceeds data.max_length=40 tokens)" in summary
    cut = ChatDataset([short], tiny_tokenizer, max_length=len(ChatDataset([short], tiny_tokenizer, None)[0]
                                                              ["input_ids"]) - 1)
    assert len(cut) == 1 and "1 cut at data.max_length" in cut.summary() and "dropped" not in cut.summary()
    assert ChatDataset([short], tiny_tokenizer, None).summary() == ""


def test_training_data_all_too_long_says_so(tiny_target_dir, tmp_path, capsys):
    from draftlab.train import cli as train_cli

    data = tmp_path / "long.jsonl"
    row = {"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]}
    data.write_text(json.dumps(row) + "\n")
    capsys.readouterr()
    code = train_cli(["recipe=eagle_head", f"target.path={tiny_target_dir}", f"data.train={data}",
                      f"out_dir={tmp_path / 'run'}", "eval.every=0", "data.max_length=16", "train.max_steps=1"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("draftlab:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "the prompt alone exceeds data.max_length=16 tokens" in lines[0] and "raise data.max_length" in lines[0]
    assert not (tmp_path / "run").exists()  # a start refused before writing leaves nothing behind


# --- launch.sh: the configuration is checked before the launcher starts ----------------------------------------

def launch(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str] | None]:
    """launch.sh with a Python that records the `accelerate launch` it is asked to run (launch.sh runs it as
    `python -m draftlab.launcher ARGS`) and runs everything else, the check before the launch included:
    (result, ["launch", *ARGS] or None)."""
    bin_dir, record = tmp_path / "bin", tmp_path / "accelerate_args"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = draftlab.launcher ]; then\n  shift 2\n'
                    f'  printf "%s\\n" launch "$@" > {record}\n  exit 0\nfi\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    record.unlink(missing_ok=True)
    clean = {k: v for k, v in os.environ.items() if k not in ("GPUS_PER_NODE", "NNODES", "NODE_RANK", "ACCEL_CONFIG")}
    proc = subprocess.run(["bash", str(ROOT / "launch.sh"), *args], capture_output=True, text=True, timeout=300,
                          env={**clean, "GPUS_PER_NODE": "1", "PYTHON": str(fake), **env})
    return proc, record.read_text().splitlines() if record.exists() else None


def test_launch_checks_the_config_and_the_run_folder_before_starting(tmp_path):
    from draftlab import runtime

    out = tmp_path / "run"
    good = ["recipe=eagle_head", "target.path=/x", "data.train=/x.jsonl", "eval.every=0", f"out_dir={out}"]
    proc, started = launch(tmp_path, *good, "train.lrr=1")
    assert started is None and proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "train.lrr" in proc.stderr

    with runtime.run_lock(out):  # a run already writes there: refused on node 0, naming this process
        proc, started = launch(tmp_path, *good)
        assert started is None and proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and f"pid {os.getpid()}" in proc.stderr
        proc, started = launch(tmp_path, *good, NNODES="2", NODE_RANK="1")  # other nodes check the config only
        assert proc.returncode == 0 and started is not None, proc.stderr
    proc, started = launch(tmp_path, *good)
    assert proc.returncode == 0 and started[:1] == ["launch"] and started[-1] == f"out_dir={out}", proc.stderr
