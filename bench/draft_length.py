"""`--draft-length auto` against every fixed chain length, with interleaved timing repeats.

    python bench/draft_length.py --checkpoint RUN_OR_STEP --num-prompts 10 --repeats 3

For one drafter on SmolLM2-135M-Instruct: costs.auto_draft_length picks k from the draft / verification costs it
measures here and the drafter's per-position acceptance on held-out calibration prompts
(data_prep/prompts/heldout_train_dist.jsonl, not the evaluation prompts); then the evaluator runs fixed chains of
k = 1..--max-k and the auto choice on the first --num-prompts MT-bench first turns, each timed interleaved with
target-only decoding (--repeats, median speedup with its min and max). Writes bench/results/draft_length.json
and .md; the headline says how far auto's median speedup is from the best fixed k's, and whether that gap is
inside the spread of the repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "results" / "draft_length"
CALIBRATION = ROOT / "data_prep" / "prompts" / "heldout_train_dist.jsonl"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--target", default=None, help="default: the checkpoint's")
    ap.add_argument("--prompts", default=str(SHARED / "mtbench.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)

    import torch

    from draftlab import costs
    from draftlab.checkpoint import load_drafter, resolve_checkpoint
    from draftlab.cli import checkpoint_target
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.evaluator import evaluate, load_average
    from draftlab.target import load_target
    from draftlab.train import eos_ids
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    torch.set_num_threads(args.threads)
    folder = resolve_checkpoint(args.checkpoint)
    target, tokenizer = load_target(args.target or checkpoint_target(folder), "auto", "cpu")
    drafter = load_drafter(folder, target).eval()
    eos = eos_ids(tokenizer, target)
    ids = [encode_prompt(tokenizer, p.messages) for p in load_prompts(args.prompts, limit=args.num_prompts)]
    calibration = [encode_prompt(tokenizer, p.messages) for p in load_prompts(str(CALIBRATION), limit=4)]
    load_start = load_average()
    shape = costs.auto_draft_length(target, drafter.proposer(target), calibration, Sampling(), max_length=8,
                                    max_new_tokens=64, eos_token_ids=eos)
    chosen = shape["chosen_draft_length"]
    print(f"auto: k={chosen} (expected tokens/s by k: "
          + ", ".join(f"{k}: {v['expected_tokens_per_second']:.1f}" for k, v in shape["cost_model"].items()) + ")")
    rows = []
    for k in list(range(1, args.max_k + 1)) + ["auto"]:
        length = chosen if k == "auto" else k
        report = evaluate(target, drafter.proposer(target), ids, spec=TreeSpec(kind="chain", draft_length=length),
                          sampling=Sampling(), max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                          repeats=args.repeats)
        row = {"k": k, "draft_length": length, **{key: report[key] for key in (
            "acceptance_length", "per_position_acceptance", "speedup", "speedup_min", "speedup_max", "speedups",
            "tokens_per_second", "baseline_tokens_per_second", "lossless", "timing_repeats", "load_average")}}
        rows.append(row)
        print(f"k={k}: tau {row['acceptance_length']:.3f}, speedup {row['speedup']:.3f}x "
              f"[{row['speedup_min']:.3f}, {row['speedup_max']:.3f}], load {row['load_average']}", flush=True)
    fixed = [r for r in rows if r["k"] != "auto"]
    best = max(fixed, key=lambda r: r["speedup"])
    auto = rows[-1]
    gap = 1 - auto["speedup"] / best["speedup"]
    headline = {"best_fixed_k": best["k"], "best_fixed_speedup": best["speedup"], "auto_k": chosen,
                "auto_speedup": auto["speedup"], "auto_shortfall": gap, "within_5_percent": gap <= 0.05,
                "best_fixed_spread": [best["speedup_min"], best["speedup_max"]]}
    result = {"header": {"command": " ".join(sys.argv), "checkpoint": str(folder), "num_prompts": args.num_prompts,
                         "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": args.threads,
                         "nproc": os.cpu_count(), "load_average_start": load_start, "draft_shape": shape},
              "headline": headline, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"Drafter `{folder}`; {args.num_prompts} MT-bench first turns x {args.max_new_tokens} tokens, greedy, "
             f"{args.repeats} interleaved repeats, {args.threads} thread(s).", "",
             "| k | tau | per-position acceptance | speedup (median) | min | max | load avg |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        name = f"auto (k={chosen})" if r["k"] == "auto" else str(r["k"])
        lines.append(f"| {name} | {r['acceptance_length']:.3f} | {', '.join(f'{a:.2f}' for a in r['per_position_acceptance'])}"
                     f" | {r['speedup']:.3f}x | {r['speedup_min']:.3f} | {r['speedup_max']:.3f} | {r['load_average'][0]} |")
    lines += ["", f"Best fixed k = {best['k']} ({best['speedup']:.3f}x, spread {best['speedup_min']:.3f}-"
                  f"{best['speedup_max']:.3f}); auto chose k = {chosen} ({auto['speedup']:.3f}x): "
                  f"{gap:.1%} below the best fixed k ({'within' if gap <= 0.05 else 'NOT within'} 5%)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
