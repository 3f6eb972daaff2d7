"""DeepSpeed ZeRO-2 / ZeRO-3 on two CPU processes (gloo), launched as a user does: `./launch.sh --cpu --deepspeed`.

Each run is compared with one process at the same global batch: same losses, same weights (to float tolerance),
the same in-loop tau; the optimizer state is sharded (each rank holds half); `train.resume=auto` from a ZeRO
checkpoint ends bit-identical; `draftlab eval` scores the checkpoint. The first launch on a machine JIT-compiles
DeepSpeed's shared-memory comm op (about 2 minutes; cached in ~/.cache/torch_extensions, `.ci/run` builds it first).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftlab import checkpoint as ckpt
from draftlab.config import load_config
from draftlab.train import main

pytest.importorskip("deepspeed", reason="the `deepspeed` extra is not installed: pip install -e \".[deepspeed]\"")

ROOT = Path(__file__).resolve().parents[1]
DS_DIR = "deepspeed/zero"  # DeepSpeed's own checkpoint inside a step folder (train.DEEPSPEED_DIR / DEEPSPEED_TAG)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """./launch.sh ARGS with two CPU processes on a free port (one retry if the port was taken meanwhile)."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    base.pop("ACCELERATE_USE_CPU", None)
    base.update(env or {})
    for _ in range(2):
        base["MASTER_PORT"] = str(free_port())
        proc = subprocess.run(["bash", str(ROOT / "launch.sh"), *args], env=base, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode == 0 or "ddress already in use" not in proc.stderr:
            return proc
    return proc


def train_args(target_dir, data, prompts, out_dir, *extra) -> list[str]:
    return ["recipe=eagle_head", f"target.path={target_dir}", f"data.train={data}", f"out_dir={out_dir}",
            f"data.eval_prompts={prompts}", "eval.every=2", "eval.num_prompts=4", "eval.max_new_tokens=12",
            "eval.draft_length=3", "eval.tree=chain", "tracking=jsonl", "train.keep_last=0", "data.max_length=96",
            "drafter.feature_noise=0.0", "train.lr=2e-3", "train.warmup_steps=1", "train.schedule=cosine",
            "train.log_every=1", "train.max_steps=4", "train.grad_accum=2", *extra]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / f"step_{step}" / ckpt.WEIGHTS_NAME))


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path_factory):
    """One process with the global batch of the two-process runs (2 processes x batch 2 -> batch 4)."""
    out = tmp_path_factory.mktemp("one") / "run"
    main(load_config(train_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, out, "train.batch_size=4")))
    return out


@pytest.fixture(scope="module", params=["zero2", "zero3"])
def zero_run(request, tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path_factory):
    """(stage, run folder): ./launch.sh --cpu --deepspeed zeroN, two processes x batch 2, 4 steps, eval at 2 and 4."""
    stage = request.param
    out = tmp_path_factory.mktemp(stage) / "run"
    proc = launch("--cpu", "--deepspeed", stage,
                  *train_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, out, "train.batch_size=2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    return int(stage[-1]), out


def test_a_real_deepspeed_group_of_two(zero_run):
    stage, out = zero_run
    info = json.loads((out / "run_info.json").read_text())
    info = info[-1] if isinstance(info, list) else info
    assert info["world_size"] == 2 and info["distributed_type"] == "DEEPSPEED" and info["zero_stage"] == stage
    assert [r["world_size"] for r in rows(out) if "loss" in r] == [2, 2, 2, 2]


def test_same_losses_and_weights_as_one_process(zero_run, one_process):
    _, out = zero_run
    for step in (2, 4):
        assert max_abs_diff(weights(out, step), weights(one_process, step)) < 1e-4
    two = [r for r in rows(out) if "loss" in r]
    one = [r for r in rows(one_process) if "loss" in r]
    assert len(two) == len(one) == 4
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)  # not 2x: the loss is reduced over 2 ranks once
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)


def test_in_loop_evaluation_scores_the_same_drafter(zero_run, one_process):
    """Under ZeRO-3 the main process speculates with a whole copy of the sharded drafter; under ZeRO-2 with its own
    replica. Either way each checkpoint's eval.json equals the one-process run's (same weights, greedy)."""
    _, out = zero_run
    for step in (2, 4):
        two = json.loads((out / f"step_{step}" / "eval.json").read_text())
        one = json.loads((one_process / f"step_{step}" / "eval.json").read_text())
        assert two["lossless"] is True and one["lossless"] is True
        assert two["acceptance_length"] == pytest.approx(one["acceptance_length"])
        assert two["per_position_acceptance"] == pytest.approx(one["per_position_acceptance"])
    assert (out / "best").read_text().strip() == (one_process / "best").read_text().strip()


