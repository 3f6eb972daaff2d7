"""Smoke test of bench/cpu_smollm2.py on the tiny target: a tiny budget for the eagle kind and prompt lookup."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT_KEYS = {"acceptance_length", "acceptance_length_per_sample", "per_position_acceptance", "rounds",
               "new_tokens", "target_forwards", "draft_length", "temperature", "lossless", "tokens_per_second",
               "baseline_tokens_per_second", "speedup", "num_prompts",
               "drafter", "tree", "prompt_set", "train_seconds", "train_tokens_per_second", "peak_rss_mb"}


def load_bench():
    spec = importlib.util.spec_from_file_location("cpu_smollm2", ROOT / "bench" / "cpu_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_on_tiny_target(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path, capsys):
    bench = load_bench()
    out = tmp_path / "results" / "bench.json"
    argv = ["--target", tiny_target_dir, "--answers", tiny_chat_file, "--mtbench", tiny_prompt_file,
            "--humaneval", tiny_prompt_file, "--out", str(out), "--kinds", "eagle", "--steps", "2",
            "--batch-size", "2", "--max-length", "256", "--num-prompts", "2", "--max-new-tokens", "6",
            "--inloop-evals", "1", "--inloop-prompts", "1", "--inloop-max-new-tokens", "4", "--threads", "1"]
    result = bench.main(argv)

    rows = json.loads(out.read_text())["rows"]
    assert {(r["drafter"], r["tree"], r["prompt_set"]) for r in rows} == {
        ("prompt_lookup", "chain", "mtbench"), ("prompt_lookup", "chain", "humaneval"),
        ("eagle", "chain", "mtbench"), ("eagle", "chain", "humaneval"),
        ("eagle", "dynamic", "mtbench"), ("eagle", "dynamic", "humaneval")}
    for r in rows:
        assert REPORT_KEYS <= set(r), REPORT_KEYS - set(r)
        assert 1 <= r["acceptance_length"] <= r["draft_length"] + 1
        assert r["lossless"] is True                       # greedy speculation reproduces the target
        assert r["peak_rss_mb"] > 0
        assert (r["train_seconds"] is None) == (r["drafter"] == "prompt_lookup")
    header = result["header"]
    assert header["budget"]["steps"] == 2 and header["budget"]["batch_size"] == 2
    assert 0 < header["in_loop_eval"]["share"] < 1          # the eagle run had in-loop evaluation on
    assert {g["goal"].split(",")[0] for g in header["goals"]} >= {"EAGLE head tau", "in-loop evaluation share of "
                                                                  "training time"}
    assert out.with_suffix(".md").is_file()
    assert (out.parent / "bench_tau.png").is_file() and (out.parent / "bench_speedup.png").is_file()

    # a rerun reuses the cached checkpoint, baselines and evaluations: same figures, nothing retrained
    capsys.readouterr()
    again = bench.main(argv)
    log = capsys.readouterr().out
    assert "eagle: cached" in log and "training from recipe" not in log
    assert all(r["from_cache"] for r in again["rows"])
    assert [r["acceptance_length"] for r in again["rows"]] == [r["acceptance_length"] for r in rows]
