"""Cost-aware draft shapes (draftlab/costs.py) and interleaved timing in the evaluator."""
from __future__ import annotations

import pytest
import torch

from draftlab import costs, evaluator
from draftlab.proposers import PromptLookupProposer, CausalLMProposer
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling


def test_expected_tokens_adds_the_bonus_token():
    assert costs.expected_tokens([0.8, 0.5, 0.2], 0) == 1.0
    assert costs.expected_tokens([0.8, 0.5, 0.2], 2) == pytest.approx(2.3)


def test_choose_draft_length_finds_the_known_optimum():
    """Synthetic machine: verifying n tokens costs 1 + 0.1 (n-1), a draft step 0.05; acceptance decays by 0.7 a
    position. Expected tokens/s by k, computed by hand, peak at k = 3 (1.747 against 1.733 at k = 4)."""
    acc = [0.7 ** i for i in range(1, 9)]
    verify = {n: 1.0 + 0.1 * (n - 1) for n in range(1, 10)}
    draft = {k: 0.05 * k for k in range(1, 9)}
    best, table = costs.choose_draft_length(acc, verify, draft)
    by_hand = {k: (1 + sum(acc[:k])) / (1.0 + 0.1 * k + 0.05 * k) for k in range(1, 9)}
    assert best == max(by_hand, key=by_hand.get) == 3
    assert all(table[k]["expected_tokens_per_second"] == pytest.approx(by_hand[k]) for k in by_hand)
    # a perfect drafter on a machine whose verification is free: the longest chain wins
    best, _ = costs.choose_draft_length([1.0] * 8, {n: 1.0 for n in range(1, 10)}, {k: 0.0 for k in range(1, 9)})
    assert best == 8
    # verification that grows as fast as decoding itself: drafting one token is the least bad
    best, _ = costs.choose_draft_length([0.3] * 8, {n: float(n) for n in range(1, 10)}, {k: 0.0 for k in range(1, 9)})
    assert best == 1


def test_adaptive_rounds_are_costed_at_the_length_each_stopped():
    """Rounds that stopped after 1, 1 and 4 drafts: each costs its own draft[k] + verify[k + 1], plus overhead."""
    verify = {n: 1.0 + 0.1 * (n - 1) for n in range(1, 10)}
    draft = {k: 0.05 * k for k in range(1, 9)}
    seconds = costs.expected_adaptive_seconds([1, 1, 4], verify, draft, overhead=0.2)
    assert seconds == pytest.approx((2 * (0.05 + 1.1) + (0.2 + 1.4)) / 3 + 0.2)
    with pytest.raises(ValueError):
        costs.expected_adaptive_seconds([], verify, draft)


def test_measured_costs_and_auto_choice_on_the_tiny_target(tiny_target):
    model, tok = tiny_target
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in ("The quick brown fox", "def add(a, b):")]
    verify = costs.measure_verify_cost(model, prompts[0], [1, 3, 6], repeats=2)
    tree = costs.measure_verify_cost(model, prompts[0], [6], tree=True, repeats=2)
    assert set(verify) == {1, 3, 6} and all(v > 0 for v in verify.values()) and tree[6] > 0
    shape = costs.auto_draft_length(model, CausalLMProposer(model), prompts, Sampling(), max_length=4,
                                    max_new_tokens=12)
    assert 1 <= shape["chosen_draft_length"] <= 4 and set(shape["cost_model"]) == {1, 2, 3, 4}
    # the copy of the target is always accepted: every position's acceptance is 1
    assert shape["per_position_acceptance"] == pytest.approx([1.0] * 4)
    best = max(shape["cost_model"], key=lambda k: shape["cost_model"][k]["expected_tokens_per_second"])
    assert shape["chosen_draft_length"] == best


def test_timing_repeats_are_interleaved(tiny_target, monkeypatch):
    """Target-only and speculative runs alternate prompt by prompt, and their order flips every repeat."""
    model, tok = tiny_target
    calls = []
    real_target, real_spec = evaluator.target_generate, evaluator.speculative_generate

    def target_generate(*a, **k):
        calls.append("T")
        return real_target(*a, **k)

    def speculative_generate(*a, **k):
        calls.append("S")
        return real_spec(*a, **k)
    monkeypatch.setattr(evaluator, "target_generate", target_generate)
    monkeypatch.setattr(evaluator, "speculative_generate", speculative_generate)
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in ("The quick brown fox", "def add(a, b):")]
    report = evaluator.evaluate(model, PromptLookupProposer(), prompts, spec=TreeSpec(draft_length=3),
                                sampling=Sampling(), max_new_tokens=8, repeats=3, progress=False, warmup=False)
    assert "".join(calls) == "TSSTTS" * 2
    assert report["timing_repeats"] == 3 and len(report["speedups"]) == 3 and report["lossless"] is True
    assert report["speedup_min"] <= report["speedup"] <= report["speedup_max"]
    assert report["timing"] == "interleaved" and len(report["load_average"]) == 2


