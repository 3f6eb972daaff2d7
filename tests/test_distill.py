"""Distillation losses of the small_lm drafter: normalisation, teacher sources, on-policy rollouts reaching
the teacher, and each of the four modes training on the tiny target and being scored losslessly."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftlab.drafters import load_drafter
from draftlab.drafters.small_lm import SmallLM, continue_prompts, prompt_part

MODES = ["offline_blackbox", "offline_whitebox", "online_whitebox", "online_blackbox"]


def _drafter(target, tok, seed: int = 0, **kw) -> SmallLM:
    torch.manual_seed(seed)
    return SmallLM.from_target(target, SimpleNamespace(**{"num_layers": 1, "rollout_tokens": 12, **kw}), tok)


@pytest.fixture(scope="module")
def answered(tiny_target, tiny_prompt_file, tmp_path_factory):
    """A batch of 8 conversations whose replies the tiny target wrote itself (greedy), as collated tensors."""
    from draftlab.answers import answer_prompts
    from draftlab.data import ChatDataset, collate, load_prompts, read_conversations

    model, tok = tiny_target
    path = str(tmp_path_factory.mktemp("answers") / "answers.jsonl")
    answer_prompts(model, tok, load_prompts(tiny_prompt_file), path, max_new_tokens=16, batch_size=8, progress=False)
    conversations, _ = read_conversations(path)
    dataset = ChatDataset(conversations, tok, 96)
    return collate([dataset[i] for i in range(len(dataset))], tok.pad_token_id)


def with_teacher_topk(target, batch: dict, k: int) -> dict:
    """What the offline store adds to a batch: the target's top-k log-probabilities at every position."""
    with torch.no_grad():
        logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = logits.float().log_softmax(-1)
    top = logp.topk(k, dim=-1)
    return {**batch, "teacher_topk_ids": top.indices, "teacher_topk_logprobs": top.values,
            "teacher_tail_mass": (1 - top.values.exp().sum(-1)).clamp(min=0)}


def _padded(batch: dict, extra: int, pad_id: int) -> dict:
    """The batch repeated twice along B and right-padded by `extra` masked columns."""
    out = {}
    for key, value in batch.items():
        value = torch.cat([value, value])
        pad = torch.zeros(*value.shape[:1], extra, *value.shape[2:], dtype=value.dtype)
        if key == "input_ids":
            pad.fill_(pad_id)
        out[key] = torch.cat([value, pad], 1)
    return out


@pytest.mark.parametrize("loss", ["fkl", "rkl", "jsd", "tvd"])
def test_divergence_is_a_mean_over_valid_tokens(tiny_target, answered, loss):
    model, tok = tiny_target
    k = 16
    batch = with_teacher_topk(model, answered, k)
    drafter = _drafter(model, tok, distill_mode="offline_whitebox", distill_loss=loss, teacher_topk=k).eval()
    with torch.no_grad():
        one, metrics = drafter.loss(batch)
        two, metrics2 = drafter.loss(_padded(batch, 5, tok.pad_token_id))
    torch.testing.assert_close(one, two, atol=1e-5, rtol=1e-5)
    assert metrics2["tokens"] == 2 * metrics["tokens"] and 0 <= metrics["accept_est"] <= 1
    # one valid token only: the loss is that token's divergence, not divided by the batch size or length
    single = {key: v[:1] for key, v in batch.items()}
    keep = torch.zeros_like(single["loss_mask"])
    pos = int(single["loss_mask"][0].nonzero()[3])
    keep[0, pos] = 1
    with torch.no_grad():
        alone, m = drafter.loss({**single, "loss_mask": keep})
        from draftlab.losses import DIVERGENCES, sparse_teacher_probs

        logits = drafter(single["input_ids"])[:, pos - 1:pos]
        probs = sparse_teacher_probs(*(single[n][:, pos - 1:pos] for n in ("teacher_topk_ids", "teacher_topk_logprobs",
                                                                           "teacher_tail_mass")), drafter.vocab_size)
        direct = DIVERGENCES[loss](logits, None, torch.ones(1, 1), teacher_probs=probs)
    assert m["tokens"] == 1
    torch.testing.assert_close(alone, direct)


