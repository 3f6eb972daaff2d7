"""Smoke tests of bench/draft_cost.py and bench/verification_cost.py on tiny models: they run, interleave, and
write their JSON, markdown (and plot)."""
from __future__ import annotations

import json


def test_draft_cost_on_tiny_target(bench_script, tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path):
    bench = bench_script("draft_cost")
    out = tmp_path / "draft_cost.json"
    result = bench.main(["--target", tiny_target_dir, "--answers", tiny_chat_file, "--prompts", tiny_prompt_file,
                         "--vocab", "32", "--repeats", "2", "--inner", "1", "--medusa-heads", "2", "--length", "3",
                         "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["vocabulary"]["size"] == 32 and 0 < saved["vocabulary"]["coverage"] <= 1
    assert [(r["kind"], r["variant"]) for r in saved["rows"]] == [
        (k, v) for k in bench.KINDS for v in ("full", "reduced")]
    for row in saved["rows"]:
        assert row["vocabulary"] == (32 if row["variant"] == "reduced" else result["rows"][0]["vocabulary"])
        cost = row["draft_step_vs_target_step"]
        assert cost["min"] <= cost["median"] <= cost["max"]
        assert row["propose_k1_ms"]["median"] > 0
    assert len(saved["rounds"]) == 2 and all(len(r["load_average"]) == 2 for r in saved["rounds"])
    assert "| small_lm | 32 |" in out.with_suffix(".md").read_text()


def test_verification_cost_curve_on_tiny_llama(bench_script, tmp_path):
    bench = bench_script("verification_cost")
    out = tmp_path / "verification_cost.json"
    result = bench.main(["--curve", "4", "--curve-passes", "2", "--repeats", "1", "--num-prompts", "1",
                         "--max-new-tokens", "4", "--prefix-len", "32", "--threads", "1", "--out", str(out)])
    curve = json.loads(out.read_text())["curve"]
    assert curve["n"] == [1, 2, 3, 4] == result["curve"]["n"]
    for kind in ("chain", "tree", "tree_vs_chain"):
        assert len(curve[kind]) == 4 and all(0 < r["min"] <= r["median"] <= r["max"] for r in curve[kind])
    assert len(curve["load_average"]) == 2 + 2          # before each pass (warm-up included) and at the end
    assert out.with_suffix(".md").is_file() and (tmp_path / "verification_cost_curve.png").is_file()
