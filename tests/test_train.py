"""End to end on the tiny target: recipe -> training -> in-loop speculative evaluation -> run folder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftlab import checkpoint as ckpt
from draftlab.config import ConfigError, load_config
from draftlab.train import main
from draftlab.drafters import load_drafter


def tiny_args(tiny_target_dir, data, prompts, out_dir, *extra):
    return ["recipe=eagle_head", f"target.path={tiny_target_dir}", f"data.train={data}",
            f"data.eval_prompts={prompts}", f"out_dir={out_dir}", "eval.num_prompts=3", "eval.max_new_tokens=24",
            "eval.draft_length=4", "train.batch_size=4", "train.warmup_steps=0", "data.max_length=128",
            "tracking=none", "train.keep_last=0", *extra]


@pytest.fixture(scope="module")
def self_answers(tiny_target_dir, tiny_prompt_file, tmp_path_factory):
    """Training data the target wrote itself (greedy answers): a learnable task for a drafter."""
    return str(tmp_path_factory.mktemp("answers") / "answers.jsonl")


@pytest.fixture(scope="module")
def trained_run(tiny_target_dir, self_answers, tiny_chat_file, tiny_prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    cfg = load_config(tiny_args(tiny_target_dir, self_answers, tiny_prompt_file, out,
                                f"data.regenerate_from={tiny_chat_file}", "data.regenerate_num=48",
                                "data.regenerate_max_new_tokens=24", "data.regenerate_batch_size=16",
                                "train.max_steps=80", "eval.every=40", "eval.at_start=true", "train.lr=3e-3",
                                "train.cache_features=true", "drafter.feature_noise=0.0"))
    return out, main(cfg)


def test_run_folder_follows_the_contract(trained_run):
    out, summary = trained_run
    assert (out / "config.yaml").is_file() and (out / "metrics.jsonl").is_file() and (out / "tau.png").is_file()
    steps = [p.name for p in ckpt.step_folders(out)]
    assert steps == ["step_0", "step_40", "step_80"]  # untrained, in-loop, final
    best = (out / "best").read_text().strip()
    assert best in steps and best == f"step_{summary['best_step']}"
    for name in steps:
        report = json.loads((out / name / "eval.json").read_text())
        for key in ["acceptance_length", "acceptance_length_per_sample", "per_position_acceptance", "rounds",
                    "new_tokens", "target_forwards", "draft_length", "temperature", "lossless", "tokens_per_second",
                    "baseline_tokens_per_second", "speedup", "num_prompts"]:
            assert key in report, key
        assert report["lossless"] is True
        assert 1.0 <= report["acceptance_length"] <= 4 + 1
        assert len(report["per_position_acceptance"]) == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in rows) and any("eval/acceptance_length" in r for r in rows)


def test_training_raises_acceptance_length(trained_run):
    _, summary = trained_run
    taus = {h["step"]: h["tau"] for h in summary["history"]}
    assert taus[80] > taus[0] + 0.3, taus  # trained on the target's own answers vs untrained head


def test_saved_checkpoint_reloads_identically(trained_run, tiny_target):
    out, _ = trained_run
    target, _ = tiny_target
    a = load_drafter(out / "step_80", target)
    b = load_drafter(out, target)  # run folder = its best step
    assert ckpt.resolve_checkpoint(out).name == (out / "best").read_text().strip()
    for (ka, va), (kb, vb) in zip(ckpt.trainable_state_dict(a).items(), ckpt.trainable_state_dict(a).items()):
        assert ka == kb and torch.equal(va, vb)
    assert b is not None


def test_existing_run_is_never_overwritten(trained_run, tiny_target_dir, self_answers, tiny_prompt_file):
    out, _ = trained_run
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    cfg = load_config(tiny_args(tiny_target_dir, self_answers, tiny_prompt_file, out, "train.max_steps=2"))
    with pytest.raises(ConfigError, match="already holds a run"):
        main(cfg)
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


def test_resume_continues_the_same_run(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path):
    """4 steps straight == 2 steps, stop, resume for 2 more (same weights, same data order)."""
    common = ["eval.every=0", "train.save_every=2", "drafter.feature_noise=0.0", "train.lr=1e-3",
              "train.schedule=constant"]  # a schedule over max_steps would differ between the two runs
    straight = tmp_path / "straight"
    main(load_config(tiny_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, straight, "train.max_steps=4", *common)))
    split = tmp_path / "split"
    main(load_config(tiny_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, split, "train.max_steps=2", *common)))
    main(load_config(tiny_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, split, "train.max_steps=4",
                               "train.resume=auto", *common)))
    from safetensors.torch import load_file

    a, b = load_file(str(straight / "step_4" / "model.safetensors")), load_file(str(split / "step_4" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_fixed_text_white_box_training_lowers_the_loss(tiny_target_dir, tiny_target, tiny_prompt_file, tmp_path):
    """{"text": ...} rows (documents the target did not write): every token of a document is learned from, with
    the target's own features and next-token distributions as labels; the loss falls and the drafter stays
    lossless."""
    from draftlab.data import ChatDataset, read_conversations

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    docs = [" ".join(words[(i + j) % len(words)] for j in range(24)) for i in range(40)]
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    conversations, stats = read_conversations(str(data))
    assert stats.kept == 40 and conversations[0] == [{"role": "assistant", "content": docs[0]}]
    row = ChatDataset(conversations[:1], tiny_target[1], 256)[0]
    content = len(tiny_target[1](docs[0], add_special_tokens=False)["input_ids"])
    assert content <= sum(row["loss_mask"]) <= content + 2  # the whole document (+ the turn's end tokens)

    out = tmp_path / "run"
    main(load_config(tiny_args(tiny_target_dir, str(data), tiny_prompt_file, out, "train.max_steps=40",
                               "train.lr=3e-3", "train.log_every=1", "tracking=jsonl", "eval.every=40",
                               "drafter.feature_noise=0.0")))
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 40 and sum(losses[-5:]) < 0.85 * sum(losses[:5]), losses
    report = json.loads((out / "step_40" / "eval.json").read_text())
    assert report["lossless"] is True and 1.0 <= report["acceptance_length"] <= 5.0
