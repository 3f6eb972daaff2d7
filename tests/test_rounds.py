"""The round log (`draftlab eval --log-rounds`): rows round-trip, agree with the evaluator's counts, change no output,
and a bad row is one clear line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from draftlab.errors import DataError
from draftlab.evaluator import evaluate, speculative_generate, target_generate
from draftlab.proposers import CausalLMProposer, PromptLookupProposer
from draftlab.rounds import FORMAT_VERSION, RoundLog, read_rounds, sequences
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling


@pytest.fixture(scope="module")
def prompts(tiny_chat_prompts):
    return tiny_chat_prompts


@pytest.mark.parametrize("spec", [TreeSpec("chain", draft_length=4), TreeSpec("dynamic", depth=3, top_k=2,
                                                                                   total_tokens=6)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_log_round_trips_and_agrees_with_the_report(tiny_target, prompts, noisy_copy, tmp_path, spec, temperature):
    model, _ = tiny_target
    sampling = Sampling(temperature=temperature)
    path = tmp_path / "rounds.jsonl"
    with RoundLog(path, topk=5) as log:
        report = evaluate(model, CausalLMProposer(noisy_copy), prompts, spec=spec, sampling=sampling,
                          max_new_tokens=20, seed=3, progress=False, log_rounds=log)
    rows = read_rounds(path)
    again = [json.loads(line) for line in path.read_text().splitlines()]
    written = [{k: v for k, v in r.__dict__.items() if not (k == "drafter" and v is None)} for r in rows]
    assert written == again                                       # write -> read gives the same rows (the optional
                                                                  # drafter key is left out where it is None)
    assert len(rows) == report["rounds"] == report["target_forwards"]
    assert sum(len(r.accepted) + 1 for r in rows) == report["new_tokens"]
    assert all(r.version == FORMAT_VERSION and r.sampling["temperature"] == temperature for r in rows)
    assert [r.prompt_ids is not None for r in rows] == [r.round == 0 for r in rows]   # prompt ids once per prompt
    for r in rows:
        assert len(r.target_topk_ids) == len(r.accepted) + 1 and all(len(ids) == 5 for ids in r.target_topk_ids)
        assert all(a >= b for lp in r.target_topk_logprobs for a, b in zip(lp, lp[1:]))
        assert r.draft_stats is not None and len(r.draft_stats) == len(r.tokens)
        assert all(0 <= top2 <= top1 <= 1 and entropy >= 0 for top1, top2, entropy in r.draft_stats)
        if temperature > 0 and spec.kind == "chain":
            assert r.q is not None and all(0 < q <= 1 for q in r.q)
        if temperature == 0:                # greedy: every new token is the target's argmax at its position
            assert r.q is None and [ids[0] for ids in r.target_topk_ids] == r.new_tokens
    per_position = [sum(len(r.accepted) > i for r in rows) / len(rows) for i in range(spec.max_depth)]
    assert per_position == pytest.approx(report["per_position_acceptance"])
    seqs = sequences(rows)
    if temperature == 0:                    # the committed sequences continue with the target's own greedy output
        for i, p in enumerate(prompts):
            ref = target_generate(model, p, 20).tokens
            assert seqs[i][:len(p)] == p.tolist() and seqs[i][len(p):len(p) + len(ref)] == ref


def test_logging_changes_no_output_and_is_off_by_default(tiny_target, prompts, noisy_copy, tmp_path):
    model, _ = tiny_target
    spec, sampling = TreeSpec("chain", draft_length=3), Sampling(temperature=0.8)
    proposer = CausalLMProposer(noisy_copy)
    plain = [speculative_generate(model, proposer, p, spec, sampling, 16, generator=torch.Generator().manual_seed(i))
             for i, p in enumerate(prompts)]
    with RoundLog(tmp_path / "r.jsonl") as log:
        logged = [speculative_generate(model, proposer, p, spec, sampling, 16, generator=torch.Generator().manual_seed(i),
                                       log=log.for_prompt(i, p)) for i, p in enumerate(prompts)]
    assert [r.tokens for r in plain] == [r.tokens for r in logged]
    assert [r.accepted for r in plain] == [r.accepted for r in logged]
    assert not getattr(proposer, "record_draft_stats", False)          # recording ends with the prompt
    tree = proposer.propose(spec, sampling, torch.Generator().manual_seed(0))
    assert tree.draft_stats is None


def test_prompt_lookup_rounds_have_no_draft_stats(tiny_target, prompts, tmp_path):
    model, _ = tiny_target
    with RoundLog(tmp_path / "r.jsonl") as log:
        evaluate(model, PromptLookupProposer(), prompts, spec=TreeSpec("chain", draft_length=3), sampling=Sampling(),
                 max_new_tokens=12, progress=False, log_rounds=log)
    rows = read_rounds(tmp_path / "r.jsonl")
    assert rows and all(r.draft_stats is None and r.q is None for r in rows)


@pytest.mark.parametrize("case", ["version", "json", "missing", "path", "topk_rows", "empty", "absent"])
def test_a_bad_row_is_one_clear_error(tiny_target, prompts, noisy_copy, tmp_path, case):
    model, _ = tiny_target
    good = tmp_path / "good.jsonl"
    with RoundLog(good) as log:
        evaluate(model, CausalLMProposer(noisy_copy), prompts[:1], spec=TreeSpec("chain", draft_length=3),
                 sampling=Sampling(), max_new_tokens=8, progress=False, log_rounds=log)
    rows = [json.loads(line) for line in good.read_text().splitlines()]
    row = rows[-1]
    lines = [json.dumps(r) for r in rows[:-1]]
    if case == "version":
        lines.append(json.dumps({**row, "version": 2}))
    elif case == "json":
        lines.append("{not json")
    elif case == "missing":
        lines.append(json.dumps({k: v for k, v in row.items() if k != "bonus"}))
    elif case == "path":
        lines.append(json.dumps({**row, "accepted": [1]}))
    elif case == "topk_rows":
        lines.append(json.dumps({**row, "target_topk_ids": row["target_topk_ids"] + [[1]]}))
    elif case == "empty":
        lines = []
    bad = tmp_path / "bad.jsonl"
    if case != "absent":
        bad.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(DataError) as err:
        read_rounds(bad)
    message = str(err.value)
    assert "\n" not in message and str(bad) in message
    if case not in ("empty", "absent"):
        assert f"line {len(rows)}" in message
    if case == "version":
        assert "version 2" in message and f"version {FORMAT_VERSION}" in message


def test_eval_cli_writes_the_log(tiny_target_dir, tiny_prompt_file, tmp_path, tiny_target):
    from draftlab.checkpoint import save_drafter
    from draftlab.drafters.eagle import EagleHead

    ckpt = save_drafter(EagleHead.from_target(tiny_target[0], None), tmp_path / "step_0")
    out, log = tmp_path / "report.json", tmp_path / "rounds.jsonl"
    run = lambda *extra: subprocess.run([sys.executable, "-m", "draftlab.cli", "eval", "--checkpoint", str(ckpt),
                                         "--target", tiny_target_dir, "--prompts", tiny_prompt_file, "--out", str(out),
                                         "--max-new-tokens", "10", "--num-prompts", "2", "--draft-length", "3",
                                         *extra], capture_output=True, text=True, timeout=300)
    proc = run("--log-rounds", str(log), "--log-topk", "3")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    rows = read_rounds(log)
    assert report["round_log"]["rows"] == len(rows) == report["rounds"] and report["lossless"] is True
    assert sum(len(r.accepted) + 1 for r in rows) == report["new_tokens"]
    assert all(len(ids) == 3 for r in rows for ids in r.target_topk_ids)
    bad = run("--log-rounds", str(tmp_path / "other.jsonl"), "--log-topk", "0")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--log-topk" in bad.stderr
    assert not (tmp_path / "other.jsonl").exists()
