"""`--draft-length auto` against every fixed chain length, with interleaved timing repeats.

    python bench/draft_length.py --checkpoint RUN_OR_STEP --num-prompts 10 --repeats 3

For one drafter on SmolLM2-135M-Instruct: costs.auto_draft_length picks k from the draft / verification costs it
measures here and the drafter's per-position acceptance on held-out calibration prompts
(data_prep/prompts/heldout_train_dist.jsonl, not the evaluation prompts); then the evaluator runs fixed chains of
k = 1..--max-k and the auto choice on the first --num-prompts MT-bench first turns, all timed against the same
interleaved target-only runs (evaluator.evaluate_side_by_side: --repeats, rotating order, median speedup with its
min and max). --ks runs a subset of the rows; --compare EARLIER.json says whether each row's median falls inside
the spread that an earlier run reported for the same k (the rerun check). Writes bench/results/draft_length.json
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
    ap.add_argument("--ks", default="", help="comma-separated subset of the rows to run, e.g. 3,auto (default: 1..max-k, auto)")
    ap.add_argument("--compare", default="", help="an earlier draft_length JSON: say whether each row's median speedup "
                                                  "falls inside that run's spread for the same k")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)

    import torch

    from draftlab import costs
    from draftlab.checkpoint import resolve_checkpoint
    from draftlab.drafters import load_drafter
    from draftlab.checkpoint import checkpoint_target
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.evaluator import evaluate_side_by_side, load_average
    from draftlab.target import load_target
    from draftlab.target import eos_ids
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
    labels = [str(k) for k in range(1, args.max_k + 1)] + ["auto"]
    if args.ks:
        labels = [k.strip() for k in args.ks.split(",") if k.strip()]
    drafts = {k: (drafter.proposer(target), TreeSpec(kind="chain", draft_length=chosen if k == "auto" else int(k)))
              for k in labels}
    reports = evaluate_side_by_side(target, drafts, ids, sampling=Sampling(), max_new_tokens=args.max_new_tokens,
                                    eos_token_ids=eos, repeats=args.repeats)
    earlier = {str(r["k"]): r for r in json.loads(Path(args.compare).read_text())["rows"]} if args.compare else {}
    rows = []
    for k in labels:
        report = reports[k]
        row = {"k": k if k == "auto" else int(k), "draft_length": drafts[k][1].draft_length, **{key: report[key] for key in (
            "acceptance_length", "per_position_acceptance", "speedup", "speedup_min", "speedup_max", "speedups",
            "tokens_per_second", "baseline_tokens_per_second", "lossless", "timing_repeats", "load_average")}}
        if k in earlier:
            before = earlier[k]
            row["earlier"] = {key: before[key] for key in ("speedup", "speedup_min", "speedup_max", "draft_length")}
            row["within_earlier_spread"] = before["speedup_min"] <= row["speedup"] <= before["speedup_max"]
        rows.append(row)
        print(f"k={k}: tau {row['acceptance_length']:.3f}, speedup {row['speedup']:.3f}x "
              f"[{row['speedup_min']:.3f}, {row['speedup_max']:.3f}], load {row['load_average']}", flush=True)
    fixed = [r for r in rows if r["k"] != "auto"]
    auto = next((r for r in rows if r["k"] == "auto"), None)
    load_end = load_average()
    busy = max(load_start or 0, load_end or 0) > args.threads + 0.5
    headline = {"auto_k": chosen, "busy": busy}
    if fixed:
        best = max(fixed, key=lambda r: r["speedup"])
        headline.update(best_fixed_k=best["k"], best_fixed_speedup=best["speedup"],
                        best_fixed_spread=[best["speedup_min"], best["speedup_max"]])
    if fixed and auto:
        gap = 1 - auto["speedup"] / best["speedup"]
        headline.update(auto_speedup=auto["speedup"], auto_shortfall=gap, within_5_percent=gap <= 0.05)
    if args.compare:
        headline["compared_with"] = args.compare
        headline["rows_within_earlier_spread"] = {str(r["k"]): r["within_earlier_spread"] for r in rows
                                                  if "within_earlier_spread" in r}
    result = {"header": {"command": " ".join(sys.argv), "checkpoint": str(folder), "num_prompts": args.num_prompts,
                         "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": args.threads,
                         "nproc": os.cpu_count(), "load_average_start": load_start, "load_average_end": load_end,
                         "draft_shape": shape},
              "headline": headline, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"Drafter `{folder}`; the first {args.num_prompts} MT-bench first turns x {args.max_new_tokens} tokens, "
             f"greedy, {args.repeats} interleaved repeats against the same target-only runs, {args.threads} thread(s); "
             f"load average {load_start} at the start, {load_end} at the end"
             + (" (**busy machine**)." if busy else "."),
             f"Command: `{result['header']['command']}`", "",
             f"auto measured a target step of {shape['target_step_cost'] * 1e3:.1f} ms and a draft step of "
             f"{shape['draft_step_cost'] * 1e3:.1f} ms on 4 held-out calibration prompts "
             f"(pilot tau {shape['pilot_tau']:.3f}) and chose k = {chosen}.", ""]
    compare = bool(args.compare)
    lines += ["| k | tau | per-position acceptance | speedup (median) | min | max | lossless |"
              + (" earlier median [min, max] | inside |" if compare else ""),
              "|---|---|---|---|---|---|---|" + ("---|---|" if compare else "")]
    for r in rows:
        name = f"auto (k={chosen})" if r["k"] == "auto" else str(r["k"])
        line = (f"| {name} | {r['acceptance_length']:.3f} | {', '.join(f'{a:.2f}' for a in r['per_position_acceptance'])}"
                f" | {r['speedup']:.3f}x | {r['speedup_min']:.3f} | {r['speedup_max']:.3f} | "
                f"{'yes' if r['lossless'] else 'NO'} |")
        if compare:
            e = r.get("earlier")
            line += (f" {e['speedup']:.3f}x [{e['speedup_min']:.3f}, {e['speedup_max']:.3f}] (k={e['draft_length']}) | "
                     f"{'yes' if r['within_earlier_spread'] else 'no'} |" if e else " - | - |")
        lines.append(line)
    if fixed and auto:
        lines += ["", f"Best fixed k = {best['k']} ({best['speedup']:.3f}x, spread {best['speedup_min']:.3f}-"
                      f"{best['speedup_max']:.3f}); auto chose k = {chosen} ({auto['speedup']:.3f}x): "
                      f"{abs(gap):.1%} {'below' if gap >= 0 else 'above'} the best fixed k "
                      f"({'within' if gap <= 0.05 else 'NOT within'} 5%)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

if __name__ == "__main__":
    main()