def lookup_first_setup(tiny_target):
    """A random EAGLE head behind prompt lookup, a prompt that repeats itself, and the target's own greedy output."""
    from draftlab.drafters.eagle import EagleHead
    from draftlab.proposers import LookupFirstProposer

    model, tok = tiny_target
    torch.manual_seed(0)
    head = EagleHead.from_target(model, None).eval()
    prompt = torch.tensor(tok("The quick brown fox. The quick brown fox. The quick brown fox. The quick")["input_ids"])
    expected = evaluator.target_generate(model, prompt, 24).tokens
    return model, prompt, expected, lambda: LookupFirstProposer(head.proposer(model), min_ngram=2)


def test_lookup_first_drafts_repeats_by_lookup_and_stays_lossless(tiny_target):
    """Prompt lookup in front of a drafter: on a prompt that repeats itself lookup drafts some rounds, the drafter
    the others, and the output is the target's."""
    model, prompt, expected, make = lookup_first_setup(tiny_target)
    proposer = make()
    out = evaluator.speculative_generate(model, proposer, prompt, TreeSpec(draft_length=4), Sampling(), 24)
    assert out.tokens == expected and out.rounds > proposer.lookup_rounds > 0


def test_lookup_first_with_a_tree_drafts_lookup_chains_and_drafter_trees_losslessly(tiny_target):
    model, prompt, expected, make = lookup_first_setup(tiny_target)
    proposer = make()
    spec = TreeSpec(kind="dynamic", depth=4, top_k=4, total_tokens=12)
    out = evaluator.speculative_generate(model, proposer, prompt, spec, Sampling(), 24)
    assert out.tokens == expected and out.rounds > proposer.lookup_rounds > 0
    sampled = evaluator.speculative_generate(model, make(), prompt, spec, Sampling(temperature=0.7), 24,
                                             generator=torch.Generator().manual_seed(0))
    assert 0 < len(sampled.tokens) <= 24


def test_side_by_side_shares_the_target_only_runs_and_rotates_the_order(tiny_target, monkeypatch):
    model, tok = tiny_target
    calls = []
    real_target, real_spec = evaluator.target_generate, evaluator.speculative_generate
    monkeypatch.setattr(evaluator, "target_generate", lambda *a, **k: calls.append("T") or real_target(*a, **k))
    monkeypatch.setattr(evaluator, "speculative_generate",
                        lambda m, proposer, *a, **k: calls.append(proposer.name) or real_spec(m, proposer, *a, **k))
    a, b = PromptLookupProposer(), CausalLMProposer(model)
    a.name, b.name = "A", "B"
    prompts = [torch.tensor(tok("The quick brown fox")["input_ids"])]
    drafts = {"a": (a, TreeSpec(draft_length=3)), "b": (b, TreeSpec(draft_length=2))}
    reports = evaluator.evaluate_side_by_side(model, drafts, prompts, sampling=Sampling(), max_new_tokens=8,
                                              repeats=3, progress=False, warmup=False)
    assert "".join(calls) == "TAB" + "ABT" + "BTA"
    assert reports["b"]["acceptance_length"] == 3.0 and reports["a"]["lossless"] and reports["b"]["lossless"]
    assert reports["a"]["baseline_tokens_per_second"] == reports["b"]["baseline_tokens_per_second"]


def test_in_loop_evaluation_can_choose_the_draft_length(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path):
    """eval.auto_draft_length: each in-loop eval.json drafts the chain length that costs.auto_draft_length chose,
    and says what it measured."""
    import json

    from draftlab.config import load_config
    from draftlab.train import main

    out = tmp_path / "run"
    main(load_config(["recipe=eagle_head", f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}",
                      f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}", "train.max_steps=2", "eval.every=2",
                      "eval.num_prompts=2", "eval.max_new_tokens=12", "eval.auto_draft_length=true",
                      "eval.max_draft_length=3", "eval.calibration_prompts=1", "train.batch_size=2",
                      "train.grad_accum=1", "train.warmup_steps=0", "data.max_length=96", "tracking=none",
                      "train.keep_last=0"]))
    report = json.loads((out / "step_2" / "eval.json").read_text())
    shape = report["draft_shape"]
    assert 1 <= report["chosen_draft_length"] <= 3 and report["tree"]["draft_length"] == report["chosen_draft_length"]
    assert set(shape["cost_model"]) == {"1", "2", "3"} and shape["calibration_prompts"] == 1
    assert report["lossless"] and 1.0 <= report["acceptance_length"] <= report["chosen_draft_length"] + 1
