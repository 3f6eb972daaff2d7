"""Training throughput per drafter kind: real tokens/s (padding excluded), padding share and peak memory, with
and without length-bucketed batches (`train.bucketed`).

    python bench/train_throughput.py                                  # tiny random target (a smoke run)
    python bench/train_throughput.py --target PATH --limit 32         # a real target (HF folder, .gguf, Hub id)
    python bench/train_throughput.py --kinds eagle,medusa --set eagle3:drafter.ttt_steps=3

Every (kind, bucketing) pair runs `draftlab.train.main` in a fresh process, so its peak memory is its own, on
--limit conversations of --data (eval off), by default for one epoch: plain and bucketed runs then train on the
same rows and differ only in how they are grouped. tokens/s is the real (non-padding) tokens over the training
seconds of the counted steps (all but the first --warmup); tokens per CPU-second divides by this process's CPU
time instead, which other processes on a shared machine disturb less. Each kind starts from the recipe that names
it (recipes/*.yaml). Prints a table, writes bench/results/train_throughput.json; the numbers come from the run's
metrics.jsonl, i.e. what a real training run reports.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_DATA = ROOT.parent / "shared" / "bench" / "smollm2_answers.jsonl"
# settings a kind needs on a small target / data set (override or extend with --set KIND:key=value)
KIND_OVERRIDES = {"eagle3": ["drafter.draft_vocab_size=0"]}  # full vocabulary: bench data is too small to reduce it


# kinds that build on another trained checkpoint: measured only when given one (--set KIND:key=PATH)
NEEDS_CHECKPOINT = {"acceptance": "drafter.base"}


def recipe_for(kind: str) -> str:
    """The first shipped recipe (alphabetically) whose drafter is `kind` and that reads no feature store; for
    small_lm that is offline black-box distillation, plain cross-entropy on the data."""
    from omegaconf import OmegaConf

    from draftlab.config import available_recipes, load_config

    for name in available_recipes():
        try:
            cfg = load_config([f"recipe={name}", "target.path=x", "data.train=x", "eval.every=0"])
        except Exception:
            continue
        if cfg.drafter.kind == kind and not OmegaConf.select(cfg, "data.store"):
            return name
    return "eagle_head"  # plus drafter.kind=KIND below


def tiny_target(folder: Path) -> str:
    """The tests' tiny random Llama (2 layers, hidden 64, ~320-token BPE, ChatML), saved once."""
    if not (folder / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import build_tiny_llama, build_tokenizer

        tok = build_tokenizer()
        build_tiny_llama(tok).save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder)


def child(spec_file: str) -> int:
    """Run one training job from a spec file (its overrides): one measurement in its own process."""
    from draftlab.config import load_config
    from draftlab.train import main

    main(load_config(json.loads(Path(spec_file).read_text())["overrides"]))
    return 0


def measure(kind: str, bucketed: bool, args, target: str, work: Path) -> dict:
    out = work / f"{kind}_{'bucketed' if bucketed else 'plain'}"
    recipe = recipe_for(kind)
    extra = [s.split(":", 1)[1] for s in args.set if s.split(":", 1)[0] == kind]
    needed = NEEDS_CHECKPOINT.get(kind)
    if needed and not any(e.startswith(f"{needed}=") for e in extra):
        return {"kind": kind, "bucketed": bucketed, "recipe": recipe,
                "skipped": f"needs a trained checkpoint: --set {kind}:{needed}=RUN_FOLDER"}
    overrides = [f"recipe={recipe}", f"drafter.kind={kind}", f"target.path={target}", f"data.train={args.data}",
                 f"out_dir={out}", "eval.every=0", "tracking=jsonl", f"train.max_steps={args.steps}",
                 "train.log_every=1", f"train.batch_size={args.batch_size}", "train.grad_accum=1",
                 f"data.max_length={args.max_length}", f"data.limit={args.limit}", "train.save_every=0",
                 f"train.num_threads={args.threads}", "train.warmup_steps=0", "data.regenerate_from=''",
                 f"train.bucketed={str(bucketed).lower()}", *KIND_OVERRIDES.get(kind, []), *extra]
    spec = work / f"{out.name}.json"
    spec.write_text(json.dumps({"overrides": overrides}))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", str(spec)], capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"kind": kind, "bucketed": bucketed, "recipe": recipe, "error": tail}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train_tokens_per_second" in r]
    counted = rows[args.warmup:] or rows
    result = {"kind": kind, "bucketed": bucketed, "recipe": recipe, "steps": len(rows), "counted_steps": len(counted),
              "tokens_per_second": tokens_per_second(counted), "tokens_per_cpu_second": tokens_per_cpu_second(counted),
              "padding_share": statistics.mean(r["padding_share"] for r in counted),
              "peak_rss_mb": max(r.get("peak_rss_mb", 0.0) for r in rows), "wall_seconds": wall}
    if any("peak_gpu_mem_mb" in r for r in rows):
        result["peak_gpu_mem_mb"] = max(r.get("peak_gpu_mem_mb", 0.0) for r in rows)
    return result


