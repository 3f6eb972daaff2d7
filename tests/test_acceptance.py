"""SpecDec++ acceptance head: labels, the loss learns, checkpoints reload the base; adaptive stopping is lossless,
threshold 1 is fixed-k drafting; draft-cost counts and calibration in the report."""
from __future__ import annotations

import json
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from draftlab import checkpoint as ckpt
from draftlab.drafters.acceptance import AcceptanceHead, draft_and_label
from draftlab.drafters.small_lm import SmallLM
from draftlab.evaluator import (GenerationResult, evaluate, evaluate_adaptive, run_baseline, speculative_generate,
                                target_generate)
from draftlab.proposers import CausalLMProposer
from draftlab.report import build_report, calibration, report_markdown, save_plots, summary_line
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling
from draftlab.drafters import load_drafter

GREEDY = Sampling()


@pytest.fixture(scope="module", autouse=True)
def registered():
    """Checkpoint loading looks kinds up in DRAFTERS; register both kinds until the package does."""
    from draftlab.drafters import DRAFTERS

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(DRAFTERS, "small_lm", SmallLM)
        mp.setitem(DRAFTERS, "acceptance", AcceptanceHead)
        yield


@pytest.fixture(scope="module")
def base_dir(tiny_target, tmp_path_factory):
    """A small_lm checkpoint: one layer built from the target's config, lightly fitted to the target's text so
    that its drafts are sometimes accepted and sometimes not."""
    model, tok = tiny_target
    torch.manual_seed(0)
    drafter = SmallLM.from_target(model, SimpleNamespace(num_layers=1), tok)
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog. def add(a, b): return a + b")["input_ids"]])
    with torch.no_grad():
        teacher = model(ids).logits.argmax(-1)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(15):
        loss = torch.nn.functional.cross_entropy(drafter(ids)[0], teacher[0])
        opt.zero_grad()
        loss.backward()
        opt.step()
    folder = tmp_path_factory.mktemp("base") / "step_1"
    ckpt.save_drafter(drafter.eval(), folder)
    return folder


@pytest.fixture(scope="module")
def head(tiny_target, base_dir):
    torch.manual_seed(1)
    return AcceptanceHead.from_target(tiny_target[0], SimpleNamespace(base=str(base_dir.parent))).eval()


@pytest.fixture(scope="module")
def prompts(tiny_target):
    from draftlab.data import encode_prompt

    tok = tiny_target[1]
    return [encode_prompt(tok, [{"role": "user", "content": t}])
            for t in ["The quick brown fox", "def add(a, b):", "Numbers: 0 1 2 3 4"]]


@pytest.fixture(scope="module")
def greedy_refs(tiny_target, prompts):
    return [target_generate(tiny_target[0], p, 20).tokens for p in prompts]


def _batch(tiny_target, tiny_chat_file, n=8):
    from draftlab.data import ChatDataset, collate, read_conversations

    tok = tiny_target[1]
    conversations, _ = read_conversations(tiny_chat_file)
    data = ChatDataset(conversations[:n], tok, 128)
    return collate([data[i] for i in range(n)], tok.pad_token_id or 0)


# --- labels and training -----------------------------------------------------------------------------------

