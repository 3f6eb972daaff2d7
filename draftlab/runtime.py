"""What the training loop needs from its surroundings: the accelerator, resumable batches, token counts for
global loss normalisation, RNG streams per rank, gradient checkpointing, memory, run info and trackers.

`train.py` reads top to bottom; the pieces here are the ones that are about *running* (processes, devices,
files, trackers) rather than about *training a drafter*.
"""
from __future__ import annotations

import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, ProjectConfiguration, gather_object

from draftlab.config import ConfigError, tracking_list


# ----------------------------------------------------------------------------------------------------------
# the accelerator


def make_accelerator(cfg, out_dir: Path) -> Accelerator:
    """Accelerator for this run: CPU (gloo when several processes) without a GPU, bf16 on GPUs that support it,
    DeepSpeed or FSDP when the launch asked for them (with or without GPUs), the requested trackers, tensorboard
    logs in out_dir/tensorboard. A launch whose processes did not form the group it asked for stops here."""
    mixed = cfg.train.mixed_precision
    gpu = torch.cuda.is_available()
    if mixed == "auto":
        mixed = "bf16" if gpu and torch.cuda.is_bf16_supported() else "no"
    if mixed == "bf16" and not gpu:
        from draftlab.target import warn_slow_cpu_bf16

        warn_slow_cpu_bf16("training autocasts", "train in float32 (train.mixed_precision=no)")
    sharded = requested_sharding()
    if sharded and env_flag("ACCELERATE_USE_CPU"):
        raise ConfigError(f"{sharded} was asked for, but ACCELERATE_USE_CPU=true makes accelerate skip it (it "
                          "would train as plain DDP): unset ACCELERATE_USE_CPU; DeepSpeed and FSDP find the CPU "
                          "and gloo by themselves when there is no GPU")
    trackers = [t for t in tracking_list(cfg) if t != "jsonl"]
    project = ProjectConfiguration(project_dir=str(out_dir), logging_dir=str(out_dir / "tensorboard"))
    # step_scheduler_with_optimizer=False: accelerate would otherwise step the schedule once per *process* at
    # every optimizer step (it assumes the data loader's batch grew with the world size), so a 2-process run
    # would decay its learning rate twice as fast as the same run on one process.
    # In-loop evaluation runs on the main process while the others wait at the next collective: allow it hours,
    # not the default 30 minutes, before a waiting rank gives up (a long evaluation on a large target is normal).
    # Without a GPU the group is gloo's. `cpu=True` would make accelerate skip DeepSpeed and FSDP without a word,
    # so a sharded launch keeps cpu=False: DeepSpeed then picks its CPU accelerator by itself.
    group = InitProcessGroupKwargs(timeout=timedelta(hours=3), backend="gloo" if sharded and not gpu else None)
    accelerator = Accelerator(cpu=not gpu and not sharded, mixed_precision=mixed, log_with=trackers or None,
                              project_config=project, step_scheduler_with_optimizer=False, kwargs_handlers=[group])
    check_world(accelerator, sharded)
    if sharded:  # DeepSpeed's collectives call torch APIs deprecated in favour of others, a warning at every call
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        # accelerate registers transformers' HfDeepSpeedConfig whenever the DeepSpeed plugin is selected, whatever
        # zero3_init_flag says; under ZeRO-3 every `from_pretrained` would then build its model inside
        # deepspeed.zero.Init, so the frozen target (and a small_lm drafter's base) would arrive as empty shards.
        # Nothing here is built partitioned: DeepSpeed partitions the drafter when `prepare` hands it over.
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        plugin.dschf = None
        ds = plugin.deepspeed_config  # our batches bypass accelerate's DataLoader: fill DeepSpeed's "auto" here
        ds["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
        # draftlab accumulates micro-batches itself: `accelerator.sync_gradients` marks the last one, which is
        # where DeepSpeed reduces and steps (its own loss division by the accumulation count stays at 1)
        ds["gradient_accumulation_steps"] = 1
        ds["train_batch_size"] = cfg.train.batch_size * accelerator.num_processes
        ds["gradient_clipping"] = cfg.train.grad_clip
    return accelerator


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def full_optimizer_state(model, optimizer) -> dict:
    """FSDP: the whole optimizer state, gathered to the main process (a collective; other ranks get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model, optimizer, weights: dict, optim_state: dict) -> None:
    """FSDP: the whole drafter weights (names without the wrapper's "drafter.") and optimizer state read by the
    main process, scattered to every rank's shards (a collective)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    scatter = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, {f"drafter.{k}": v for k, v in weights.items()}, options=scatter)
    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), optim_state, options=scatter)