def test_full_topk_store_equals_the_online_teacher(tiny_target, answered):
    """With k = V (no tail) the offline white-box loss is the online one on the dataset's tokens."""
    model, tok = tiny_target
    for loss in ("fkl", "tvd"):
        offline = _drafter(model, tok, distill_mode="offline_whitebox", distill_loss=loss, teacher_topk=len(tok))
        online = _drafter(model, tok, distill_mode="online_whitebox", distill_loss=loss, student_ratio=0.0)
        online.load_state_dict(offline.state_dict())
        with torch.no_grad():
            a, _ = offline.loss(with_teacher_topk(model, answered, model.config.vocab_size))
            b, m = online.loss(answered)
        assert m["on_policy"] == 0.0
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_student_ratio_mixes_on_policy_and_dataset_steps(tiny_target, answered):
    model, tok = tiny_target
    drafter = _drafter(model, tok, distill_mode="online_whitebox", student_ratio=0.5, rollout_tokens=4)
    torch.manual_seed(0)
    with torch.no_grad():
        flags = [drafter.loss(answered)[1]["on_policy"] for _ in range(12)]
    assert 0 < sum(flags) < len(flags), flags


def test_offline_whitebox_without_a_store_says_how_to_fix(tiny_target, answered):
    model, tok = tiny_target
    drafter = _drafter(model, tok, distill_mode="offline_whitebox")
    assert drafter.teacher_topk == 20  # the training loop asks the store for top-20 log-probabilities
    with pytest.raises(ValueError, match="data.store"):
        drafter.loss(answered)


def _record_inputs(module, calls: list):
    return module.register_forward_hook(lambda mod, args, kwargs, out: calls.append(kwargs["input_ids"].clone()),
                                        with_kwargs=True)


def test_on_policy_tokens_are_what_the_teacher_scores(tiny_target, answered):
    model, tok = tiny_target
    drafter = _drafter(model, tok, distill_mode="online_whitebox", student_ratio=1.0)
    student_calls, teacher_calls = [], []
    hooks = [_record_inputs(drafter.model, student_calls), _record_inputs(model, teacher_calls)]
    try:
        torch.manual_seed(5)
        loss, metrics = drafter.loss(answered)
    finally:
        for h in hooks:
            h.remove()
    loss.backward()
    assert metrics["on_policy"] == 1.0 and torch.isfinite(loss)
    assert len(teacher_calls) == 1                                     # one scoring forward, no teacher sampling
    prompts, _ = prompt_part(answered, drafter.pad_id)
    width = prompts.shape[1]
    fed_back = torch.cat([c for c in student_calls if c.shape[1] == 1], 1)   # the student's own sampled tokens
    scored = teacher_calls[0]
    assert torch.equal(scored[:, :width], prompts)
    assert torch.equal(scored[:, width:width + fed_back.shape[1]], fed_back)
    assert torch.equal(student_calls[-1], scored)                      # the student is trained on the same tokens
    # they are the student's tokens, not the dataset's (the target's greedy reply)
    data_reply = [row[m.bool()][:fed_back.shape[1]] for row, m in zip(answered["input_ids"], answered["loss_mask"])]
    assert any(not torch.equal(r, f[:len(r)]) for r, f in zip(data_reply, fed_back))


def test_online_blackbox_learns_the_targets_own_answer(tiny_target, answered):
    from draftlab.evaluator import target_generate

    model, tok = tiny_target
    drafter = _drafter(model, tok, distill_mode="online_blackbox")
    calls = []
    hook = _record_inputs(drafter.model, calls)
    try:
        loss, metrics = drafter.loss(answered)
    finally:
        hook.remove()
    assert len(calls) == 1 and torch.isfinite(loss) and metrics["tokens"] > 0
    prompts, mask = prompt_part(answered, drafter.pad_id)
    for b in range(prompts.shape[0]):
        prompt = prompts[b][mask[b].bool()]
        reply = target_generate(model, prompt, 12, [tok.eos_token_id]).tokens
        assert calls[0][b, prompts.shape[1]:prompts.shape[1] + len(reply)].tolist() == reply


def test_left_padded_continuations_match_single_prompt_decoding(tiny_target, answered):
    from draftlab.evaluator import target_generate

    model, tok = tiny_target
    prompts, mask = prompt_part(answered, tok.pad_token_id)
    assert (mask.sum(1) < answered["attention_mask"].sum(1)).all() and mask[:, -1].all()
    new, new_mask = continue_prompts(model, prompts, mask, 8, [tok.eos_token_id], tok.pad_token_id, greedy=True)
    for b in range(0, prompts.shape[0], 2):
        ref = target_generate(model, prompts[b][mask[b].bool()], 8, [tok.eos_token_id]).tokens
        assert new[b][new_mask[b].bool()].tolist() == ref


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_trains_and_is_scored_losslessly(tiny_target, answered, tiny_prompt_file, mode):
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.evaluator import evaluate
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = tiny_target
    drafter = _drafter(model, tok, distill_mode=mode, student_ratio=1.0, teacher_topk=16).train()
    batch = with_teacher_topk(model, answered, 16) if mode == "offline_whitebox" else answered
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    torch.manual_seed(0)
    for _ in range(12):
        loss, _ = drafter.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses

    drafter.eval()
    prompts = [encode_prompt(tok, p.messages) for p in load_prompts(tiny_prompt_file, limit=2)]
    k = 3
    report = evaluate(model, drafter.proposer(model), prompts, spec=TreeSpec(kind="chain", draft_length=k),
                      sampling=Sampling(), max_new_tokens=12, eos_token_ids=[tok.eos_token_id], progress=False)
    assert report["lossless"] is True
    assert 1.0 <= report["acceptance_length"] <= k + 1