def test_optimizer_state_is_sharded(zero_run):
    """Each rank's file holds its own half of the fp32 master weights (and Adam's moments beside them)."""
    _, out = zero_run
    total = sum(t.numel() for t in weights(out, 4).values())
    held = []
    for rank in (0, 1):
        state = torch.load(out / "step_4" / DS_DIR / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                           map_location="cpu", weights_only=False)["optimizer_state_dict"]
        groups = state.get("single_partition_of_fp32_groups") or state.get("fp32_flat_groups")
        held.append(sum(t.numel() for t in groups))
    assert sum(held) >= total
    assert all(n <= total // 2 + 64 for n in held), (held, total)  # half each (plus alignment padding)


def test_resume_from_a_zero_checkpoint_is_bit_identical(zero_run, tiny_target_dir, tiny_chat_file,
                                                        tiny_prompt_file, tmp_path):
    """The run as if it had stopped after step 2, resumed with train.resume=auto: step 4 is the same, bit for bit."""
    stage, out = zero_run
    split = tmp_path / "run"
    shutil.copytree(out, split)
    shutil.rmtree(split / "step_4")
    (split / "best").write_text("step_2\n")
    proc = launch("--cpu", "--deepspeed", f"zero{stage}",
                  *train_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, split, "train.batch_size=2",
                              "train.resume=auto"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout
    assert max_abs_diff(weights(split, 4), weights(out, 4)) == 0.0
    assert [r["loss"] for r in rows(split) if "loss" in r] == [r["loss"] for r in rows(out) if "loss" in r]


def test_draftlab_eval_scores_a_zero_checkpoint(zero_run, tiny_prompt_file, tmp_path):
    _, out = zero_run
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "draftlab.cli", "eval", "--checkpoint", str(out / "step_4"),
                           "--prompts", tiny_prompt_file, "--out", str(report), "--draft-length", "3",
                           "--max-new-tokens", "12", "--num-prompts", "4"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.loads(report.read_text())
    in_loop = json.loads((out / "step_4" / "eval.json").read_text())
    assert scored["lossless"] is True
    assert scored["acceptance_length"] == pytest.approx(in_loop["acceptance_length"])


def test_a_deepspeed_launch_that_would_train_as_ddp_stops_with_one_line(tiny_target_dir, tiny_chat_file,
                                                                      tiny_prompt_file, tmp_path):
    """ACCELERATE_USE_CPU=true makes accelerate skip DeepSpeed: refused before training, nothing written."""
    out = tmp_path / "run"
    proc = launch("--cpu", "--deepspeed", "zero2",
                  *train_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, out, "train.batch_size=2"),
                  env={"ACCELERATE_USE_CPU": "true"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("draftlab: error:")]
    assert len(errors) == 1 and "ACCELERATE_USE_CPU" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not list(out.glob("step_*"))


@pytest.mark.parametrize("kind_args", [
    ["recipe=eagle3_head", "drafter.ttt_steps=2", "train.pack_tokens=0"],
    ["recipe=distill_offline_blackbox", "data.regenerate_from=''", "drafter.num_layers=1"],
], ids=["eagle3", "small_lm"])
def test_other_kinds_train_under_zero3_like_one_process(kind_args, tiny_target_dir, tiny_chat_file, tiny_prompt_file,
                                                        tmp_path):
    """EAGLE-3 (three fused target layers) and a small LM (its own model, the target's embeddings copied in): the
    target they read stays whole, their own weights are sharded, and they end where one process ends."""
    def run_args(out, batch):
        common = train_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, out, f"train.batch_size={batch}")
        return [*kind_args, *(a for a in common[1:] if not a.startswith("drafter."))]  # in place of eagle_head's
    proc = launch("--cpu", "--deepspeed", "zero3", *run_args(tmp_path / "zero3", 2))
    assert proc.returncode == 0, proc.stderr[-4000:]
    main(load_config(run_args(tmp_path / "one", 4)))
    for step in (2, 4):
        assert max_abs_diff(weights(tmp_path / "zero3", step), weights(tmp_path / "one", step)) < 1e-4
        ev = json.loads((tmp_path / "zero3" / f"step_{step}" / "eval.json").read_text())
        assert ev["lossless"] is True
        assert ev["acceptance_length"] == pytest.approx(
            json.loads((tmp_path / "one" / f"step_{step}" / "eval.json").read_text())["acceptance_length"])
