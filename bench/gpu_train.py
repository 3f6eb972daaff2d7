"""GPU training benchmark: bf16 steps per drafter kind, plain (one GPU) and DeepSpeed ZeRO-2 on one GPU through
accelerate's DeepSpeed config; real tokens/s, padding share, peak GPU memory; and a ZeRO-2 resume check.

    python bench/gpu_train.py                          # random Llama target (--hidden/--layers), a few minutes
    python bench/gpu_train.py --target PATH --steps 40 # a real target (HF folder, .gguf, Hub id)
    python bench/gpu_train.py --kinds eagle --no-zero  # only the plain bf16 runs
Kinds that build on another trained checkpoint (acceptance) are left out.

Each run is `accelerate launch --config_file recipes/accelerate/{single_gpu,deepspeed_zero2}.yaml
--num_processes 1 ...` around `draftlab.train.main` (via bench/train_throughput.py's child mode), so the
numbers are what a real launch reports in metrics.jsonl. The resume check trains --steps with a checkpoint
half-way, resumes from it under ZeRO-2 (DeepSpeed restores its own optimizer shards) and compares the final
weights with the uninterrupted run. Needs CUDA (and the `deepspeed` package for the ZeRO-2 runs); exits 2 with
one line otherwise. Writes bench/results/gpu_train.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_DATA = ROOT.parent / "shared" / "bench" / "smollm2_answers.jsonl"
ACCEL = ROOT / "recipes" / "accelerate"


def fail(message: str) -> int:
    print(f"gpu_train: error: {message}", file=sys.stderr)
    return 2


def random_target(folder: Path, hidden: int, layers: int) -> str:
    """A random Llama of the given size with the tests' small ChatML tokenizer (no download)."""
    if (folder / "config.json").is_file():
        return str(folder)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=int(2.75 * hidden) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def synthetic_data(path: Path, rows: int = 512) -> str:
    """Conversations of 1..24 sentences (varied lengths), when the shared bench data is not on this machine."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import CORPUS

    with open(path, "w") as f:
        for i in range(rows):
            reply = " ".join(CORPUS[(i + j) % 6] for j in range(1 + (i * 7) % 24))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Say it ({i})."},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return str(path)


def launch(config: str, overrides: list[str], work: Path, name: str) -> tuple[int, str, float]:
    """One process under `accelerate launch` with an accelerate config of recipes/accelerate/."""
    spec = work / f"{name}.json"
    spec.write_text(json.dumps({"overrides": overrides}))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCEL / f"{config}.yaml"),
           "--num_processes", "1", "--num_machines", "1", "--main_process_port", "29533"]
    if config.startswith("deepspeed"):
        raw = (ACCEL / f"{config}.yaml").read_text()
        ds = next(line.split(":", 1)[1].split("#")[0].strip() for line in raw.splitlines()
                  if "deepspeed_config_file" in line)
        cmd += ["--deepspeed_config_file", str(ROOT / ds)]
    cmd += [str(ROOT / "bench" / "train_throughput.py"), "--child", str(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return proc.returncode, tail, time.perf_counter() - t0


def summarise(out: Path, warmup: int) -> dict:
    from bench.train_throughput import tokens_per_second

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train_tokens_per_second" in r]
    counted = rows[warmup:] or rows
    return {"steps": len(rows), "tokens_per_second": tokens_per_second(counted),
            "padding_share": statistics.mean(r["padding_share"] for r in counted),
            "peak_gpu_mem_mb": max(r.get("peak_gpu_mem_mb", 0.0) for r in rows),
            "peak_rss_mb": max(r.get("peak_rss_mb", 0.0) for r in rows), "final_loss": rows[-1]["loss"]}


def max_weight_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="", help="target path (default: a random Llama of --hidden/--layers)")
    ap.add_argument("--hidden", type=int, default=1024, help="random target: hidden size")
    ap.add_argument("--layers", type=int, default=8, help="random target: decoder layers")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="training conversations (default: synthetic if missing)")
    ap.add_argument("--kinds", default="", help="comma-separated drafter kinds (default: every registered kind)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the median")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--bucketed", action=argparse.BooleanOptionalAction, default=True, help="train.bucketed")
    ap.add_argument("--zero", action=argparse.BooleanOptionalAction, default=True, help="also run ZeRO-2")
    ap.add_argument("--resume-check", action=argparse.BooleanOptionalAction, default=True,
                    help="ZeRO-2: resume from the half-way checkpoint and compare the final weights")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_train.json"))
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        return fail("no CUDA device visible (torch.cuda.is_available() is False): run this on a GPU machine; "
                    "the CPU benchmark is bench/train_throughput.py")
    if args.zero:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return fail("the ZeRO-2 runs need DeepSpeed: pip install 'draftlab[deepspeed]' (or pass --no-zero)")
    from draftlab.drafters import DRAFTERS
    from bench.train_throughput import KIND_OVERRIDES, NEEDS_CHECKPOINT, recipe_for

    kinds = [k for k in (args.kinds.split(",") if args.kinds else DRAFTERS) if k and k not in NEEDS_CHECKPOINT]
    unknown = [k for k in kinds if k not in DRAFTERS]
    if unknown:
        return fail(f"unknown drafter kind(s) {', '.join(unknown)}: choose from {', '.join(DRAFTERS)}")
    device = torch.cuda.get_device_name(0)
    print(f"GPU: {device}, bf16 supported: {torch.cuda.is_bf16_supported()}", flush=True)

    results, work = [], Path(tempfile.mkdtemp(prefix="draftlab-gpu-"))
    try:
        target = args.target or random_target(work / "target", args.hidden, args.layers)
        data = args.data if Path(args.data).is_file() else synthetic_data(work / "data.jsonl")
        configs = ["single_gpu"] + (["deepspeed_zero2"] if args.zero else [])
        for kind in kinds:
            for config in configs:
                out = work / f"{kind}_{config}"
                base = [f"recipe={recipe_for(kind)}", f"drafter.kind={kind}", f"target.path={target}",
                        f"data.train={data}", "eval.every=0", "tracking=jsonl", "train.log_every=1",
                        f"train.batch_size={args.batch_size}", "train.grad_accum=1",
                        f"data.max_length={args.max_length}",
                        "train.mixed_precision=bf16", "train.warmup_steps=0", "train.schedule=constant",
                        *(["drafter.feature_noise=0.0"] if kind == "eagle" else []), "data.regenerate_from=''",
                        f"train.bucketed={str(args.bucketed).lower()}", *KIND_OVERRIDES.get(kind, [])]
                run = [*base, f"out_dir={out}", f"train.max_steps={args.steps}",
                       f"train.save_every={max(1, args.steps // 2)}"]
                rc, tail, wall = launch(config, run, work, out.name)
                row = {"kind": kind, "config": config, "wall_seconds": wall}
                if rc != 0:
                    row["error"] = tail
                else:
                    row.update(summarise(out, args.warmup))
                    if config.startswith("deepspeed") and args.resume_check:
                        again = work / f"{kind}_{config}_resumed"
                        shutil.copytree(out, again, ignore=shutil.ignore_patterns(f"step_{args.steps}"))
                        rc2, tail2, _ = launch(config, [*base, f"out_dir={again}", f"train.max_steps={args.steps}",
                                                        f"train.save_every={max(1, args.steps // 2)}",
                                                        "train.resume=auto"], work, again.name)
                        row["resume"] = ({"max_abs_weight_diff": max_weight_diff(
                            out / f"step_{args.steps}" / "model.safetensors",
                            again / f"step_{args.steps}" / "model.safetensors")} if rc2 == 0 else {"error": tail2})
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'kind':<9} {'config':<16} {'tokens/s':>10} {'padding':>8} {'peak GPU MB':>12} {'resume diff':>12}")
    for r in results:
        if "error" in r:
            print(f"{r['kind']:<9} {r['config']:<16} failed: {r['error'].splitlines()[-1][:80]}")
            continue
        diff = r.get("resume", {}).get("max_abs_weight_diff")
        print(f"{r['kind']:<9} {r['config']:<16} {r['tokens_per_second']:>10.0f} {r['padding_share']:>8.1%} "
              f"{r['peak_gpu_mem_mb']:>12.0f} {'' if diff is None else f'{diff:.2e}':>12}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": device, "target": args.target or f"random Llama hidden {args.hidden} x {args.layers} layers",
            "steps": args.steps, "batch_size": args.batch_size, "max_length": args.max_length,
            "bucketed": args.bucketed, "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
