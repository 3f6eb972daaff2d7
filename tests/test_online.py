"""Online updates from a round log (`draftlab serve-learn`): the gate never publishes a worse-scoring drafter, the
log is followed as it grows, batches put the logged top-k where the drafter predicts the verified tokens, and the
updates train small_lm and EAGLE heads."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from draftlab import online
from draftlab.checkpoint import resolve_checkpoint, save_drafter, trainable_state_dict
from draftlab.drafters.eagle import EagleHead
from draftlab.drafters.small_lm import SmallLM
from draftlab.evaluator import evaluate
from draftlab.proposers import CausalLMProposer
from draftlab.rounds import RoundLog, read_rounds, sequences
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling


@pytest.fixture(scope="module")
def prompts(tiny_target):
    _, tok = tiny_target
    return [torch.tensor(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
                         ["input_ids"]) for t in ["The quick brown fox", "def add(a, b):", "Numbers: 0 1 2 3 4",
                                                  "Write a short poem about the sea"]]


@pytest.fixture(scope="module")
def served_log(tiny_target, prompts, tmp_path_factory):
    """A round log of four served prompts (the target as drafter: long accepted chains)."""
    model, _ = tiny_target
    path = tmp_path_factory.mktemp("served") / "rounds.jsonl"
    with RoundLog(path, topk=6) as log:
        evaluate(model, CausalLMProposer(model), prompts, spec=TreeSpec("chain", draft_length=3), sampling=Sampling(),
                 max_new_tokens=16, progress=False, log_rounds=log)
    return path


def test_conversations_rebuild_the_served_sequences(served_log):
    follower = online.LogFollower(served_log)
    convs = follower.finish()
    seqs = sequences(read_rounds(served_log))
    assert [c.ids for c in convs] == [seqs[i] for i in range(len(seqs))]
    for c in convs:
        assert len(c.verified) == len(c.topk_ids) and c.verified == sorted(c.verified)
        assert [ids[0] for ids in c.topk_ids] == [c.ids[v] for v in c.verified]     # greedy: the argmax was emitted


def test_the_follower_reads_a_growing_log_and_waits_for_whole_lines(served_log, tmp_path):
    lines = served_log.read_text().splitlines(keepends=True)
    live = tmp_path / "live.jsonl"
    follower = online.LogFollower(live)
    assert follower.poll() == []                                    # no file yet
    firsts = [i for i, line in enumerate(lines) if json.loads(line)["round"] == 0]
    live.write_text("".join(lines[:firsts[1]]) + lines[firsts[1]][:20])   # prompt 0 and half a row of prompt 1
    assert follower.poll() == []                                    # prompt 0 is complete only once prompt 1 starts
    with open(live, "a") as f:
        f.write(lines[firsts[1]][20:] + "".join(lines[firsts[1] + 1:]))
    got = follower.poll()
    assert [c.prompt for c in got] == [0, 1, 2]                      # the last prompt may still be decoding
    got += follower.finish()
    assert [c.prompt for c in got] == [0, 1, 2, 3]


def test_the_batch_puts_the_logged_top_k_before_each_verified_token(served_log):
    convs = online.LogFollower(served_log).finish()[:2]
    batch = online.make_batch(convs, pad_id=0, topk=True, device="cpu")
    for b, c in enumerate(convs):
        assert batch["loss_mask"][b].nonzero().flatten().tolist() == c.verified
        for v, ids in zip(c.verified, c.topk_ids):
            assert batch["teacher_topk_ids"][b, v - 1].tolist() == ids
    assert (batch["teacher_tail_mass"] >= 0).all() and (batch["teacher_tail_mass"] <= 1).all()


class Scripted:
    """A scoring function that returns the given taus in turn."""

    def __init__(self, taus):
        self.taus = list(taus)

    def __call__(self, drafter):
        return self.taus.pop(0)


def test_an_update_never_replaces_the_checkpoint_by_a_worse_scoring_one(tiny_target, served_log, tmp_path):
    model, _ = tiny_target
    drafter = EagleHead.from_target(model, None)
    convs = online.LogFollower(served_log).finish()
    learner = online.OnlineLearner(drafter, model, tmp_path / "run", Scripted([1.5, 1.2, 1.6, 1.55, 1.6]),
                                   online.OnlineConfig(lr=1e-3, update_every=1, steps=1, batch_size=2))
    published = {k: v.clone() for k, v in trainable_state_dict(drafter).items()}
    history = []
    for conv in convs:
        before = (tmp_path / "run" / "best").read_text()
        learner.add([conv])
        record = json.loads((tmp_path / "run" / "online.jsonl").read_text().splitlines()[-1])
        history.append((record["candidate_tau"], record["kept"]))
        state = trainable_state_dict(drafter)
        if record["kept"]:
            published = {k: v.clone() for k, v in state.items()}
            assert (tmp_path / "run" / "best").read_text() == f"step_{record['update']}"
        else:      # rejected: the weights are the published ones again and `best` did not move
            assert all(torch.equal(state[k], published[k]) for k in published)
            assert (tmp_path / "run" / "best").read_text() == before
    assert history == [(1.2, False), (1.6, True), (1.55, False), (1.6, True)]
    best = resolve_checkpoint(tmp_path / "run")
    assert best.name == "step_4" and json.loads((best / "eval.json").read_text())["acceptance_length"] == 1.6
    assert not (tmp_path / "run" / "step_1").exists() and not (tmp_path / "run" / "step_3").exists()


def test_a_resumed_learner_ends_where_an_uninterrupted_one_does(tiny_target, served_log, tmp_path):
    """Stopped after two updates and rerun on the same log (read from its start again), the learner skips what it
    consumed, refills its replay buffer from it and ends with the same weights, updates and published step."""
    model, _ = tiny_target
    convs = online.LogFollower(served_log).finish()
    cfg = online.OnlineConfig(lr=1e-3, update_every=1, steps=2, batch_size=2, replay=2)
    source = {"rounds": str(served_log), "checkpoint": "step_0"}
    taus = [1.5, 1.2, 1.6, 1.55, 1.6]

    def head():                                                     # the same served drafter each time
        torch.manual_seed(0)
        return EagleHead.from_target(model, None)

    whole = online.OnlineLearner(head(), model, tmp_path / "whole", Scripted(taus), cfg, source=source)
    whole.add(convs)
    first = online.OnlineLearner(head(), model, tmp_path / "split", Scripted(taus[:3]), cfg, source=source)
    first.add(convs[:2])                                            # stopped here
    torch.manual_seed(1)
    drafter = EagleHead.from_target(model, None)                    # whatever it starts from: the published weights
    second = online.OnlineLearner(drafter, model, tmp_path / "split", Scripted(taus[3:]), cfg, source=source)
    assert (second.updates, second.seen, second.current_tau) == (2, 2, 1.6)
    second.add(convs)
    assert (second.updates, second.seen) == (whole.updates, whole.seen) == (4, 4)
    assert [c.prompt for c in second.buffer] == [c.prompt for c in whole.buffer]
    state, expected = trainable_state_dict(drafter), trainable_state_dict(whole.drafter)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert (tmp_path / "split" / "best").read_text() == (tmp_path / "whole" / "best").read_text() == "step_4"
    records = [json.loads(line) for line in (tmp_path / "split" / "online.jsonl").read_text().splitlines()]
    assert [r["update"] for r in records] == [1, 2, 3, 4]          # no update twice on the same rows
    with pytest.raises(online.ConfigError, match="learns from round log"):
        online.OnlineLearner(drafter, model, tmp_path / "split", Scripted([]), cfg,
                             source={**source, "rounds": str(tmp_path / "other.jsonl")})
    with pytest.raises(online.DataError, match="not the ones"):       # same path, other conversations
        resumed = online.OnlineLearner(drafter, model, tmp_path / "split", Scripted([]), cfg, source=source)
        resumed.add(convs[1:] + convs[:1])


@pytest.mark.parametrize("kind", ["small_lm", "eagle"])
def test_real_updates_train_and_the_published_tau_never_falls(kind, tiny_target, served_log, prompts, tmp_path):
    model, tok = tiny_target
    drafter = SmallLM.from_target(model, SimpleNamespace(num_layers=1), tok) if kind == "small_lm" \
        else EagleHead.from_target(model, None)
    convs = online.LogFollower(served_log).finish()
    taus = []

    def score(d):
        taus.append(online.measured_tau(model, d, prompts[:2], 3, 12))
        return taus[-1]

    batch = online.make_batch(convs, 0, kind == "small_lm", "cpu")
    first, _ = online.update_loss(drafter, model, batch)
    learner = online.OnlineLearner(drafter, model, tmp_path / "run", score,
                                   online.OnlineConfig(lr=3e-3, update_every=2, steps=6, batch_size=2))
    learner.add(convs)
    last, _ = online.update_loss(drafter, model, batch)
    records = [json.loads(line) for line in (tmp_path / "run" / "online.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["loss_last"] < r["loss_first"] for r in records)
    published = [taus[0]] + [r["candidate_tau"] for r in records if r["kept"]]
    assert published == sorted(published) and learner.current_tau == published[-1]
    assert online.measured_tau(model, drafter, prompts[:2], 3, 12) == pytest.approx(learner.current_tau)
    if any(r["kept"] for r in records):
        assert last.item() < first.item()


def test_serve_learn_cli_and_its_bad_input(tiny_target, tiny_target_dir, tiny_prompt_file, served_log, tmp_path):
    model, _ = tiny_target
    ckpt = save_drafter(EagleHead.from_target(model, None), tmp_path / "step_0")
    run = lambda *a: subprocess.run([sys.executable, "-m", "draftlab.cli", "serve-learn", "--checkpoint", str(ckpt),
                                     "--target", tiny_target_dir, "--heldout", tiny_prompt_file, *a],
                                    capture_output=True, text=True, timeout=300)
    # the recipe (it follows the log: --no-follow reads what is there), its values overridden where given
    proc = run("--recipe", "serve_learn", "--no-follow", "--rounds", str(served_log), "--out", str(tmp_path / "learn"),
               "--num-heldout", "2", "--max-new-tokens", "8", "--update-every", "2", "--steps", "1",
               "--draft-length", "3")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "learn" / "best").is_file() and "published" in proc.stdout
    exported = subprocess.run([sys.executable, "-m", "draftlab.cli", "push", str(tmp_path / "learn"), "--target",
                               tiny_target_dir, "--to", str(tmp_path / "export")], capture_output=True, text=True,
                              timeout=300)
    assert exported.returncode == 0, exported.stderr
    meta = json.loads((tmp_path / "export" / "export.json").read_text())
    assert meta["kind"] == "eagle" and meta["step"] == (tmp_path / "learn" / "best").read_text().strip()
    assert len((tmp_path / "learn" / "online.jsonl").read_text().splitlines()) == 2
    again = run("--rounds", str(served_log), "--out", str(tmp_path / "learn"), "--num-heldout", "2",
                "--max-new-tokens", "8", "--update-every", "2", "--steps", "1", "--draft-length", "3")
    assert again.returncode == 0 and "continued after 2 updates on 4 conversations" in again.stdout, again.stderr
    assert len((tmp_path / "learn" / "online.jsonl").read_text().splitlines()) == 2    # nothing new to learn from
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a serve-learn folder")
    copy = tmp_path / "copy.jsonl"
    copy.write_text(served_log.read_text())
    for args, says in ((["--rounds", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x")], "not found"),
                       (["--rounds", str(copy), "--out", str(tmp_path / "learn")], "learns from round log"),
                       (["--rounds", str(served_log), "--out", str(tmp_path / "other")], "not a serve-learn folder"),
                       (["--rounds", str(served_log), "--out", str(tmp_path / "y"), "--replay-share", "2"], "replay")):
        bad = run(*args)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
        assert says in bad.stderr