def test_labels_are_min_one_p_over_q_on_hand_made_distributions():
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7], [0.25, 0.25, 0.25, 0.25]])
    p = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.1, 0.2, 0.0, 0.7], [0.7, 0.1, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        drafted, labels = draft_and_label(q.log(), p.log(), "sampled", gen)
        rows = torch.arange(3)
        assert (q[rows, drafted] > 0).all()                       # only tokens the draft can produce
        expected = (p[rows, drafted] / q[rows, drafted]).clamp(max=1.0)
        torch.testing.assert_close(labels, expected)
    drafted, labels = draft_and_label(q.log(), p.log(), "greedy")
    assert drafted.tolist() == [0, 3, 0] and labels.tolist() == [0.0, 1.0, 1.0]


def test_the_head_loss_falls_and_only_the_head_trains(tiny_target, tiny_chat_file, base_dir):
    model = tiny_target[0]
    torch.manual_seed(2)
    head = AcceptanceHead.from_target(model, SimpleNamespace(base=str(base_dir), acceptance_layers=2))
    batch = _batch(tiny_target, tiny_chat_file)
    base_before = [p.clone() for p in head.base.parameters()]

    def fixed_loss():
        torch.manual_seed(123)                                     # same drafts, labels and mixing each time
        with torch.no_grad():
            return head.loss(batch)

    before, metrics = fixed_loss()
    assert 0 < metrics["tokens"] and 0 <= metrics["label_mean"] <= 1
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for step in range(20):
        loss, _ = head.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after, _ = fixed_loss()
    assert after < before
    assert all(torch.equal(a, b) for a, b in zip(base_before, head.base.parameters()))
    assert all(not p.requires_grad for p in head.base.parameters())


def test_the_head_learns_a_state_dependent_acceptance(tiny_target, base_dir):
    """Beyond the mean: labels that depend on the drafter state (here a direction in it) are learned."""
    from draftlab.losses import acceptance_bce

    torch.manual_seed(0)
    net = AcceptanceHead.from_target(tiny_target[0], SimpleNamespace(base=str(base_dir)))
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(512, net.out.in_features, generator=gen)
    labels = torch.sigmoid(3 * states[:, 0])
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(150):
        loss = acceptance_bce(net(states)[None], labels[None], torch.ones(1, 512))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = torch.sigmoid(net(states))
    assert torch.corrcoef(torch.stack([pred, labels]))[0, 1] > 0.9


def test_labelling_in_chunks_matches_one_pass(tiny_target, base_dir):
    model = tiny_target[0]
    head = AcceptanceHead.from_target(model, SimpleNamespace(base=str(base_dir), acceptance_label="greedy"))
    base_states = torch.randn(10, head.out.in_features)
    target_states = torch.randn(10, model.config.hidden_size)
    whole = head._draft_and_label(base_states, target_states)
    for got, want in zip(head._draft_and_label(base_states, target_states, chunk=3), whole):
        torch.testing.assert_close(got, want)


def test_mixing_ratio_controls_the_labelled_share(tiny_target, tiny_chat_file, base_dir):
    model = tiny_target[0]
    batch = _batch(tiny_target, tiny_chat_file)
    drafted = int((batch["loss_mask"] * batch["attention_mask"])[:, 1:].sum())
    for ratio in (0.0, 0.5):
        head = AcceptanceHead.from_target(model, SimpleNamespace(base=str(base_dir), mix_ratio=ratio))
        torch.manual_seed(0)
        with torch.no_grad():
            _, metrics = head.loss(batch)
        if ratio == 0.0:
            assert metrics["tokens"] == drafted
        else:
            assert 0.3 * drafted < metrics["tokens"] < 0.7 * drafted


def test_checkpoint_saves_only_the_head_and_reloads_the_base(tiny_target, head, base_dir, tmp_path):
    folder = ckpt.save_drafter(head, tmp_path / "step_3")
    from safetensors.torch import load_file

    saved = load_file(str(folder / ckpt.WEIGHTS_NAME))
    assert set(saved) == set(head.state_dict()) and all(k.startswith(("blocks.", "out.")) for k in saved)
    config = ckpt.read_drafter_config(folder)
    assert config["kind"] == "acceptance" and config["base"] == str(base_dir.resolve())
    again = load_drafter(tmp_path, tiny_target[0])
    assert isinstance(again, AcceptanceHead) and again.base.kind == "small_lm"
    hidden = torch.randn(4, head.out.in_features)
    torch.testing.assert_close(again(hidden), head(hidden))


def test_a_missing_base_is_a_clear_error(tiny_target):
    with pytest.raises(ValueError, match="drafter.base"):
        AcceptanceHead.from_target(tiny_target[0], SimpleNamespace())
    with pytest.raises(ckpt.CheckpointError, match="base drafter"):
        AcceptanceHead.from_config({"kind": "acceptance", "base": "/nowhere/step_1"}, tiny_target[0])


# --- adaptive stopping -------------------------------------------------------------------------------------

@pytest.mark.parametrize("threshold", [0.0, 0.3, 1.0])
def test_adaptive_stopping_never_changes_the_greedy_output(tiny_target, head, prompts, greedy_refs, threshold):
    model = tiny_target[0]
    spec = TreeSpec(draft_length=6)
    for p, ref in zip(prompts, greedy_refs):
        res = speculative_generate(model, head.proposer(model, adaptive_threshold=threshold), p, spec, GREEDY, 20)
        assert res.tokens == ref
        assert all(1 <= d <= 6 for d in res.draft_depth)


def test_threshold_zero_drafts_min_draft_tokens(tiny_target, head, prompts):
    model = tiny_target[0]
    res = speculative_generate(model, head.proposer(model, adaptive_threshold=0.0, min_draft=2), prompts[0],
                               TreeSpec(draft_length=6), GREEDY, 20)
    assert set(res.draft_depth) == {2}


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0)], ids=["greedy", "sampled"])
def test_threshold_one_is_fixed_k_drafting(tiny_target, head, prompts, sampling):
    model = tiny_target[0]
    spec = TreeSpec(draft_length=4)
    for i, p in enumerate(prompts):
        runs = [speculative_generate(model, proposer, p, spec, sampling, 20,
                                     generator=torch.Generator().manual_seed(i))
                for proposer in (CausalLMProposer(head.base.model, head.base.draft_head), head.proposer(model, adaptive_threshold=1.0))]
        fixed, adaptive = runs
        assert adaptive.tokens == fixed.tokens
        assert adaptive.accepted == fixed.accepted and adaptive.draft_nodes == fixed.draft_nodes
        assert adaptive.new_tokens / adaptive.rounds == fixed.new_tokens / fixed.rounds
        assert set(adaptive.draft_depth) == {4}


