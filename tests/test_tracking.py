"""What a run records: metrics.jsonl (always), run_info.json (git revision, world), tensorboard and offline wandb
(config, tau and per-position acceptance at each evaluation), and the throughput numbers: real tokens/s, padding
share, peak memory, with and without length-bucketed batches."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab import runtime
from draftlab.config import load_config, load_saved
from draftlab.train import main

ROOT = Path(__file__).resolve().parents[1]
K = 3  # eval.draft_length


def args(target_dir, data, prompts, out_dir, *extra):
    return ["recipe=eagle_head", f"target.path={target_dir}", f"data.train={data}", f"data.eval_prompts={prompts}",
            f"out_dir={out_dir}", "eval.every=2", "eval.num_prompts=2", "eval.max_new_tokens=8",
            f"eval.draft_length={K}", "train.batch_size=4", "train.grad_accum=1", "train.max_steps=4",
            "train.log_every=1", "data.max_length=96", "train.warmup_steps=0", "train.keep_last=0", *extra]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def jsonl_run(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("jsonl") / "run"
    main(load_config(args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, out, "tracking=jsonl")))
    return out


@pytest.fixture(scope="module")
def tracked_run(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("WANDB_MODE", "offline")  # no network: wandb writes its run files locally
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    out = tmp_path_factory.mktemp("tracked") / "run"
    main(load_config(args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, out, "tracking=tensorboard,wandb")))
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_metrics_jsonl_has_training_and_throughput_rows(jsonl_run):
    train_rows = [r for r in rows(jsonl_run) if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    for r in train_rows:
        assert r["world_size"] == 1 and r["lr"] > 0
        assert r["train_tokens_per_second"] > 0 and r["train_tokens"] > 0
        assert r["train_seconds"] > 0 and r["train_cpu_seconds"] >= 0
        assert 0.0 <= r["padding_share"] < 1.0
        assert r["peak_rss_mb"] > 0
    assert not (jsonl_run / "tensorboard").exists() and not (jsonl_run / "wandb").exists()


def test_each_evaluation_logs_tau_and_per_position_acceptance(jsonl_run):
    evals = [r for r in rows(jsonl_run) if "eval/acceptance_length" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert 1.0 <= r["eval/acceptance_length"] <= K + 1
        assert len(r["eval/per_position_acceptance"]) == K
        assert all(0.0 <= a <= 1.0 for a in r["eval/per_position_acceptance"])


def test_run_info_records_git_revision_and_world(jsonl_run):
    info = json.loads((jsonl_run / "run_info.json").read_text())
    sha = info["git_revision"]
    if (ROOT / ".git").exists():
        assert len(sha) == 40 and isinstance(info["git_dirty"], bool)
        # a commit of this repository (others may have committed since, so not necessarily HEAD)
        check = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", sha, "HEAD"])
        assert check.returncode == 0
    assert info["world_size"] == 1 and info["torch"] == torch.__version__
    assert len(info["launches"]) == 1


def test_saved_config_records_world_size_and_still_loads(jsonl_run, tiny_target_dir):
    text = (jsonl_run / "config.yaml").read_text()
    assert "# world_size: 1" in text
    again = load_saved(jsonl_run / "config.yaml")  # the comment keeps it a valid config
    assert again.target.path == tiny_target_dir and again.eval.draft_length == K


def test_tracking_none_still_writes_metrics_jsonl(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path):
    out = tmp_path / "run"
    main(load_config(args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, out, "tracking=none", "eval.every=0",
                          "train.max_steps=2")))
    assert [r["step"] for r in rows(out)] == [1, 2]


def test_tensorboard_scalars(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked_run / "tensorboard" / "draftlab"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss", "lr", "train_tokens_per_second", "padding_share", "eval/acceptance_length",
                *(f"eval/per_position_acceptance/{i}" for i in range(1, K + 1))):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in acc.Scalars("eval/acceptance_length")] == [2, 4]


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline wandb run file (LevelDB log framing: 32 KiB blocks, 7-byte record
    headers crc32/length/type, records split across blocks as FIRST/MIDDLE/LAST; a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, parts, out, block = path.read_bytes(), 7, b"", [], 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too small for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def test_wandb_offline_run_has_config_git_and_eval_curves(tracked_run):
    files = list((tracked_run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    records = wandb_records(files[0])
    config = {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for item in r.config.update}
    info = json.loads((tracked_run / "run_info.json").read_text())
    assert config["git_revision"] == info["git_revision"] and config["world_size"] == 1
    assert config["train.batch_size"] == 4 and config["eval.draft_length"] == K
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    logged = set().union(*history)
    assert {"loss", "train_tokens_per_second", "eval/acceptance_length",
            *(f"eval/per_position_acceptance/{i}" for i in range(1, K + 1))} <= logged
    taus = [h["eval/acceptance_length"] for h in history if "eval/acceptance_length" in h]
    assert len(taus) == 2 and all(1 <= t <= K + 1 for t in taus)


# --- throughput: length-bucketed batches -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_lengths(tmp_path_factory):
    """Conversations of very different lengths (1 to 8 sentences), where padding costs most."""
    from conftest import CORPUS

    path = tmp_path_factory.mktemp("mixed") / "mixed.jsonl"
    with open(path, "w") as f:
        for i in range(48):
            reply = " ".join(CORPUS[(i + j) % 6] for j in range(1 + i % 8))
            f.write(json.dumps({"messages": [{"role": "user", "content": "Say it."},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return str(path)


def test_bucketing_cuts_padding(tiny_target_dir, mixed_lengths, tiny_prompt_file, tmp_path):
    share = {}
    for bucketed in (False, True):
        out = tmp_path / f"b{int(bucketed)}"
        main(load_config(args(tiny_target_dir, mixed_lengths, tiny_prompt_file, out, "eval.every=0",
                              "tracking=jsonl", "data.max_length=256", "train.max_steps=4",
                              f"train.bucketed={str(bucketed).lower()}")))
        train_rows = [r for r in rows(out) if "padding_share" in r]
        share[bucketed] = sum(r["padding_share"] for r in train_rows) / len(train_rows)
    assert share[True] < share[False] / 2, share


def test_bucketed_batches_cover_each_row_once_per_epoch_and_split_evenly(tiny_tokenizer, mixed_lengths):
    from draftlab.data import ChatDataset, read_conversations

    dataset = ChatDataset(read_conversations(mixed_lengths)[0], tiny_tokenizer, 256)
    world, bs = 2, 3
    ranks = [runtime.Batches(dataset, bs, world, r, seed=1, pad_token_id=0, bucketed=True) for r in range(world)]
    assert ranks[0].bucketed and ranks[0].per_epoch == len(dataset) // (bs * world)
    seen = []
    for step in range(ranks[0].per_epoch):
        shares = [b.indices(step) for b in ranks]
        assert all(len(s) == bs for s in shares) and not set(shares[0]) & set(shares[1])
        seen += shares[0] + shares[1]
        lengths = [dataset.lengths[i] for s in shares for i in s]
        # one global batch holds rows of similar length, dealt round-robin: no rank gets all the long ones
        assert abs(sum(dataset.lengths[i] for i in shares[0]) - sum(dataset.lengths[i] for i in shares[1])) \
            <= max(lengths) - min(lengths)
    assert len(seen) == len(set(seen))  # each row at most once per epoch
    # the data position alone fixes the batch: a fresh object at the same micro_step gives the same rows
    again = runtime.Batches(dataset, bs, world, 1, seed=1, pad_token_id=0, bucketed=True)
    assert again.indices(ranks[1].per_epoch + 2) == ranks[1].indices(ranks[1].per_epoch + 2)


def test_bucketed_resume_is_exact(tiny_target_dir, mixed_lengths, tiny_prompt_file, tmp_path):
    common = ["eval.every=0", "tracking=jsonl", "data.max_length=256", "train.save_every=2",
              "drafter.feature_noise=0.0", "train.schedule=constant", "train.bucketed=true"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    main(load_config(args(tiny_target_dir, mixed_lengths, tiny_prompt_file, straight, "train.max_steps=4", *common)))
    main(load_config(args(tiny_target_dir, mixed_lengths, tiny_prompt_file, split, "train.max_steps=2", *common)))
    main(load_config(args(tiny_target_dir, mixed_lengths, tiny_prompt_file, split, "train.max_steps=4",
                          "train.resume=auto", *common)))
    a = load_file(str(straight / "step_4" / ckpt.WEIGHTS_NAME))
    b = load_file(str(split / "step_4" / ckpt.WEIGHTS_NAME))
    for k in a:
        assert torch.equal(a[k], b[k]), k