def test_dump_logits_store_is_the_offline_teacher(tiny_target, tiny_target_dir, tiny_chat_file, tmp_path, capsys):
    """data_prep/dump_logits.py writes the target's top-k + tail mass; read back through the store, it gives
    the same loss as top-k computed from the target in memory, and a rerun resumes instead of rewriting."""
    import importlib.util
    from pathlib import Path

    from draftlab.data import ChatDataset, collate, read_conversations
    from draftlab.store import open_store

    model, tok = tiny_target
    script = Path(__file__).parents[1] / "data_prep" / "dump_logits.py"
    spec = importlib.util.spec_from_file_location("dump_logits", script)
    dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dump)
    out = tmp_path / "store"
    args = ["--target", tiny_target_dir, "--data", tiny_chat_file, "--out", str(out), "--topk", "8",
            "--max-length", "96", "--limit", "6", "--no-progress", "--shard-tokens", "128"]
    assert dump.main(args) == 0
    shards = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*")}
    assert len(shards) > 1 and dump.main(args) == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*")} == shards
    assert dump.main([*args[:6], "--topk", "100000"]) == 2 and "vocabulary" in capsys.readouterr().err

    dataset = ChatDataset(read_conversations(tiny_chat_file, limit=6)[0], tok, 96)
    store = open_store(out, model, tokenizer=tok, dataset=dataset, feature_layers=(), topk_logits=8)
    rows = [0, 3, 5]
    batch = collate([dataset[r] for r in rows], tok.pad_token_id)
    from_disk = {**batch, **store.batch(rows, batch["input_ids"].shape[1])}
    drafter = _drafter(model, tok, distill_mode="offline_whitebox", teacher_topk=8).eval()
    with torch.no_grad():
        a, _ = drafter.loss(from_disk)
        b, _ = drafter.loss(with_teacher_topk(model, batch, 8))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# the recipes, end to end through train.main (tiny target, a few steps)


@pytest.mark.parametrize("recipe", ["distill_offline_blackbox", "distill_offline_whitebox", "distill_online_whitebox",
                                    "distill_online_blackbox", "distill_layer_skip"])
def test_recipe_trains_and_is_scored_losslessly(recipe, tiny_target, tiny_target_dir,
                                                tiny_prompt_file, tiny_chat_file, tmp_path):
    import json

    from draftlab.config import load_config
    from draftlab.train import main

    data = tmp_path / "answers.jsonl"
    online_blackbox = recipe == "distill_online_blackbox"
    cfg = load_config([f"recipe={recipe}", f"target.path={tiny_target_dir}", f"out_dir={tmp_path / 'run'}",
                       f"data.train={tiny_chat_file if online_blackbox else data}",
                       *([] if online_blackbox else [f"data.regenerate_from={tiny_prompt_file}"]),
                       "data.regenerate_max_new_tokens=12", f"data.eval_prompts={tiny_prompt_file}",
                       "data.max_length=96", "data.limit=8", "drafter.num_layers=1", "drafter.rollout_tokens=8",
                       "train.max_steps=2", "train.batch_size=4", "train.warmup_steps=0", "train.keep_last=0",
                       "eval.every=2", "eval.num_prompts=2", "eval.max_new_tokens=12", "eval.draft_length=3",
                       "tracking=none",
                       *(["drafter.target_layers=[1]", "eval.at_start=false"] if recipe == "distill_layer_skip" else [])])
    summary = main(cfg)
    report = json.loads((tmp_path / "run" / "step_2" / "eval.json").read_text())
    assert report["lossless"] is True and 1.0 <= report["acceptance_length"] <= 4.0
    assert summary["best_step"] == 2
    if recipe == "distill_offline_whitebox":
        store = json.loads((tmp_path / "answers.jsonl.top20" / "manifest.json").read_text())
        assert store["complete"] and store["topk_logits"] == 20 and store["layers"] == []
    drafter = load_drafter(tmp_path / "run", tiny_target[0])
    mode = "offline_blackbox" if recipe == "distill_layer_skip" else recipe.removeprefix("distill_")
    assert drafter.kind == "small_lm" and drafter.settings["distill_mode"] == mode
