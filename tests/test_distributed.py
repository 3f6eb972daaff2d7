"""Several processes: a real two-process CPU (gloo) run against one process with the doubled batch, gradient
accumulation normalised by the step's global token count, gradient checkpointing, per-rank RNG streams."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab import runtime
from draftlab.config import load_config
from draftlab.train import main

ROOT = Path(__file__).resolve().parents[1]

# Runs train.main under `accelerate launch`, then every rank writes the weights it ended with (only the main
# process writes checkpoints, so this is how rank 1's replica is seen).
RANK_DUMP = """
import os, sys
sys.path.insert(0, {root!r})
from safetensors.torch import save_file
import draftlab.train as train
from draftlab import checkpoint as ckpt
from draftlab.config import load_config

built = []
init = train.DrafterLoss.__init__
def record(self, drafter):
    init(self, drafter)
    built.append(drafter)
train.DrafterLoss.__init__ = record
train.main(load_config(sys.argv[1:]))
rank = int(os.environ.get("RANK", "0"))
save_file(ckpt.trainable_state_dict(built[0]), os.path.join(os.environ["RANK_DIR"], f"rank{{rank}}.safetensors"))
"""


def args(target_dir, data, out_dir, *extra):
    return ["recipe=eagle_head", f"target.path={target_dir}", f"data.train={data}", f"out_dir={out_dir}",
            "eval.every=0", "tracking=jsonl", "train.keep_last=0", "data.max_length=96", "drafter.feature_noise=0.0",
            "train.lr=2e-3", "train.warmup_steps=1", "train.schedule=cosine", "train.log_every=1", *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two(tmp_path: Path, train_args: list[str]) -> subprocess.CompletedProcess:
    """`accelerate launch` with recipes/accelerate/cpu_ddp.yaml: two processes forming a gloo group."""
    script = tmp_path / "rank_dump.py"
    script.write_text(RANK_DUMP.format(root=str(ROOT)))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes" / "accelerate" / "cpu_ddp.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(script), *train_args]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "RANK_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    port = cmd.index("--main_process_port") + 1
    for _ in range(2):  # the free port can be taken by another process before the group binds it: retry once
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        if proc.returncode == 0 or not any(w in proc.stderr for w in NETWORK_ERRORS):
            return proc
        cmd[port] = str(free_port())
    return proc


NETWORK_ERRORS = ("EADDRINUSE", "Address already in use", "address already in use", "DistNetworkError",
                  "Connection reset", "Connection refused")


def assert_close_weights(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def two_process_run(tiny_target_dir, tiny_chat_file, tmp_path_factory):
    """2 processes x batch 2 x 2 micro-batches, 4 steps (a checkpoint at step 2 and 4)."""
    tmp = tmp_path_factory.mktemp("ddp")
    out = tmp / "run"
    proc = launch_two(tmp, args(tiny_target_dir, tiny_chat_file, out, "train.batch_size=2", "train.grad_accum=2",
                                "train.max_steps=4", "train.save_every=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, out


@pytest.fixture(scope="module")
def one_process_run(tiny_target_dir, tiny_chat_file, tmp_path_factory):
    """The same optimisation on one process with the doubled (here: 2 x 2 x 2 = 8 rows) batch."""
    out = tmp_path_factory.mktemp("single") / "run"
    main(load_config(args(tiny_target_dir, tiny_chat_file, out, "train.batch_size=8", "train.grad_accum=1",
                          "train.max_steps=4", "train.save_every=2")))
    return out


def test_two_processes_form_one_group(two_process_run):
    _, out = two_process_run
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["distributed_type"] == "MULTI_CPU"
    assert "# world_size: 2" in (out / "config.yaml").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer: the main process
    assert all(r["world_size"] == 2 for r in rows)


def test_ranks_end_with_identical_weights(two_process_run):
    tmp, out = two_process_run
    rank0, rank1 = load_file(str(tmp / "rank0.safetensors")), load_file(str(tmp / "rank1.safetensors"))
    assert_close_weights(rank0, rank1, rtol=0, atol=0)  # DDP keeps the replicas bit-identical
    saved = load_file(str(out / "step_4" / ckpt.WEIGHTS_NAME))
    assert_close_weights(saved, rank0, rtol=0, atol=0)


def test_two_processes_match_one_process_with_the_doubled_batch(two_process_run, one_process_run):
    tmp, out = two_process_run
    for step in ("step_2", "step_4"):
        two = load_file(str(out / step / ckpt.WEIGHTS_NAME))
        one = load_file(str(one_process_run / step / ckpt.WEIGHTS_NAME))
        assert_close_weights(two, one, rtol=1e-4, atol=2e-5)
    # same schedule (accelerate must not step it once per process) and same token-weighted loss
    two_rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    one_rows = [json.loads(line) for line in (one_process_run / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(two_rows, one_rows):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["padding_share"] >= 0 and b["padding_share"] >= 0


def test_each_rank_keeps_its_own_rng_stream(two_process_run):
    _, out = two_process_run
    state = ckpt.load_trainer_state(out / "step_4")
    assert state["world_size"] == 2 and len(state["rng"]) == 2
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])


def test_grad_accum_normalises_by_the_step_token_count(tiny_target_dir, tiny_chat_file, tmp_path):
    """4 rows x 2 micro-batches == 8 rows at once: the step's loss is the mean over all its valid tokens, not
    the mean of the two micro-batch means (the micro-batches hold different numbers of tokens here)."""
    common = ["train.max_steps=3", "train.save_every=3"]
    main(load_config(args(tiny_target_dir, tiny_chat_file, tmp_path / "accum", "train.batch_size=4",
                          "train.grad_accum=2", *common)))
    main(load_config(args(tiny_target_dir, tiny_chat_file, tmp_path / "whole", "train.batch_size=8",
                          "train.grad_accum=1", *common)))
    a = load_file(str(tmp_path / "accum" / "step_3" / ckpt.WEIGHTS_NAME))
    b = load_file(str(tmp_path / "whole" / "step_3" / ckpt.WEIGHTS_NAME))
    assert_close_weights(a, b, rtol=1e-4, atol=2e-5)


def test_micro_batches_differ_in_token_count(tiny_target, tiny_chat_file):
    """What makes the test above sensitive: a mean of micro-batch means would weight tokens unequally."""
    from draftlab.data import ChatDataset, read_conversations

    _, tok = tiny_target
    dataset = ChatDataset(read_conversations(tiny_chat_file)[0], tok, 96)
    batches = runtime.Batches(dataset, 4, 1, 0, seed=0, pad_token_id=tok.pad_token_id)
    counts = [int(batches.next()[1]["loss_mask"].sum()) for _ in range(6)]
    assert len(set(counts)) > 1, counts


def test_loss_weight_sums_to_world_over_a_step():
    """Sum over micro-batches and ranks of local_tokens x world / global_tokens = world, i.e. after DDP's average
    over ranks each token carries weight 1 / global_tokens."""
    world, per_rank = 3, [[5, 7], [1, 0], [4, 9]]
    total = sum(sum(r) for r in per_rank)
    weights = [runtime.loss_weight({"loss_mask": torch.ones(n)}, total, world) for r in per_rank for n in r]
    assert sum(weights) == pytest.approx(world)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_target):
    from draftlab.data import collate
    from draftlab.drafters import DRAFTERS
    from draftlab.drafters.eagle import EagleConfig
    from draftlab.target import target_features

    target, tok = tiny_target
    rows = [{"input_ids": tok(t)["input_ids"], "loss_mask": [0, 0] + [1] * (len(tok(t)["input_ids"]) - 2)}
            for t in ("The quick brown fox jumps.", "Speculative decoding drafts tokens and verifies them.")]
    batch = collate(rows, tok.pad_token_id)
    with torch.no_grad():
        out = target.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           output_hidden_states=True)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        drafter = DRAFTERS["eagle"].from_target(target, EagleConfig(feature_noise=0.0))
        if checkpointing:
            assert runtime.enable_gradient_checkpointing(drafter) >= 1
        drafter.train()
        feats = target_features(out.hidden_states, drafter.feature_layers)
        loss, _ = drafter.loss(batch, feats)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad})
    assert_close_weights(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_gradient_checkpointing_option_trains(tiny_target_dir, tiny_chat_file, tmp_path):
    summary = main(load_config(args(tiny_target_dir, tiny_chat_file, tmp_path / "gc", "train.batch_size=4",
                                    "train.max_steps=2", "train.gradient_checkpointing=true")))
    assert summary["steps"] == 2 and (tmp_path / "gc" / "step_2" / ckpt.WEIGHTS_NAME).is_file()


@pytest.mark.slow
def test_two_process_resume_restores_every_rank(tiny_target_dir, tiny_chat_file, tmp_path):
    """With feature noise on, each rank draws its own noise: 4 steps straight == 2 steps + resume for 2 more,
    which needs every rank's RNG stream back (not only the main process's)."""
    import shutil

    noisy = ["drafter.feature_noise=0.2", "train.batch_size=2", "train.max_steps=4", "train.save_every=2"]
    straight, split = tmp_path / "a", tmp_path / "b"
    straight.mkdir()
    done = launch_two(straight, args(tiny_target_dir, tiny_chat_file, straight / "run", *noisy))
    assert done.returncode == 0, done.stderr[-3000:]
    # the same run as if it had stopped after its step-2 checkpoint
    shutil.copytree(straight, split)
    shutil.rmtree(split / "run" / "step_4")
    again = launch_two(split, args(tiny_target_dir, tiny_chat_file, split / "run", *noisy, "train.resume=auto"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert_close_weights(load_file(str(straight / "run" / "step_4" / ckpt.WEIGHTS_NAME)),
                         load_file(str(split / "run" / "step_4" / ckpt.WEIGHTS_NAME)), rtol=0, atol=0)


def test_a_launch_whose_processes_did_not_form_its_group_is_one_line(monkeypatch):
    """Each rank alone (world 1 where the launcher started 2), or DeepSpeed asked for and plain DDP set up: refused
    before anything loads, naming what was asked and what was got."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from draftlab.config import ConfigError

    alone = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="started 2 processes but they did not form one group"):
        runtime.check_world(alone, None)
    ddp = SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU)
    runtime.check_world(ddp, None)
    with pytest.raises(ConfigError, match="DeepSpeed was asked for but accelerate set up MULTI_CPU"):
        runtime.check_world(ddp, "DeepSpeed")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert runtime.requested_sharding() == "DeepSpeed"
    monkeypatch.delenv("WORLD_SIZE")
    runtime.check_world(SimpleNamespace(num_processes=1, distributed_type=DistributedType.DEEPSPEED), "DeepSpeed")