def requested_sharding() -> str | None:
    """"DeepSpeed" or "FSDP" when the launcher asked for it (accelerate launch exports ACCELERATE_USE_DEEPSPEED /
    ACCELERATE_USE_FSDP from a DEEPSPEED / FSDP config; so can torchrun users), else None."""
    if env_flag("ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed"
    if env_flag("ACCELERATE_USE_FSDP"):
        return "FSDP"
    return None


def check_world(accelerator, sharded: str | None) -> None:
    """Stop with one line when the processes did not form the group the launcher started: each rank alone
    (world size 1 under a launcher of several processes), or DeepSpeed / FSDP asked for and not set up."""
    launched = int(os.environ.get("WORLD_SIZE") or accelerator.num_processes)  # torchrun and accelerate set it
    if accelerator.num_processes != launched:
        raise ConfigError(f"the launcher started {launched} processes but they did not form one group (accelerate "
                          f"sees {accelerator.num_processes}, {accelerator.distributed_type.value}): launch through "
                          "./launch.sh, or `accelerate launch` with a config from recipes/accelerate/")
    got = accelerator.distributed_type
    if sharded == "DeepSpeed" and got != DistributedType.DEEPSPEED or sharded == "FSDP" and got != DistributedType.FSDP:
        raise ConfigError(f"{sharded} was asked for but accelerate set up {got.value}: launch with ./launch.sh "
                          f"--{'deepspeed zero2|zero3' if sharded == 'DeepSpeed' else 'fsdp'}, or check that "
                          f"{'deepspeed' if sharded == 'DeepSpeed' else 'torch'} is installed "
                          "(pip install -e \".[deepspeed]\")")


def run_lock(out_dir: Path):
    """The lock that makes a run folder single-writer (see draftlab/runlock.py)."""
    from draftlab.runlock import LOCK_NAME, FolderLock

    return FolderLock(Path(out_dir) / LOCK_NAME, f"run folder {out_dir}",
                      "wait for that run to end (or stop it), or choose another out_dir (nothing was written)")


def lock_run_folder(out_dir: Path, accelerator):
    """Take the run folder's lock for the whole run (main process). Every process learns the outcome, so all of
    them stop with the same line naming the holder, or all go on. Returns the lock (None on other ranks)."""
    from accelerate.utils import broadcast_object_list

    from draftlab.runlock import LockError, stale_note

    lock, refused = None, None
    if accelerator.is_main_process:
        try:
            lock = run_lock(out_dir).acquire()
        except LockError as e:
            refused = str(e)
    if accelerator.num_processes > 1:
        refused = broadcast_object_list([refused])[0]
    if refused:
        raise LockError(refused)
    note = stale_note(lock) if lock is not None else None
    if note:
        print(note, flush=True)
    return lock


def is_deepspeed(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def zero_stage(accelerator) -> int:
    """The DeepSpeed ZeRO stage of this run (0 when DeepSpeed is not used)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return 0
    return int(accelerator.state.deepspeed_plugin.zero_stage)


def is_fsdp(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def shards_weights(accelerator) -> bool:
    """Whether each process holds only a shard of the drafter's weights (DeepSpeed ZeRO-3, FSDP)."""
    return zero_stage(accelerator) == 3 or is_fsdp(accelerator)


def gather_weights(accelerator, model, drafter) -> dict[str, torch.Tensor] | None:
    """The drafter's trainable weights when they are sharded (ZeRO-3, FSDP: a collective, every process calls it;
    the main process gets full tensors); None otherwise (read them from the drafter itself)."""
    if not shards_weights(accelerator):
        return None
    from draftlab.checkpoint import trainable_state_dict

    wanted = set(trainable_state_dict(drafter))
    # keys of the DrafterLoss wrapper: "drafter.<name>"; DeepSpeed and FSDP consolidate on the main process only and
    # hand the other ranks None or nothing (they still had to take part in the gather)
    full = accelerator.get_state_dict(model) or {}
    return {k.removeprefix("drafter."): v.contiguous().cpu() for k, v in full.items()
            if k.removeprefix("drafter.") in wanted}


# ----------------------------------------------------------------------------------------------------------
# data


class Batches:
    """Deterministic, resumable batches. Epoch e is fixed by (seed, e): a permutation cut into global batches of
    batch_size x world rows, or (`bucketed`) rows of similar length grouped by `data.LengthBucketSampler`;
    each process takes its share of every global batch. `micro_step` (micro-batches taken by each process) is
    the exact data position, saved with checkpoints.

    Bucketing sorts each global batch by length and deals its rows round-robin to the processes, so every
    process gets rows of about the same length (no rank waits for a long one).

    Packing (`pack_tokens` > 0, `draftlab.packing`): the epoch's permutation is packed into rows of at most
    pack_tokens tokens, and a batch is batch_size such rows; an item of a batch is then the list of dataset
    indices in one packed row."""

    def __init__(self, dataset, batch_size: int, world: int, rank: int, seed: int, pad_token_id: int,
                 bucketed: bool = False, bucket_batches: int = 64, pack_tokens: int = 0):
        self.dataset, self.batch_size, self.world, self.rank = dataset, batch_size, world, rank
        self.seed, self.pad_token_id, self.micro_step = seed, pad_token_id, 0
        self.glob = batch_size * world
        self.pack_tokens = pack_tokens
        # a data set smaller than one global batch cannot be bucketed without dropping everything
        self.bucketed = bucketed and len(dataset) >= self.glob and not pack_tokens
        self.bucket_batches = bucket_batches
        self._cached: tuple[int, list[list[int]]] | None = None
        self._sizes: list[int] = []            # batches of epochs 0, 1, ... (packed epochs differ in size)
        self.per_epoch = len(self.epoch_batches(0))

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The global batches (dataset indices) of one epoch, each of exactly batch_size x world rows."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        n, glob = len(self.dataset), self.glob
        if self.pack_tokens:
            from draftlab.packing import pack

            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch)).tolist()
            rows = pack(self.dataset.lengths, order, self.pack_tokens)
            batches = [rows[i * glob:(i + 1) * glob] for i in range(max(1, len(rows) // glob))]
            if len(batches[0]) < glob:  # fewer packed rows than processes x batch_size: repeat rows
                batches = [(batches[0] * -(-glob // len(batches[0])))[:glob]]
        elif self.bucketed:
            from draftlab.data import LengthBucketSampler

            sampler = LengthBucketSampler(self.dataset.lengths, glob, bucket_batches=self.bucket_batches,
                                          shuffle=True, seed=self.seed, drop_last=True)
            sampler.set_epoch(epoch)
            batches = [sorted(b, key=lambda i: self.dataset.lengths[i]) for b in sampler]
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch)).tolist()
            batches = [order[i * glob:(i + 1) * glob] for i in range(max(1, n // glob))]
            if len(batches[0]) < glob:  # tiny data sets: repeat rows so that every process gets a full batch
                batches = [(batches[0] * -(-glob // len(batches[0])))[:glob]]
        self._cached = (epoch, batches)
        return batches

    def locate(self, micro_step: int) -> tuple[int, int]:
        """(epoch, batch within it) of a data position. Unpacked epochs all hold per_epoch batches; packed ones
        hold as many as their packing gives, so the position walks through the epochs' sizes."""
        if not self.pack_tokens:
            return divmod(micro_step, self.per_epoch)
        epoch = 0
        while True:
            while len(self._sizes) <= epoch:
                self._sizes.append(len(self.epoch_batches(len(self._sizes))))
            if micro_step < self._sizes[epoch]:
                return epoch, micro_step
            micro_step -= self._sizes[epoch]
            epoch += 1

    def indices(self, micro_step: int) -> list[int]:
        """This process's dataset indices at a data position."""
        epoch, pos = self.locate(micro_step)
        chunk = self.epoch_batches(epoch)[pos]
        if self.bucketed:
            return chunk[self.rank::self.world]
        return chunk[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def next(self) -> tuple[list, dict]:
        """(dataset indices, or with packing one list of them per row; collated batch) for the current position;
        advances the position."""
        from draftlab.data import collate

        idx = self.indices(self.micro_step)
        self.micro_step += 1
        if self.pack_tokens:
            from draftlab.packing import collate_packed

            return idx, collate_packed([[self.dataset[i] for i in row] for row in idx], self.pad_token_id)
        return idx, collate([self.dataset[i] for i in idx], self.pad_token_id)


def release_target_layers(target) -> int:
    """Drop the target's decoder layers (a training run that reads every feature from a store and never evaluates
    does not run them); returns the bytes of parameters released. The embedding, final norm, rotary embedding and
    LM head, which drafters borrow, stay."""
    import gc

    from draftlab.serving import decoder_layers

    decoder, name = decoder_layers(target)
    freed = sum(p.numel() * p.element_size() for p in getattr(decoder, name).parameters())
    setattr(decoder, name, torch.nn.ModuleList())
    gc.collect()
    return freed


def resume_position(saved: dict, batch_size: int, world: int) -> tuple[int, str | None]:
    """The micro_step to continue from, and a warning when the global batch changed since the save (then the
    position is carried over as the number of rows already seen, which is as close as a new layout allows)."""
    micro = int(saved.get("micro_step", 0))
    old_bs, old_world = saved.get("batch_size", batch_size), saved.get("world_size", world)
    if (old_bs, old_world) == (batch_size, world):
        return micro, None
    rows = micro * old_bs * old_world
    new = rows // (batch_size * world)
    return new, (f"the run was saved with batch_size {old_bs} x {old_world} processes and resumes with "
                 f"{batch_size} x {world}: data position carried over as {rows} rows seen (micro-step {new}); "
                 "the continuation is not bit-identical to an uninterrupted run")


def step_token_counts(batches: list[dict], accelerator) -> dict[str, float]:
    """Token counts of one optimizer step, summed over its micro-batches and over all processes.

    `loss` counts tokens with loss_mask = 1, the tokens every drafter loss is normalised by (its per-token mean
    is taken over these, up to the shift each drafter applies); `real` counts non-padding tokens; `slots` counts
    every position of the padded batches (real + padding). One all-reduce per step."""
    # float64: token counts of large global batches stay exact (float32 is exact only up to 2**24)
    local = torch.tensor([[float(b["loss_mask"].sum()), float(b["attention_mask"].sum()), float(b["input_ids"].numel())]
                          for b in batches], dtype=torch.float64).sum(0).to(accelerator.device)
    total = accelerator.reduce(local, reduction="sum") if accelerator.num_processes > 1 else local
    loss, real, slots = total.tolist()
    return {"loss": loss, "real": real, "slots": slots}


def any_process(flag: bool, accelerator) -> bool:
    """True on every process when `flag` is true on any of them (one all-reduce), so that all stop together."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([float(flag)], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum").item() > 0)


class StopSignals:
    """SIGTERM and SIGUSR1 (what a cluster sends before it preempts a job; SLURM: `--signal=USR1@120`) and SIGINT
    (Ctrl-C) ask the training loop to stop after the step it is in, save that step and exit, instead of dying
    mid-step: `received` names the first such signal (None until one comes). The same signal again, a moment later,
    acts as it would without this handler (a second Ctrl-C stops at once); a repeat within `REPEAT_SECONDS` is taken
    for the same request (Ctrl-C reaches every process of the terminal's group, and torchrun forwards it to its
    workers once more). Installed only in the main thread (Python delivers signals there), and not for a SIGINT the
    process was started to ignore (a background job); a context manager that puts the previous handlers back."""

    NAMES = ("SIGTERM", "SIGUSR1", "SIGINT")
    REPEAT_SECONDS = 1.0

    def __init__(self):
        self.received: str | None = None
        self._at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for name in self.NAMES:
                if hasattr(signal, name):
                    number = getattr(signal, name)
                    if name == "SIGINT" and signal.getsignal(number) == signal.SIG_IGN:
                        continue
                    self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number, frame) -> None:
        if self.received is not None:
            if time.monotonic() - self._at < self.REPEAT_SECONDS:
                return
            # asked twice: stop the way the signal does without us (SIGINT: KeyboardInterrupt, "interrupted")
            signal.signal(number, self._previous.get(number) or signal.SIG_DFL)
            signal.raise_signal(number)
            return
        self.received, self._at = signal.Signals(number).name, time.monotonic()
        again = " (Ctrl-C again stops at once, without saving it)" if number == signal.SIGINT else ""
        print(f"\n{self.received}: stopping after this step; it is saved first, then train.resume=auto continues"
              f"{again}", file=sys.stderr, flush=True)

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the received signal (128 + its number: 130 for Ctrl-C, as for an
        interruption anywhere else), 0 without one."""
        return 128 + int(getattr(signal, self.received)) if self.received else 0

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()


def resume_command(argv: list[str] | None = None) -> str:
    """The command that continues this run: the one that started it, with train.resume=auto in place of any
    train.resume=... it had. A launcher's own options (torchrun, accelerate launch, launch.sh) are not visible to its
    workers: then it says to relaunch the same way with these arguments."""
    import shlex

    argv = list(sys.argv if argv is None else argv)
    words = [a for a in argv[1:] if not a.startswith("train.resume=")] + ["train.resume=auto"]
    prog = Path(argv[0]).name if argv else ""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"the same launch with: {shlex.join(words)}"
    if prog == "draftlab":
        return shlex.join(["draftlab", *words])
    if prog == "cli.py":
        return shlex.join(["python", "-m", "draftlab.cli", *words])
    if prog == "train.py":
        return shlex.join(["python", argv[0], *words])
    return "the same command with train.resume=auto"


def loss_weight(batch: dict, global_loss_tokens: float, world: int) -> float:
    """Factor for one micro-batch's per-token-mean loss so that the optimizer step follows the mean over every
    valid token of the step, on all processes and micro-batches (not a mean of per-micro-batch means):
    local_tokens x world / global_tokens. The `world` undoes DDP's averaging of gradients over processes."""
    return float(batch["loss_mask"].sum()) * world / max(global_loss_tokens, 1.0)


def reduce_metrics(sums: dict[str, float], weight: float, accelerator) -> dict[str, float]:
    """Token-weighted means over all processes: `sums` holds value x tokens per key, `weight` the tokens."""
    keys = sorted(sums)
    local = torch.tensor([sums[k] for k in keys] + [weight], dtype=torch.float64)
    if accelerator.num_processes > 1:
        local = accelerator.reduce(local.to(accelerator.device), reduction="sum").cpu()
    total = max(float(local[-1]), 1e-12)
    return {k: float(v) / total for k, v in zip(keys, local[:-1].tolist())}


# ----------------------------------------------------------------------------------------------------------
# model-side options


def enable_gradient_checkpointing(drafter: torch.nn.Module) -> int:
    """Recompute the activations of the drafter's transformer layers in the backward pass instead of keeping
    them: less memory for more compute. Acts on every `transformers` decoder layer inside the drafter (EAGLE
    decoder layers, a small LM's layers, adapted target layers); returns how many layers were switched."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    count = 0
    for module in drafter.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.gradient_checkpointing = True
            # non-reentrant: works when only some inputs require grad (frozen features) and under DDP
            module._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
            count += 1
    return count


# ----------------------------------------------------------------------------------------------------------
# RNG streams


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def gather_rng_states(accelerator) -> list[dict]:
    """Every process's RNG state, in rank order (a collective: all processes call it)."""
    return gather_object([rng_state()])


def restore_rng(saved, rank: int, seed: int, step: int) -> str | None:
    """Restore this process's RNG streams from a checkpoint's list (one entry per rank; an older checkpoint
    holds one dict). A rank the checkpoint has no stream for gets a fresh one from (seed, rank, step), and
    the returned warning says so."""
    states = saved if isinstance(saved, list) else [saved]
    if rank >= len(states):
        torch.manual_seed(seed + 7919 * (rank + 1) + step)
        np.random.seed((seed + 7919 * (rank + 1) + step) % 2**32)
        random.seed(seed + 7919 * (rank + 1) + step)
        return f"rank {rank}: the checkpoint holds RNG streams for {len(states)} processes; seeded a fresh one"
    rng = states[rank]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if torch.cuda.is_available() and rng.get("cuda") is not None:
        torch.cuda.set_rng_state_all(rng["cuda"])
    return None


# ----------------------------------------------------------------------------------------------------------
# measurements


def peak_memory_mb(device) -> dict[str, float]:
    """Peak memory of this process so far: resident set size (CPU), and allocated GPU memory on CUDA."""
    out = {}
    try:
        import resource

        # ru_maxrss is in KiB on Linux, bytes on macOS
        scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    except ImportError:  # Windows
        try:
            import psutil

            out["peak_rss_mb"] = psutil.Process().memory_info().peak_wset / 2**20
        except Exception:
            pass
    if torch.device(device).type == "cuda":
        out["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


class Throughput:
    """Training tokens/s over a logging window: real tokens (padding excluded) of all processes divided by
    the time spent in training steps (evaluation and checkpoint writing are not counted). The CPU time of this
    process is kept too: on a shared machine, tokens per CPU-second still compares runs when wall time does not."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.real = self.slots = self.seconds = self.cpu_seconds = 0.0

    def add(self, counts: dict[str, float], seconds: float, cpu_seconds: float = 0.0) -> None:
        self.real += counts["real"]
        self.slots += counts["slots"]
        self.seconds += seconds
        self.cpu_seconds += cpu_seconds

    def row(self) -> dict[str, float]:
        return {"train_tokens_per_second": self.real / max(self.seconds, 1e-9),
                "padding_share": 1.0 - self.real / max(self.slots, 1.0),
                "train_tokens": self.real, "train_seconds": self.seconds, "train_cpu_seconds": self.cpu_seconds}


# ----------------------------------------------------------------------------------------------------------
# run folder: run_info.json, metrics.jsonl, trackers


def git_revision(path: Path | None = None) -> dict:
    """{"git_revision": sha or None, "git_dirty": bool or None} for the code being run."""
    where = str(path or Path(__file__).resolve().parent)
    try:
        sha = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        dirty = None
        if sha:
            status = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout
            dirty = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        sha, dirty = None, None
    return {"git_revision": sha, "git_dirty": dirty}


def run_info(accelerator, resumed_from: Path | None = None) -> dict:
    """What produced this run: code revision, world, precision, library versions, host, command line."""
    import accelerate
    import transformers

    return {**git_revision(), "world_size": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type.value), "mixed_precision": accelerator.mixed_precision,
            "zero_stage": zero_stage(accelerator), "device": str(accelerator.device),
            "torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "python": platform.python_version(), "host": platform.node(), "argv": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "resumed_from": str(resumed_from) if resumed_from else None}


def write_run_info(out_dir: Path, info: dict) -> None:
    """run_info.json holds one entry per launch of the run (the first, then each resume)."""
    path = out_dir / "run_info.json"
    launches = json.loads(path.read_text()).get("launches", []) if path.is_file() else []
    text = json.dumps({**info, "launches": launches + [info]}, indent=2, default=str)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def trim_metrics(out_dir: Path, step: int) -> int:
    """On resume: drop metrics.jsonl rows logged after `step` (the stretch being re-run) and a torn last line;
    returns how many rows were dropped. The file then reads as one uninterrupted run."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and row["step"] > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


def flat_config(cfg) -> dict:
    """{"section.key": value} for trackers that show a flat table of hyper-parameters."""
    from omegaconf import OmegaConf

    out = {}
    for section, values in OmegaConf.to_container(cfg).items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            out[section] = values
    return out


def init_tracking(accelerator, cfg, out_dir: Path, config: dict) -> None:
    """Start wandb / tensorboard (main process only, inside accelerate) with the run config and git revision.
    wandb writes under out_dir/wandb and runs offline with WANDB_MODE=offline (no network needed); the project
    is $WANDB_PROJECT or "draftlab", the run name the out_dir's name."""
    trackers = [t for t in tracking_list(cfg) if t != "jsonl"]
    if not trackers:
        return
    kwargs = {}
    if "wandb" in trackers:
        kwargs["wandb"] = {"dir": str(out_dir), "name": out_dir.name}
    if "tensorboard" in trackers:
        # tensorboard's hparams accept only scalars and strings
        config = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in config.items()}
    accelerator.init_trackers(os.environ.get("WANDB_PROJECT", "draftlab"), config=config, init_kwargs=kwargs)


def log_metrics(out_dir: Path, row: dict, accelerator) -> None:
    """Append a row to metrics.jsonl (always) and send its numbers to the trackers; lists (per-position
    acceptance) become one scalar per position, e.g. eval/per_position_acceptance/1."""
    with open(out_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    if not accelerator.trackers:
        return
    numeric = {}
    for key, value in row.items():
        if key == "step":
            continue
        if isinstance(value, (list, tuple)):
            numeric.update({f"{key}/{i + 1}": v for i, v in enumerate(value) if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numeric[key] = value
        elif isinstance(value, bool):
            numeric[key] = float(value)
    accelerator.log(numeric, step=row["step"])
