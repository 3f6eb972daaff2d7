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


def test_llama_cpp_serving_resumes_from_its_journal(tmp_path, monkeypatch):
    """bench/llama_cpp_serving.py journals every decoded prompt (all its rows); the same rows run again after an
    interruption decode only the prompts missing from the journal (a line cut short counts as missing) and give the
    journaled prompts back unchanged. llama.cpp itself is replaced by a counter: this checks the bookkeeping only."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("llama_cpp_serving", ROOT / "bench" / "llama_cpp_serving.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from types import SimpleNamespace

    from draftlab.llama_cpp_tools import Served

    calls = []

    def decode(tools, args, target_gguf, cfg, text, path):
        calls.append((cfg[0], text))
        return Served(text=text + "!", rounds=[(1, 1), (0, 1)], tokens=3, decode_seconds=0.5 + 0.01 * len(calls))

    monkeypatch.setattr(bench, "decode_one", decode)
    args = SimpleNamespace(work=str(tmp_path), max_new_tokens=8, threads=1, engine="exact", jobs=2)
    configs = {"s": [("target-only", None, None, 0, ()), ("head", "draft-eagle3", "draft.gguf", 1, ())]}
    prompts = {"s": [("p0", "f0"), ("p1", "f1"), ("p2", "f2")]}
    first = bench.run_rows(None, args, prompts, None, configs, 2, "main")
    assert len(calls) == 2 * 3 * 2                      # repeats x prompts x rows
    journal = bench.journal_path(args, "main")
    lines = journal.read_text().splitlines()
    assert len(lines) == 6
    journal.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20] + "\n")   # stopped while writing the 4th
    calls.clear()
    bench.RESUMED.clear()
    again = bench.run_rows(None, args, prompts, None, configs, 2, "main")
    assert len(calls) == 3 * 2 and bench.RESUMED == {"main": 3}
    head = ("head", "draft-eagle3", 1, "s", ())
    assert [s.text for s in again[head]["served"]] == [s.text for s in first[head]["served"]]
    assert again[head]["tps"][0] == first[head]["tps"][0]       # repeat 0 came back from the journal whole
    changed = {"s": configs["s"] + [("other", "draft-simple", "small.gguf", 1, ())]}
    calls.clear()
    bench.run_rows(None, args, prompts, None, changed, 1, "main")   # other rows: nothing reused
    assert len(calls) == 3 * 3