def test_predictions_are_recorded_for_judged_tokens_only(tiny_target, head, prompts):
    model = tiny_target[0]
    proposer = head.proposer(model, adaptive_threshold=1.0)
    res = speculative_generate(model, proposer, prompts[0], TreeSpec(draft_length=4), GREEDY, 20)
    # the chain's last token has no prediction; the others count when judged (up to the first rejection)
    judged = sum(min(a + 1, 3) for a in res.accepted)
    assert len(res.predicted) == len(res.outcome) == judged
    assert sum(res.outcome) == sum(min(a, 3) for a in res.accepted)
    assert all(0.0 <= p <= 1.0 for p in res.predicted)
    assert len(proposer.predicted_acceptance) == 4 and math.isnan(proposer.predicted_acceptance[-1])


# --- report: draft cost and calibration --------------------------------------------------------------------

def test_draft_length_and_waste_on_a_hand_checked_case():
    results = [GenerationResult(tokens=[1] * 9, seconds=1.0, accepted=[2, 0, 3], draft_nodes=[3, 1, 3],
                                draft_depth=[3, 1, 3]),
               GenerationResult(tokens=[1] * 2, seconds=1.0, accepted=[1], draft_nodes=[2], draft_depth=[2])]
    baseline = {"outputs": [[1] * 9, [1] * 2], "tokens_per_second": 5.0}
    report = build_report(results, baseline, spec=TreeSpec(draft_length=3), sampling=GREEDY)
    assert report["mean_draft_length"] == (3 + 1 + 3 + 2) / 4
    assert report["wasted_draft_tokens"] == (3 + 1 + 3 + 2) - (2 + 0 + 3 + 1)
    assert "calibration" not in report


def test_calibration_error_is_bounded_and_zero_when_calibrated():
    perfect = calibration([0.25] * 4 + [0.75] * 4, [1, 0, 0, 0, 1, 1, 1, 0])
    assert perfect["ece"] == pytest.approx(0.0) and perfect["num_tokens"] == 8
    assert sum(b["count"] for b in perfect["bins"]) == 8
    worst = calibration([1.0, 1.0, 0.0], [0, 0, 1])
    assert worst["ece"] == pytest.approx(1.0)
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(200, generator=gen).tolist()
    y = (torch.rand(200, generator=gen) < 0.5).int().tolist()
    assert 0.0 <= calibration(p, y)["ece"] <= 1.0
    assert calibration([], []) is None


def test_adaptive_and_fixed_k_side_by_side(tiny_target, head, prompts, tmp_path):
    model = tiny_target[0]
    spec = TreeSpec(draft_length=5)
    baseline = run_baseline(model, prompts, sampling=GREEDY, max_new_tokens=16, progress=False)
    report = evaluate_adaptive(model, partial(head.proposer, model), prompts, spec=spec, sampling=GREEDY,
                               max_new_tokens=16, adaptive_threshold=0.3, fixed_lengths=[2, 5], baseline=baseline,
                               progress=False)
    assert set(report["fixed_k"]) == {"2", "5"} and report["adaptive"] == {"threshold": 0.3, "min_draft": 1}
    for k, fixed in report["fixed_k"].items():
        assert fixed["mean_draft_length"] == int(k) and fixed["lossless"]
        drafted = fixed["mean_draft_nodes"] * fixed["rounds"]
        assert fixed["wasted_draft_tokens"] == round(drafted - (fixed["new_tokens"] - fixed["rounds"]))
    assert report["lossless"] and 1 <= report["mean_draft_length"] <= 5
    calib = report["calibration"]
    assert 0.0 <= calib["ece"] <= 1.0 and calib["num_tokens"] > 0
    assert all("adaptive" not in fixed for fixed in report["fixed_k"].values())
    assert "adaptive: mean draft length" in summary_line(report)
    assert "fixed k=2" in report_markdown(report) and "calibration ECE" in report_markdown(report)
    paths = save_plots(report, tmp_path, prefix="eval")
    assert str(tmp_path / "eval_calibration.png") in paths and (tmp_path / "eval_calibration.png").stat().st_size


