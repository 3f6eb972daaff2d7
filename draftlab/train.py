"""Train a drafter against a frozen target and score it in the loop by real speculative decoding.

    accelerate launch draftlab/train.py recipe=eagle_head target.path=... data.train=... key=value ...
    python draftlab/train.py recipe=quickstart          # same arguments, one process
    draftlab train recipe=quickstart                     # the console script

`main(cfg)` reads top to bottom: set-up, data, drafter, optimiser, then the step loop (target forward ->
drafter loss -> optimiser step), with evaluation + checkpoint every `eval.every` steps and at the end.
Under several processes (DDP or DeepSpeed through accelerate) each rank takes its share of every global batch,
the loss of a step is the mean over the valid tokens of all ranks and micro-batches, and checkpoints (written
by the main process, atomically) hold every rank's RNG stream, so `train.resume=auto` continues exactly.
Process, device, file and tracker plumbing lives in `draftlab/runtime.py`.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the package, not its modules as top-level names
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from draftlab import checkpoint as ckpt
from draftlab import runtime
from draftlab.config import ConfigError, load_config, to_yaml
from draftlab.errors import DiskFullError, describe_disk_full, is_disk_full, run_guarded


def main(cfg) -> dict:
    """Run one training job described by a RunConfig; returns a summary dict (best step, tau, ...).
    The run folder is locked for the whole run: a second start there (also a resume while this run goes on) is
    refused with one line naming this process. A full disk stops the run with one line saying which checkpoints
    are intact and how to continue."""
    out_dir = Path(cfg.out_dir)
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    accelerator = runtime.make_accelerator(cfg, out_dir)
    lock = runtime.lock_run_folder(out_dir, accelerator)
    try:
        return train(cfg, out_dir, accelerator)
    except (OSError, DiskFullError) as e:
        if not is_disk_full(e):
            raise
        raise DiskFullError(f"{describe_disk_full(e)}; {ckpt.intact_steps_text(out_dir)}: free some space, "
                                 "then continue the run with train.resume=auto (same arguments)") from None
    finally:
        if lock is not None:
            lock.release()


def train(cfg, out_dir: Path, accelerator) -> dict:
    """The run itself, top to bottom (main() holds the run folder's lock around it)."""
    from draftlab.data import ChatDataset, read_conversations
    from draftlab.drafters import DRAFTERS
    from draftlab.target import load_target

    is_main, world = accelerator.is_main_process, accelerator.num_processes
    resume_from = find_resume_folder(cfg, out_dir, accelerator)  # refuses to overwrite a run before any loading
    set_seed(cfg.seed)

    # --- target and data -------------------------------------------------------------------------------
    check_against_target(cfg)                       # layer ids, token ids, vocabulary sizes: before weights load
    target, tokenizer = load_target(cfg.target.path, cfg.target.dtype, str(accelerator.device)
                                    if cfg.target.device == "auto" else cfg.target.device)
    from draftlab.evaluator import check_explicit_masks

    if cfg.eval.every and cfg.eval.tree in ("static", "dynamic"):
        check_explicit_masks(target, tree=True)     # a target whose attention ignores tree masks: before training
    if cfg.train.pack_tokens:
        check_explicit_masks(target, tree=False)
    prepare_train_data(cfg, target, tokenizer, accelerator)
    conversations, stats = read_conversations(cfg.data.train, strict=cfg.data.strict, limit=cfg.data.limit or None)
    dataset = ChatDataset(conversations, tokenizer, cfg.data.max_length)
    if len(dataset) == 0:
        too_long = any("max_length" in why for why in dataset.dropped)
        fix = (f"raise data.max_length (now {cfg.data.max_length})" if too_long else
               "check the file's format (messages / conversations / prompt+response)")
        raise ConfigError(f"data.train {cfg.data.train} has no usable conversation ({stats}{dataset.summary()}): "
                          f"{fix}")
    batches = runtime.Batches(dataset, cfg.train.batch_size, world, accelerator.process_index, cfg.seed,
                              pad_token_id=pad_id(tokenizer), bucketed=cfg.train.bucketed,
                              bucket_batches=cfg.train.bucket_batches, pack_tokens=cfg.train.pack_tokens)
    if is_main:
        print(f"data: {len(dataset)} conversations from {cfg.data.train} ({stats}{dataset.summary()})", flush=True)

    # --- drafter, optimiser, schedule --------------------------------------------------------------------
    drafter = DRAFTERS[cfg.drafter.kind].from_target(target, cfg.drafter).to(accelerator.device)
    if hasattr(drafter, "prepare"):  # data-dependent set-up (a draft vocabulary): deterministic, so also on resume
        drafter.prepare(dataset)
    if cfg.train.gradient_checkpointing and runtime.enable_gradient_checkpointing(drafter) == 0:
        tqdm.write(f"train.gradient_checkpointing: drafter kind '{cfg.drafter.kind}' has no transformer layer to "
                   "checkpoint; training without it")
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
                                  weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
    # ZeRO-3 and FSDP shard the drafter across processes, so the main process speculates with a whole copy made
    # here, refreshed at every evaluation with the weights gathered for the checkpoint
    whole_copy = (evaluation_copy(drafter, target) if cfg.eval.every > 0 and is_main
                  and runtime.shards_weights(accelerator) else None)
    model = DrafterLoss(drafter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    params = [p for p in model.parameters() if p.requires_grad]  # FSDP replaces them with sharded ones
    # the initialisation above is the same on every process; from here on each rank draws its own noise
    set_seed(cfg.seed, device_specific=True)

    state = {"step": 0, "micro_step": 0, "best_step": None, "best_tau": None, "history": []}
    rng = None
    if resume_from is not None:
        applied = resume_contract(cfg, out_dir)
        state, rng = restore(resume_from, drafter, model, optimizer, scheduler, accelerator)
        if any(key in OPTIMIZER_KEYS for key, _, _ in applied):
            apply_optimizer_settings(cfg, optimizer, scheduler)
        state["micro_step"], warning = runtime.resume_position(state, cfg.train.batch_size, world)
        if is_main:
            print(f"resumed from {resume_from} at step {state['step']}" + (f" ({warning})" if warning else ""),
                  flush=True)
            if applied:
                from draftlab.config import changes_text

                print(f"resume: applied {changes_text(applied)}; recorded in {out_dir / 'config.yaml'}", flush=True)
            if applied or not (out_dir / "config.yaml").is_file():
                import copy

                recorded = copy.deepcopy(cfg)
                recorded.train.resume = ""  # config.yaml stays a recipe that starts this run
                ckpt.write_text_atomic(out_dir / "config.yaml", to_yaml(recorded) + f"# world_size: {world}\n")
            runtime.trim_metrics(out_dir, state["step"])
    elif is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        # world size as a comment: config.yaml stays a valid recipe (recipe=out_dir/config.yaml re-runs it)
        (out_dir / "config.yaml").write_text(to_yaml(cfg) + f"# world_size: {world}\n")
    if is_main:
        runtime.write_run_info(out_dir, runtime.run_info(accelerator, resume_from))
    batches.micro_step = state["micro_step"]
    runtime.init_tracking(accelerator, cfg, out_dir, {**runtime.flat_config(cfg), **runtime.git_revision(),
                                                       "world_size": world})
    evaluator = InLoopEvaluator(cfg, target, tokenizer, whole_copy) if cfg.eval.every > 0 and is_main else None

    if cfg.eval.every > 0 and cfg.eval.at_start and state["step"] == 0:  # every rank: saving is collective
        checkpoint_step(cfg, out_dir, 0, drafter, model, optimizer, scheduler, state, evaluator, accelerator)

    # --- the loop ------------------------------------------------------------------------------------------
    feature_layers = tuple(getattr(drafter, "feature_layers", ()))
    cache = {} if cfg.train.cache_features else None
    store = None
    if cfg.data.store:
        from draftlab.store import ensure_store

        store = ensure_store(cfg.data.store, target, tokenizer, dataset, feature_layers=feature_layers,
                             topk_logits=getattr(drafter, "teacher_topk", 0), accelerator=accelerator)
        if feature_layers and cfg.eval.every == 0 and cfg.hub.push == "none":
            # nothing runs the target from here on (features come from the store, no evaluation, no export): its
            # decoder layers are dropped, the embedding, final norm and LM head the head borrows stay
            freed = runtime.release_target_layers(target)
            if is_main:
                print(f"data.store without in-loop evaluation: released the target's decoder layers "
                      f"({freed / 2**20:.0f} MB)", flush=True)
    if rng is not None:  # last, so that nothing above draws from the restored streams
        warning = runtime.restore_rng(rng, accelerator.process_index, cfg.seed, state["step"])
        if warning:
            tqdm.write(warning)
    progress = tqdm(total=cfg.train.max_steps, initial=state["step"], disable=not is_main, desc="train",
                    dynamic_ncols=True)
    speed = runtime.Throughput()
    budget, seconds_before, loop_start = cfg.train.max_minutes * 60, state.get("train_seconds", 0.0), time.perf_counter()
    with runtime.StopSignals() as stop:  # SIGTERM / SIGUSR1 / Ctrl-C: save the step in progress, then stop
        while state["step"] < cfg.train.max_steps and not (budget > 0 and seconds_before >= budget):
            t0, cpu0 = time.perf_counter(), time.process_time()
            model.train()
            micro_batches = [batches.next() for _ in range(cfg.train.grad_accum)]
            # the step's valid tokens on all processes, known before the first backward (see runtime.loss_weight)
            counts = runtime.step_token_counts([b for _, b in micro_batches], accelerator)
            sums, local_tokens = {}, 0.0
            for micro, (rows, batch) in enumerate(micro_batches):
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                if store is not None:  # offline: features / teacher logits come from disk
                    extra = store.batch(rows, batch["input_ids"].shape[1])
                    features = extra.pop("features", None)
                    batch.update({k: v.to(accelerator.device) for k, v in extra.items()})
                    features = features.to(accelerator.device) if features is not None else None
                else:
                    features = features_for(target, batch, rows, feature_layers, cache) if feature_layers else None
                last = micro == cfg.train.grad_accum - 1
                accelerator.sync_gradients = last  # DeepSpeed reduces and steps at the last micro-batch only
                with accelerator.no_sync(model) if not last else nullcontext():
                    with accelerator.autocast():
                        loss, metrics = model(batch, features)
                    accelerator.backward(loss * runtime.loss_weight(batch, counts["loss"], world))
                tokens = float(batch["loss_mask"].sum())
                local_tokens += tokens
                for k, v in {"loss": loss.item(), **metrics}.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * tokens
            if cfg.train.grad_clip > 0:
                accelerator.clip_grad_norm_(params, cfg.train.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            state["micro_step"] = batches.micro_step
            step = state["step"]
            speed.add(counts, time.perf_counter() - t0, time.process_time() - cpu0)
            state["train_seconds"] = seconds_before + time.perf_counter() - loop_start
            out_of_time = budget > 0 and state["train_seconds"] >= budget
            halt = runtime.any_process(out_of_time or stop.received is not None, accelerator)  # all ranks stop together
            final = step == cfg.train.max_steps or halt

            progress.update(1)
            if step % cfg.train.log_every == 0 or final:
                means = runtime.reduce_metrics(sums, local_tokens, accelerator)  # collective: every rank logs
                if is_main:
                    row = {"step": step, "lr": scheduler.get_last_lr()[0], **means, **speed.row(),
                           **runtime.peak_memory_mb(accelerator.device), "world_size": world}
                    runtime.log_metrics(out_dir, row, accelerator)
                    progress.set_postfix(loss=f"{means['loss']:.3f}", **({"tau": f"{state['history'][-1]['tau']:.2f}"}
                                                                         if state["history"] else {}))
                speed.reset()

            # stopped by a signal: save at once (a preemption leaves little time), evaluate only on schedule
            eval_due = cfg.eval.every > 0 and (step % cfg.eval.every == 0 or (final and stop.received is None))
            save_due = final or eval_due or (cfg.train.save_every > 0 and step % cfg.train.save_every == 0)
            if save_due:
                checkpoint_step(cfg, out_dir, step, drafter, model, optimizer, scheduler, state,
                                evaluator if eval_due else None, accelerator)
                if is_main and ((cfg.hub.push == "every_eval" and eval_due) or (cfg.hub.push == "final" and final
                                                                          and stop.received is None)):
                    push_to_hub(cfg, out_dir / f"step_{step}", target, tokenizer)
            if halt:
                minutes = state["train_seconds"] / 60
                why = (f"{stop.received} received" if stop.received else
                       f"train.max_minutes={cfg.train.max_minutes:g} reached after {minutes:.1f} min" if out_of_time
                       else "another process was asked to stop")
                if is_main:
                    tqdm.write(f"{why}: stopped at step {step} of {cfg.train.max_steps}, saved as "
                               f"{out_dir / f'step_{step}'}; continue with: {runtime.resume_command()}")
                break
    progress.close()
    accelerator.end_training()
    if is_main and cfg.hub.push == "best":
        push_to_hub(cfg, out_dir, target, tokenizer)

    summary = {"out_dir": str(out_dir), "steps": state["step"], "best_step": state["best_step"],
               "best_tau": state["best_tau"], "history": state["history"], "stopped_by": stop.received,
               "exit_code": stop.exit_code}
    if is_main:
        print_summary(summary)
    return summary


# ----------------------------------------------------------------------------------------------------------
# pieces used by main(), in the order main() uses them


def find_resume_folder(cfg, out_dir: Path, accelerator) -> Path | None:
    """The step folder to resume from, or None for a fresh run; refuses to overwrite an existing run.
    With resume=auto, an interrupted save is cleaned up first (main process) and the newest step folder that
    is complete and loadable (trainer state included) is chosen; damaged newer ones are named and skipped."""
    if cfg.train.resume == "auto" and accelerator.is_main_process:
        for line in ckpt.recover_interrupted_saves(out_dir):
            print(f"resume: {line}", flush=True)
    accelerator.wait_for_everyone()
    check_run_folder(cfg, out_dir)
    existing = ckpt.step_folders(out_dir)
    if cfg.train.resume == "":
        return None
    if cfg.train.resume == "auto":
        chosen, skipped = ckpt.newest_usable(existing[::-1], resumable=True)
        if existing and chosen is None:
            raise ConfigError(f"train.resume=auto: no step of {out_dir} can be resumed ({'; '.join(skipped)}): "
                              "choose another out_dir (nothing was overwritten)")
        if skipped and accelerator.is_main_process:
            print(f"resume: skipped {'; '.join(skipped)}; resuming from {chosen.name}", flush=True)
        return chosen
    return Path(cfg.train.resume)


def check_run_folder(cfg, out_dir: Path) -> None:
    """Refuse a fresh run into a folder that holds one, and a resume from a folder with no trainer state."""
    existing = ckpt.step_folders(out_dir)
    if cfg.train.resume == "" and existing:
        raise ConfigError(f"out_dir {out_dir} already holds a run ({existing[-1].name}): pass train.resume=auto "
                          "to continue it, or choose another out_dir (nothing was overwritten)")
    path = Path(cfg.train.resume)
    if cfg.train.resume not in ("", "auto") and not (path / ckpt.STATE_NAME).is_file():
        raise ConfigError(f"train.resume={path}: no {ckpt.STATE_NAME} there; pass a step_N folder of a run or 'auto'")
    resume_contract(cfg, out_dir)


def recorded_config(cfg, out_dir: Path) -> Path | None:
    """The config.yaml of the run a resume continues (None: a fresh run, or a run that recorded none)."""
    if cfg.train.resume == "":
        return None
    if cfg.train.resume == "auto":
        path = out_dir / "config.yaml" if ckpt.step_folders(out_dir) else None
    else:
        path = Path(cfg.train.resume).parent / "config.yaml"
    return path if path is not None and path.is_file() else None


def resume_contract(cfg, out_dir: Path) -> list:
    """A resume continues the run its config.yaml records (config.RESUME_FIXED): a changed key that shapes the
    drafter, its target, its kind or the data layout is refused in one line naming each; the keys that may change
    are returned as (key, saved, now) to be applied and recorded."""
    from draftlab.config import changes_text, load_saved, resume_changes

    path = recorded_config(cfg, out_dir)
    if path is None:
        return []
    try:
        saved = load_saved(path)
    except ConfigError:  # a config.yaml this draftlab cannot read (an older schema): the checkpoints decide
        return []
    fixed, applied = resume_changes(saved, cfg)
    if fixed:
        run = path.parent
        raise ConfigError(f"train.resume={cfg.train.resume}: {run} was trained with {changes_text(fixed)}; "
                          f"{'this key shapes' if len(fixed) == 1 else 'these keys shape'} the drafter, its target or "
                          "its data, so a run cannot change them: resume with the values in "
                          f"{path}, or start a new run with another out_dir (e.g. out_dir={run}_new, "
                          "train.resume unset) (nothing was changed)")
    return applied


OPTIMIZER_KEYS = ("train.lr", "train.weight_decay", "train.adam_beta1", "train.adam_beta2", "train.max_steps",
                  "train.warmup_steps", "train.schedule")


def apply_optimizer_settings(cfg, optimizer, scheduler) -> None:
    """After a restore, the optimiser settings of this config rather than the saved ones (a resume may change
    train.lr, the schedule, weight decay and betas): base learning rates, this step's rate, decay and betas."""
    inner = getattr(scheduler, "scheduler", scheduler)
    factor = inner.lr_lambdas[0](inner.last_epoch)
    inner.base_lrs = [cfg.train.lr for _ in inner.base_lrs]
    for group in optimizer.param_groups:
        group.update(initial_lr=cfg.train.lr, lr=cfg.train.lr * factor, weight_decay=cfg.train.weight_decay,
                     betas=(cfg.train.adam_beta1, cfg.train.adam_beta2))
    inner._last_lr = [group["lr"] for group in optimizer.param_groups]


def target_text_config(path: str):
    """The target's text config read from its config.json alone (no weights), or None where that is not possible
    without loading it (a GGUF file, a package, a Hub id not in the local cache, an unreadable config)."""
    import logging

    from transformers import AutoConfig

    if not path or str(path).endswith(".gguf") or str(path).startswith("package:"):
        return None
    local = Path(path).expanduser()
    if local.exists() and not (local / "config.json").is_file():
        return None
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        config = AutoConfig.from_pretrained(str(local) if local.exists() else path, local_files_only=True)
        return config.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001 (the load itself reports what is wrong, in its own words)
        return None
    finally:
        logging.getLogger("transformers").setLevel(level)


def check_against_target(cfg) -> None:
    """The drafter keys that depend on the target (layer ids, token ids, vocabulary sizes) checked as soon as its
    config.json is read, before any weights load; and a target.device this machine has."""
    from draftlab.config import check_device
    from draftlab.drafters import CONFIGS

    check_device("target.device", cfg.target.device)
    text = target_text_config(cfg.target.path)
    if text is None:
        return
    try:
        problem = CONFIGS[cfg.drafter.kind].target_problem(cfg.drafter, text)
    except (AttributeError, TypeError, ValueError):  # a config.json without the sizes these checks read
        return
    if problem:
        raise ConfigError(f"{problem} (target.path={cfg.target.path})")


def check(cfg, run_folder: bool = True) -> None:
    """`train.py --check`: everything that can be verified before any process starts (launch.sh runs it first, so
    that a mistake is one line and exit code 2, not one traceback per rank): the configuration (load_config has
    checked it), that a data.train file holds a usable conversation, and with `run_folder` that out_dir is not in
    use by another run and the resume setting fits it.
    `--check-config` (run_folder=False) is for the other nodes of a multi-node launch, where node 0's run may
    already hold the run folder."""
    if run_folder:
        runtime.run_lock(Path(cfg.out_dir)).probe()
        check_run_folder(cfg, Path(cfg.out_dir))
    check_against_target(cfg)
    if cfg.data.train and not cfg.data.regenerate_from and Path(cfg.data.train).is_file():
        from draftlab.data import read_conversations

        # one usable row is enough to know the file is not empty or of another format (the rest is read at start)
        conversations, stats = read_conversations(cfg.data.train, strict=cfg.data.strict, limit=1)
        if not conversations:
            raise ConfigError(f"data.train {cfg.data.train} has no usable conversation ({stats}): check the file's "
                              "format (messages / conversations / prompt+response)")


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def push_to_hub(cfg, folder: Path, target, tokenizer) -> None:
    """hub.push: export + upload; a failed push is reported and training goes on (the export is kept)."""
    from draftlab.hub import HubError, push_checkpoint

    try:
        url = push_checkpoint(folder, cfg.hub.repo_id, private=cfg.hub.private, target=target, tokenizer=tokenizer)
        print(f"hub: pushed {folder} to {url}", flush=True)
    except HubError as e:
        print(f"hub: push failed: {e}", flush=True)


def prepare_train_data(cfg, target, tokenizer, accelerator) -> None:
    """Create data.train by letting the target answer data.regenerate_from, if asked (resumable, main process)."""
    if not cfg.data.regenerate_from:
        return
    train_file = Path(cfg.data.train)
    marker = train_file.with_name(train_file.name + ".source")  # says the file is ours to extend
    if train_file.exists() and not marker.exists():
        if accelerator.is_main_process:  # a user's own conversations: never append target answers to them
            print(f"data: {train_file} exists and was not made by regeneration: using it as is", flush=True)
        return
    if accelerator.is_main_process:
        from draftlab.answers import answer_with
        from draftlab.data import load_prompts
        from draftlab.engines import TransformersBackend, make_backend
        from draftlab.target import resolve_target_path

        prompts = load_prompts(cfg.data.regenerate_from, limit=cfg.data.regenerate_num or None)
        d = cfg.data
        if d.regenerate_backend == "transformers":  # the target already loaded for training answers
            backend = TransformersBackend(target, tokenizer, d.regenerate_max_new_tokens, d.regenerate_batch_size,
                                          model_file=resolve_target_path(cfg.target.path))
        else:
            backend = make_backend(d.regenerate_backend, cfg.target.path, max_new_tokens=d.regenerate_max_new_tokens,
                                   parallel=d.regenerate_concurrency, concurrency=d.regenerate_concurrency,
                                   urls=[u for u in d.regenerate_server_urls.split(",") if u.strip()],
                                   timeout=d.regenerate_timeout, threads=cfg.train.num_threads or None)
        train_file.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{cfg.data.regenerate_from}\n")
        answer_with(backend, prompts, str(train_file))
    accelerator.wait_for_everyone()


@torch.no_grad()
def features_for(target, batch: dict, rows: list[int], layers: tuple[int, ...], cache: dict | None):
    """Target features [B, T, F] for a right-padded or packed batch (`draftlab.packing`: a row of rows is a packed
    row, read with its block-diagonal mask): one target forward, or the in-memory cache when every conversation of
    the batch was seen before (`train.cache_features`)."""
    from draftlab.packing import model_inputs, spans
    from draftlab.target import target_features

    spans = spans(batch, rows)    # (batch row, start, end, dataset index) of every conversation
    if cache is not None and all(one in cache for *_, one in spans):
        first = cache[spans[0][3]]
        feats = torch.zeros(*batch["input_ids"].shape, first.shape[-1], dtype=first.dtype)
        for b, a, e, one in spans:
            feats[b, a:e] = cache[one]
        return feats.to(batch["input_ids"].device)
    out = target.base_model(input_ids=batch["input_ids"], output_hidden_states=True,
                            **model_inputs(batch, target.dtype))
    feats = target_features(out.hidden_states, layers)
    if cache is not None:
        for b, a, e, one in spans:
            cache[one] = feats[b, a:e].detach().cpu()
    return feats



def lr_lambda(tc):
    """Linear warm-up, then constant / linear / cosine decay to 10% of the peak at max_steps."""
    def f(step: int) -> float:
        if step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        if tc.schedule == "constant":
            return 1.0
        frac = (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps)
        decay = 1 - frac if tc.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return 0.1 + 0.9 * decay
    return f


class DrafterLoss(torch.nn.Module):
    """Wraps `drafter.loss` as `forward`, so DDP/DeepSpeed see the call and synchronise gradients."""

    def __init__(self, drafter: torch.nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict, features):
        return self.drafter.loss(batch, features)


def evaluation_copy(drafter, target):
    """A copy of the drafter with its own parameters and buffers that shares the target's modules it borrows
    (embedding, LM head, ...) instead of copying them."""
    import copy

    shared = {id(m): m for m in target.modules()}
    shared.update({id(t): t for t in (*target.parameters(), *target.buffers())})
    return copy.deepcopy(drafter, shared)


def restore(folder: Path, drafter, model, optimizer, scheduler, accelerator) -> tuple[dict, object]:
    """Weights, optimiser, schedule and trainer state (step, data position, history) from a step folder.
    Returns (state, RNG streams of every rank): main() restores the streams last, just before the loop."""
    from safetensors.torch import load_file

    state = ckpt.load_trainer_state(folder)
    if runtime.is_deepspeed(accelerator):  # DeepSpeed restores its own (sharded) weights and optimizer state
        model.load_checkpoint(str(folder / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, load_module_strict=False,
                              load_lr_scheduler_states=False)
        state.pop("optimizer", None)
    elif runtime.is_fsdp(accelerator):  # whole tensors in the folder, scattered to the shards
        main = accelerator.is_main_process
        optim_state = state.pop("optimizer")
        runtime.load_full_state(model, optimizer, load_file(str(folder / ckpt.WEIGHTS_NAME)) if main else {},
                                optim_state if main else {})
    else:
        drafter.load_state_dict(load_file(str(folder / ckpt.WEIGHTS_NAME)), strict=False)
        optimizer.load_state_dict(state.pop("optimizer"))
    scheduler.load_state_dict(state.pop("scheduler"))
    return state, state.pop("rng")


class InLoopEvaluator:
    """Scores the drafter by real speculative decoding on fixed prompts; target-only outputs and timings are
    computed once (first call) and reused by every later evaluation."""

    def __init__(self, cfg, target, tokenizer, whole_copy=None):
        from draftlab.data import encode_prompt, load_prompts
        from draftlab.target import eos_ids

        self.cfg, self.target, self.whole_copy = cfg, target, whole_copy
        prompts = load_prompts(cfg.data.eval_prompts, limit=cfg.eval.num_prompts)
        self.prompt_ids = [encode_prompt(tokenizer, p.messages) for p in prompts]
        self.categories = [p.category for p in prompts]
        self.eos = eos_ids(tokenizer, target)
        self.baseline = None

    def __call__(self, drafter, weights: dict | None = None) -> dict:
        """Score `drafter`; with `weights` (the gathered weights of a ZeRO-3 run, whose drafter holds only shards)
        score the whole copy given at construction, loaded with them."""
        from draftlab.evaluator import evaluate, run_baseline
        from draftlab.trees import TreeSpec
        from draftlab.verify import Sampling

        if weights is not None:
            self.whole_copy.load_state_dict(weights, strict=False)
            drafter = self.whole_copy
        e = self.cfg.eval
        spec = TreeSpec(kind=e.tree, draft_length=e.draft_length, depth=e.depth, top_k=e.top_k,
                        total_tokens=e.total_tokens)
        sampling = Sampling(temperature=e.temperature)
        reuse = e.repeats == 0   # target-only outputs and timings of the first evaluation serve every later one
        if reuse and (self.baseline is None or getattr(drafter, "adapts_target", False)):  # Medusa-2: new target
            self.baseline = run_baseline(self.target, self.prompt_ids, max_new_tokens=e.max_new_tokens,
                                         eos_token_ids=self.eos, sampling=sampling, seed=e.seed)
        was_training = drafter.training
        drafter.eval()
        shape = None
        if e.auto_draft_length:  # the chain length this checkpoint drafts best on this machine (costs.py)
            from draftlab.costs import auto_draft_length

            shape = auto_draft_length(self.target, drafter.proposer(self.target),
                                      self.prompt_ids[: e.calibration_prompts], sampling,
                                      max_length=e.max_draft_length, max_new_tokens=min(64, e.max_new_tokens),
                                      eos_token_ids=self.eos, seed=e.seed)
            spec = TreeSpec(kind="chain", draft_length=shape["chosen_draft_length"])
        report = evaluate(self.target, drafter.proposer(self.target), self.prompt_ids, spec=spec, sampling=sampling,
                          max_new_tokens=e.max_new_tokens, eos_token_ids=self.eos,
                          baseline=self.baseline if reuse else None, categories=self.categories, seed=e.seed,
                          progress=False, repeats=e.repeats)
        if shape is not None:
            report["draft_shape"], report["chosen_draft_length"] = shape, shape["chosen_draft_length"]
        drafter.train(was_training)
        return report


DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "zero"  # DeepSpeed's own checkpoint inside a step folder


def checkpoint_step(cfg, out_dir: Path, step: int, drafter, model, optimizer, scheduler, state: dict, evaluator,
                    accelerator) -> None:
    """Evaluate (main process, when given an evaluator), then write step_N atomically, update `best`, prune, plot.
    Every process calls it: the RNG streams of all ranks (and DeepSpeed's shards) go into the folder."""
    folder = out_dir / f"step_{step}"
    extra = {}
    weights = runtime.gather_weights(accelerator, model, drafter)  # None: take them from the drafter itself
    if evaluator is not None:
        extra["eval.json"] = evaluate_step(cfg, out_dir, step, drafter, state, evaluator, accelerator, weights)
    rngs = runtime.gather_rng_states(accelerator)  # after the evaluation, which may draw from the main stream
    optim_state = runtime.full_optimizer_state(model, optimizer) if runtime.is_fsdp(accelerator) else None
    if accelerator.is_main_process:
        ckpt.begin_save(folder)
    if runtime.is_deepspeed(accelerator):  # each rank writes its optimizer shard into the staging folder
        accelerator.wait_for_everyone()
        failure = None
        try:
            model.save_checkpoint(str(ckpt.staging_folder(folder) / DEEPSPEED_DIR), tag=DEEPSPEED_TAG,
                                  exclude_frozen_parameters=True)
        except Exception as e:  # DeepSpeed writes with torch.save: a full disk is a RuntimeError there
            failure = ckpt.write_failure(e, folder)
            if failure is None:
                raise
        if failure is not None:  # outside the handler, whose traceback still holds the half-written files
            raise ckpt.failed_save(folder, *failure)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        trainer_state = {**state, "scheduler": scheduler.state_dict(), "rng": rngs,
                         "world_size": accelerator.num_processes, "batch_size": cfg.train.batch_size}
        if not runtime.is_deepspeed(accelerator):
            trainer_state["optimizer"] = optim_state if optim_state is not None else optimizer.state_dict()
        ckpt.save_drafter(drafter, folder, extra_files=extra, trainer_state=trainer_state, state_dict=weights,
                          staged=True)
        calibration = json.loads(extra["eval.json"]).get("calibration") if extra else None
        if calibration:  # acceptance heads: the reliability plot beside eval.json
            from draftlab.report import plot_calibration

            plot_calibration(calibration, folder / "calibration.png")
        if state["best_step"] is not None:
            ckpt.write_text_atomic(out_dir / "best", f"step_{state['best_step']}\n")
        ckpt.prune(out_dir, cfg.train.keep_last, state["best_step"])
        if state["history"]:
            from draftlab.plots import plot_tau_curve

            plot_tau_curve(state["history"], out_dir / "tau.png", draft_length=cfg.eval.draft_length)
    accelerator.wait_for_everyone()


def evaluate_step(cfg, out_dir: Path, step: int, drafter, state: dict, evaluator, accelerator,
                  weights: dict | None = None) -> str:
    """Score the drafter by speculative decoding, update history/best, log tau and per-position acceptance;
    returns the report as JSON text (the step folder's eval.json). `weights`: see InLoopEvaluator.__call__."""
    t0 = time.perf_counter()
    report = evaluator(drafter, weights)
    report["step"] = step
    report["eval_seconds"] = time.perf_counter() - t0
    tau = report["acceptance_length"]
    state["history"].append({"step": step, "tau": tau, "speedup": report.get("speedup"),
                             "per_position_acceptance": report["per_position_acceptance"]})
    if state["best_tau"] is None or tau >= state["best_tau"]:
        state["best_tau"], state["best_step"] = tau, step
    per_sample = report.get("acceptance_length_per_sample") or []
    runtime.log_metrics(out_dir, {"step": step, "eval/acceptance_length": tau, "eval/speedup": report.get("speedup"),
                                  "eval/per_position_acceptance": report["per_position_acceptance"],
                                  "eval/acceptance_length_per_sample_mean": sum(per_sample) / max(len(per_sample), 1),
                                  "eval/lossless": report.get("lossless"), "eval/seconds": report["eval_seconds"]},
                        accelerator)
    tqdm.write(f"step {step}: tau {tau:.3f} (k={cfg.eval.draft_length}, {cfg.eval.tree}), "
               f"speedup {report.get('speedup') or float('nan'):.2f}x, lossless {report.get('lossless')}")
    return json.dumps(report, indent=2)


def print_summary(summary: dict) -> None:
    hist = summary["history"]
    if not hist:
        print(f"done: {summary['steps']} steps, checkpoints in {summary['out_dir']}")
        return
    first, best = hist[0], max(hist, key=lambda h: h["tau"])
    print(f"done: {summary['steps']} steps; best step_{summary['best_step']}: tau {best['tau']:.3f}, "
          f"speedup {best['speedup'] or float('nan'):.2f}x  (step_{first['step']}: tau {first['tau']:.3f}); "
          f"checkpoints in {summary['out_dir']}")


def usage() -> str:
    """`draftlab train --help`: how a run is configured, and every key with its default."""
    from dataclasses import MISSING, fields

    from draftlab.config import RunConfig
    from draftlab.drafters import CONFIGS

    def keys(section, prefix: str) -> str:
        out = []
        for f in fields(section):
            default = f.default if f.default is not MISSING else f.default_factory()
            out.append(f"{prefix}{f.name}={default!r}" if isinstance(default, str) else f"{prefix}{f.name}={default}")
        return " ".join(out)

    lines = ["usage: draftlab train recipe=NAME key=value ...   (the same arguments: python draftlab/train.py, "
             "launch.sh)", "",
             "Trains a draft model. The run config is the defaults, then recipe=NAME (`draftlab recipes` lists them, "
             "`draftlab recipes --show NAME` prints one resolved), then key=value overrides. For example:",
             "  draftlab train recipe=eagle_head target.path=HF_FOLDER data.train=chat.jsonl "
             "data.eval_prompts=prompts.jsonl out_dir=runs/eagle",
             "Continue a stopped run with the same arguments plus train.resume=auto (keys that shape the drafter, "
             "its target or its data cannot change on resume; train.lr, train.max_steps, eval.* and the like can).",
             "Check a config without training: draftlab/train.py --check ARGS.", "", "keys (with their defaults):"]
    for f in fields(RunConfig):
        if f.name == "drafter":
            continue
        if f.default_factory is not MISSING:
            lines.append(f"  {keys(f.default_factory, f.name + '.')}")
        else:
            lines.append(f"  {f.name}={f.default!r}" if isinstance(f.default, str) else f"  {f.name}={f.default}")
    lines.append("  drafter.kind: " + ", ".join(CONFIGS) + "; each kind's keys:")
    for kind, config in CONFIGS.items():
        lines.append(f"    {kind}: " + keys(config, "drafter.").replace(f"drafter.kind={kind!r} ", ""))
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    """Entry point shared by `python draftlab/train.py`, `accelerate launch` and `draftlab train`; a first argument
    `--check` / `--check-config` only checks (see check())."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    if argv[:1] in (["--check"], ["--check-config"]):
        return run_guarded(lambda: check(load_config(argv[1:]), run_folder=argv[0] == "--check"))
    summary = {}
    code = run_guarded(lambda: summary.update(main(load_config(argv))))
    return code or summary.get("exit_code", 0)  # stopped by a signal: the shell's code for it, after saving


if __name__ == "__main__":
    sys.exit(cli())
