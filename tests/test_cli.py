"""The `draftlab eval` command end to end, and its bad-input paths (one line, exit 2, nothing overwritten)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftlab.checkpoint import save_drafter
from draftlab.drafters.eagle import EagleHead


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "draftlab.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def head_checkpoint(tiny_target, tmp_path_factory):
    target, _ = tiny_target
    return str(save_drafter(EagleHead.from_target(target, None), tmp_path_factory.mktemp("ckpt") / "step_0"))


@pytest.fixture(scope="module")
def two_turn_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "mt.jsonl"
    rows = [{"id": i, "category": "writing" if i % 2 else "coding", "turns": [f"Write {i} words.", "Now shorter."]}
            for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_eval_checkpoint_both_turns_writes_report_table_and_plots(head_checkpoint, tiny_target_dir,
                                                                   two_turn_prompts, tmp_path):
    out = tmp_path / "report.json"
    proc = run_cli("eval", "--checkpoint", head_checkpoint, "--target", tiny_target_dir, "--prompts",
                   two_turn_prompts, "--out", str(out), "--max-new-tokens", "12", "--draft-length", "3",
                   "--turns", "both")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 6 and report["lossless"] is True
    assert 1.0 <= report["acceptance_length"] <= 4.0
    assert set(report["per_category"]) == {"coding/turn1", "writing/turn1", "coding/turn2", "writing/turn2"}
    assert out.with_suffix(".md").read_text().count("|") > 4
    assert (tmp_path / "report_per_position.png").is_file() and (tmp_path / "report_per_category.png").is_file()
    assert "tau" in proc.stdout


def test_eval_prompt_lookup_needs_no_checkpoint(tiny_target_dir, tiny_prompt_file, tmp_path):
    out = tmp_path / "pl.json"
    proc = run_cli("eval", "--proposer", "prompt_lookup", "--target", tiny_target_dir, "--prompts",
                   tiny_prompt_file, "--out", str(out), "--max-new-tokens", "12", "--num-prompts", "2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["drafter"] == "prompt_lookup" and report["lossless"] is True


@pytest.mark.parametrize("case", ["missing_checkpoint", "missing_prompts", "bad_prompts", "no_target", "bad_fixed_k",
                                  "bad_threshold", "auto_threshold_not_acceptance"])
def test_eval_bad_input_is_one_line(case, head_checkpoint, tiny_target_dir, tiny_prompt_file, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "messages": [{"role": "user", "content": "hi"}]}\n{not json\n')
    args = {"missing_checkpoint": ["--checkpoint", str(tmp_path / "nope"), "--prompts", tiny_prompt_file],
            "missing_prompts": ["--checkpoint", head_checkpoint, "--prompts", str(tmp_path / "nope.jsonl")],
            "bad_prompts": ["--checkpoint", head_checkpoint, "--prompts", str(bad)],
            "no_target": ["--proposer", "prompt_lookup", "--prompts", tiny_prompt_file],
            "bad_fixed_k": ["--checkpoint", head_checkpoint, "--prompts", tiny_prompt_file, "--fixed-k", "2,four"],
            "bad_threshold": ["--checkpoint", head_checkpoint, "--prompts", tiny_prompt_file,
                              "--adaptive-threshold", "high"],
            "auto_threshold_not_acceptance": ["--checkpoint", head_checkpoint, "--prompts", tiny_prompt_file,
                                              "--adaptive-threshold", "auto"]}[case]
    proc = run_cli("eval", *args, "--out", str(tmp_path / "r.json"), "--target", tiny_target_dir) \
        if case != "no_target" else run_cli("eval", *args, "--out", str(tmp_path / "r.json"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()


def test_unknown_command_and_help():
    assert run_cli("frobnicate").returncode == 2
    proc = run_cli("--help")
    assert proc.returncode == 0 and "draftlab eval" in proc.stdout
