"""The data helpers of the learning-curve and payoff benchmarks: learning_curve.py `data --sample` and
cpu_payoff.py's record of a run trained elsewhere (--from-run). Pure file work, no model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml


def conversation(i: int, user: str | None = None) -> dict:
    return {"id": f"c{i}", "messages": [{"role": "user", "content": user or f"question number {i}"},
                                        {"role": "assistant", "content": f"answer number {i}"}]}


@pytest.fixture
def lc(bench_script):
    """bench/learning_curve.py, its evaluation sets pointed at the checkout's own copies."""
    module = bench_script("learning_curve")
    prompts = module.ROOT / "data_prep" / "prompts"
    module.SETS = {"mtbench": str(prompts / "mtbench.jsonl"), "heldout": str(prompts / "heldout_train_dist.jsonl")}
    return module


@pytest.fixture
def answers(tmp_path, lc) -> Path:
    """20 conversations, the third of which opens with the first MT-bench prompt (an evaluation prompt)."""
    from draftlab.data import load_prompts

    first_mtbench = lc.first_user_turn(load_prompts(lc.SETS["mtbench"], limit=1)[0].messages)
    rows = [conversation(i, first_mtbench if i == 2 else None) for i in range(20)]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ids_of(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_data_sample_is_a_seeded_subset_in_file_order_without_evaluation_prompts(lc, answers, tmp_path):
    lc.main(["data", "--data", str(answers), "--out", str(tmp_path / "all.jsonl")])
    everything = ids_of(tmp_path / "all.jsonl")
    assert len(everything) == 19 and "c2" not in everything

    for seed, name in [(0, "a"), (0, "b"), (1, "c")]:
        lc.main(["data", "--data", str(answers), "--out", str(tmp_path / f"{name}.jsonl"), "--sample", "7",
                 "--seed", str(seed)])
    a, b, c = (ids_of(tmp_path / f"{n}.jsonl") for n in "abc")
    assert a == b                                         # the same seed draws the same rows
    assert a != c                                         # another seed draws others
    for sample in (a, c):
        assert len(sample) == 7 and len(set(sample)) == 7
        assert set(sample) <= set(everything)
        assert sample == [i for i in everything if i in sample]  # kept in file order


def test_data_sample_larger_than_the_data_is_one_clear_error(lc, answers, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    with pytest.raises(SystemExit, match="has only 19 conversations"):
        lc.main(["data", "--data", str(answers), "--out", str(out), "--sample", "20"])
    assert out.read_text() == "kept\n"                    # nothing written over


def test_run_record_sums_every_logged_segment(bench_script, tmp_path):
    payoff = bench_script("cpu_payoff")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"recipe": "eagle3_head",
                                                     "train": {"max_steps": 30, "num_threads": 1}}))
    rows = [{"step": 10, "loss": 3.0, "train_seconds": 4.0, "train_tokens": 400.0},
            {"step": 20, "loss": 2.0, "train_seconds": 6.0, "train_tokens": 400.0},
            {"step": 20, "eval/acceptance_length": 1.5},          # an evaluation row: no training time
            {"step": 30, "loss": 1.0, "train_seconds": 10.0, "train_tokens": 400.0}]  # a resumed segment
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    record = payoff.run_record(run)

    assert record["recipe"] == "eagle3_head" and record["steps"] == 30 and record["max_steps"] == 30
    assert record["train_seconds"] == 20.0 and record["train_tokens"] == 1200.0
    assert record["train_tokens_per_second"] == 60.0


def test_run_record_of_a_folder_that_is_not_a_run_is_one_clear_error(bench_script, tmp_path):
    payoff = bench_script("cpu_payoff")
    with pytest.raises(SystemExit, match="not a finished draftlab run folder"):
        payoff.run_record(tmp_path)


def test_goals_score_the_head_alone_beside_the_hybrid_against_prompt_lookup(bench_script):
    payoff = bench_script("cpu_payoff")

    def row(drafter, tree, prompt_set, tau):
        return {"drafter": drafter, "tree": tree, "prompt_set": prompt_set, "acceptance_length": tau, "lossless": True}
    hybrid = "head + lookup-first (n>=3)"
    rows = [row("head", "chain k=5", "mtbench", 1.6), row("prompt_lookup", "chain k=5", "mtbench", 1.5),
            row(hybrid, "chain k=5", "mtbench", 1.9), row(hybrid, "auto (chain k=2)", "mtbench", 1.7),
            row(hybrid, "dynamic 48", "mtbench", 2.7), row("head", "chain k=5", "humaneval", 1.6),
            row("prompt_lookup", "chain k=5", "humaneval", 1.7), row(hybrid, "chain k=5", "humaneval", 2.0)]

    goals = {g["goal"]: g for g in payoff.goals(rows, {"train_seconds": 100.0})}

    assert goals[f"chain tau (k=5), MT-bench first turns ({hybrid})"]["met"] is False      # 1.9 < 2.0
    assert [g["met"] for name, g in goals.items() if name.startswith("dynamic-tree")] == [True]
    assert goals[f"chain tau minus prompt lookup's, humaneval ({hybrid})"]["met"] is True
    lost = goals["chain tau minus prompt lookup's, humaneval (head)"]
    assert lost["met"] is False and lost["margin"] == pytest.approx(-0.1)
    assert goals["chain tau minus prompt lookup's, mtbench (head)"]["margin"] == pytest.approx(0.1)


def test_report_keeps_the_rows_of_runs_scored_on_another_machine(lc, tmp_path, monkeypatch):
    """A report written where only one run's checkpoints exist rescores that run and keeps every other run's rows."""
    from draftlab.checkpoint import CONFIG_NAME

    monkeypatch.setattr(lc, "CACHE", tmp_path / "cache")
    previous = tmp_path / "report"
    old = [{"label": label, "step": step, "epoch": 1.0, "conversations": 10, "conversations_seen": 10,
            "train_tokens_seen": 100.0, "train_seconds": 1.0, "train_top1_agreement": 0.5, "tau_mtbench_chain": tau}
           for label, step, tau in [("earlier", 5, 1.5), ("earlier", 10, 1.7), ("fresh", 4, 9.0)]]
    previous.with_suffix(".json").write_text(json.dumps({"header": {}, "points": old}))

    fresh = lc.run_dir("fresh")
    step = fresh / "step_4"
    step.mkdir(parents=True)
    (step / CONFIG_NAME).write_text("{}")
    (step / "lc_mtbench_chain_80_96.json").write_text(json.dumps(
        {"acceptance_length": 1.25, "per_position_acceptance": [0.25], "lossless": True}))
    (fresh / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 1.0, "acc": 0.4, "train_tokens": 64}) + "\n")
    (fresh / "bench_train.json").write_text(json.dumps({"recipe": "eagle_head", "steps": 4, "epochs": 1, "rows": 8}))

    lc.main(["report", "--out", str(previous), "--labels", "fresh", "--num-prompts", "80",
             "--max-new-tokens", "96"])
    written = json.loads(previous.with_suffix(".json").read_text())
    rows = {(p["label"], p["step"]): p for p in written["points"]}
    assert set(rows) == {("earlier", 5), ("earlier", 10), ("fresh", 4)}
    assert rows[("earlier", 10)] == old[1]                 # carried unchanged
    assert rows[("fresh", 4)]["tau_mtbench_chain"] == 1.25  # rescored, the stale row replaced
    assert written["header"]["carried_labels"] == ["earlier"]
    assert "| earlier | 10 |" in previous.with_suffix(".md").read_text()