def test_every_report_has_the_draft_cost_keys(tiny_target, prompts):
    from draftlab.proposers import CausalLMProposer

    model = tiny_target[0]
    report = evaluate(model, CausalLMProposer(model), prompts[:1], spec=TreeSpec(draft_length=3),
                      sampling=GREEDY, max_new_tokens=12, progress=False)
    assert report["mean_draft_length"] == 3 and report["wasted_draft_tokens"] == 0


def test_auto_threshold_weighs_every_threshold_against_fixed_chains(tiny_target, head, prompts):
    """costs.auto_threshold: fixed k = 1..K (k = 1 is the control) and each threshold are costed on the same
    measured draft / verification costs; the winner has the most expected tokens/s, and its shape is usable."""
    from draftlab import costs

    model = tiny_target[0]
    shape = costs.auto_threshold(model, partial(head.proposer, model), prompts[:2], GREEDY, max_length=3,
                                 thresholds=(0.2, 0.6), max_new_tokens=12)
    candidates = shape["threshold_candidates"]
    assert set(candidates) == {"fixed k=1", "fixed k=2", "fixed k=3", "threshold 0.2", "threshold 0.6"}
    best = max(candidates, key=lambda c: candidates[c]["expected_tokens_per_second"])
    assert shape["chosen_label"] == best and shape["chosen_threshold"] == candidates[best]["threshold"]
    assert 1 <= shape["chosen_draft_length"] <= 3
    for label, c in candidates.items():
        assert 1.0 <= c["tau"] <= c["draft_length"] + 1 and 1.0 <= c["mean_draft_length"] <= c["draft_length"]
        assert c["threshold"] == (1.0 if label.startswith("fixed") else float(label.split()[1]))
    assert candidates["fixed k=2"]["mean_draft_length"] == 2.0


def test_eval_cli_auto_threshold_with_the_fixed_k1_control(tiny_target, tiny_target_dir, tiny_prompt_file, head,
                                                           tmp_path):
    import subprocess
    import sys

    folder = ckpt.save_drafter(head, tmp_path / "acc" / "step_1")
    out = tmp_path / "auto.json"
    proc = subprocess.run([sys.executable, "-m", "draftlab.cli", "eval", "--checkpoint", str(folder), "--target",
                           tiny_target_dir, "--prompts", tiny_prompt_file, "--out", str(out), "--num-prompts", "2",
                           "--max-new-tokens", "12", "--adaptive-threshold", "auto", "--max-draft-length", "3",
                           "--calibration-prompts", "1", "--fixed-k", "1"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    shape = report["draft_shape"]
    assert report["chosen_threshold"] == shape["chosen_threshold"] and "fixed k=1" in shape["threshold_candidates"]
    assert report["lossless"] and report["fixed_k"]["1"]["lossless"] and report["fixed_k"]["1"]["mean_draft_length"] == 1
    assert report["tree"]["draft_length"] == report["chosen_draft_length"] == shape["chosen_draft_length"]
    assert "stopping rule:" in proc.stdout


# --- the training loop -------------------------------------------------------------------------------------

def test_recipe_trains_and_evaluates_in_the_loop(tiny_target, tiny_target_dir, tiny_chat_file, tiny_prompt_file,
                                                 base_dir, tmp_path):
    from draftlab.config import load_config
    from draftlab.train import main

    out = tmp_path / "run"
    cfg = load_config(["recipe=acceptance_head", f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}",
                       f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}", f"drafter.base={base_dir}",
                       "train.max_steps=4", "eval.every=2", "eval.num_prompts=2", "eval.max_new_tokens=12",
                       "eval.draft_length=4", "train.batch_size=4", "train.grad_accum=1", "train.warmup_steps=0",
                       "data.max_length=96", "tracking=none", "train.keep_last=0", "train.lr=1e-3"])
    main(cfg)
    report = json.loads((out / "step_4" / "eval.json").read_text())
    assert report["lossless"] and report["adaptive"]["threshold"] == 0.3
    assert 1 <= report["mean_draft_length"] <= 4 and report["wasted_draft_tokens"] >= 0
    assert 0 <= report["calibration"]["ece"] <= 1
    assert (out / "step_4" / "calibration.png").stat().st_size > 0          # train.py's calibration hook
    assert isinstance(load_drafter(out, tiny_target[0]), AcceptanceHead)