def tokens_per_second(rows: list[dict]) -> float:
    """Real tokens over training seconds of the counted steps (not a mean of per-step rates: a step of short
    rows would weigh as much as a step of long ones)."""
    if all("train_tokens" in r for r in rows):
        return sum(r["train_tokens"] for r in rows) / max(sum(r["train_seconds"] for r in rows), 1e-9)
    return statistics.median(r["train_tokens_per_second"] for r in rows)


def tokens_per_cpu_second(rows: list[dict]) -> float | None:
    """Real tokens over the process's CPU seconds in those steps: what the work costs, whatever else runs on
    the machine (wall-clock rates on a shared machine mostly measure the other processes)."""
    if not all("train_cpu_seconds" in r for r in rows):
        return None
    return sum(r["train_tokens"] for r in rows) / max(sum(r["train_cpu_seconds"] for r in rows), 1e-9)


def table(results: list[dict]) -> str:
    lines = [f"{'kind':<9} {'batches':<9} {'tokens/s':>9} {'tok/CPU-s':>10} {'padding':>8} {'peak RSS MB':>12} "
             f"{'vs plain (CPU)':>15}", "-" * 78]
    plain = {r["kind"]: r for r in results if not r["bucketed"] and "tokens_per_second" in r}
    for r in results:
        name = "bucketed" if r["bucketed"] else "plain"
        if "error" in r or "skipped" in r:
            lines.append(f"{r['kind']:<9} {name:<9} " + (f"failed: {r['error'][:60]}" if "error" in r
                                                          else f"skipped: {r['skipped']}"))
            continue
        base, cpu = plain.get(r["kind"]), r.get("tokens_per_cpu_second")
        base_cpu = base.get("tokens_per_cpu_second") if base else None
        ratio = f"{cpu / base_cpu:.2f}x" if cpu and base_cpu else ""
        lines.append(f"{r['kind']:<9} {name:<9} {r['tokens_per_second']:>9.0f} {cpu or float('nan'):>10.0f} "
                     f"{r['padding_share']:>8.1%} {r['peak_rss_mb']:>12.0f} {ratio:>15}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from draftlab.drafters import DRAFTERS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="", help="target path (default: the tests' tiny random Llama)")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="training conversations (JSONL)")
    ap.add_argument("--kinds", default=",".join(DRAFTERS), help=f"comma-separated (default: {','.join(DRAFTERS)})")
    ap.add_argument("--steps", type=int, default=0,
                    help="optimizer steps per measurement (default: one epoch of --limit rows, so that plain and "
                         "bucketed runs train on the same rows)")
    ap.add_argument("--warmup", type=int, default=0, help="first steps left out of the count")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=1024,
                    help="tokens per conversation (the tiny target reads at most 1024)")
    ap.add_argument("--limit", type=int, default=128, help="conversations read from --data")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--set", action="append", default=[], metavar="KIND:KEY=VALUE", help="extra override for a kind")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_throughput.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child)

    if args.steps <= 0:
        args.steps = max(1, args.limit // args.batch_size)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in DRAFTERS]
    if unknown:
        ap.error(f"unknown drafter kind(s) {', '.join(unknown)}: choose from {', '.join(DRAFTERS)}")
    if not Path(args.data).is_file():
        ap.error(f"--data {args.data} does not exist")
    load_avg = os.getloadavg()[0]
    if load_avg > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load_avg:.1f} on {os.cpu_count()} cores: timings will be noisy", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="draftlab-throughput-") as tmp:
        work = Path(tmp)
        target = args.target or tiny_target(work / "tiny_target")
        for kind in kinds:
            for bucketed in (False, True):  # adjacent, so a change in machine load hits both alike
                r = measure(kind, bucketed, args, target, work)
                line = (f"{r['tokens_per_second']:.0f} tokens/s, {r['tokens_per_cpu_second'] or 0:.0f} per CPU-second"
                        if "tokens_per_second" in r else f"failed: {r['error']}" if "error" in r
                        else f"skipped: {r['skipped']}")
                print(f"  {kind:<8} {'bucketed' if bucketed else 'plain':<8} {line}", flush=True)
                results.append(r)
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"target": args.target or "tiny random Llama (tests/conftest.py)", "data": args.data, "steps": args.steps,
            "warmup": args.warmup, "batch_size": args.batch_size, "max_length": args.max_length, "limit": args.limit,
            "threads": args.threads, "load_average_at_start": load_avg, "cpu_count": os.cpu_count(),
            "machine": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
