"""DISCO against fixed chains and `--draft-length auto` on one SmolLM2 checkpoint, side by side.

    nohup python bench/disco.py > bench/results/cache/disco/run.log 2>&1 &

One EAGLE-3 head for SmolLM2-135M-Instruct (default: checkpoints/peer_ablation/base of the main checkout, trained on
392 conversations of the training distribution). Stages, each cached in bench/results/cache/disco/ (a rerun continues):
1. log: greedy chains of --max-length drafted on training prompts (data_prep/prompts/train_prompts_small.jsonl rows
   --train-from.., which the head was trained on; none of the scored prompts) written as a round log.
2. classifier: DISCO's stop classifier trained from that log (draftlab.disco.train_classifier).
3. costs: costs.auto_draft_length on 4 more training prompts: draft and verification costs measured on this machine
   and the pilot's per-position acceptance; auto's k and DISCO's round costs both come from it.
4. score: per prompt set (the first --mtbench MT-bench first turns, the first --heldout prompts of
   data_prep/prompts/heldout_train_dist.jsonl), fixed chains k in --ks, auto's k and DISCO (chains of up to
   --max-length) timed against the same interleaved target-only runs (evaluator.evaluate_side_by_side, --repeats,
   rotating order): tau, per-position acceptance, mean draft length, median speedup with its min and max, lossless.
The SpecDec++ acceptance head is not in the comparison: it judges a small_lm drafter (drafter.base), and no small_lm
checkpoint for SmolLM2 exists here to put beside this EAGLE-3 head at a cost that fits the benchmark.
Writes bench/results/disco.json and .md.
"""
from __future__ import annotations

import json
import os
import sys
import time

from common import ROOT, SHARED, log, parser  # bench/common.py (it puts the checkout on sys.path)

CACHE = ROOT / "bench" / "results" / "cache" / "disco"
OUT = ROOT / "bench" / "results" / "disco"
TRAIN = ROOT / "data_prep" / "prompts" / "train_prompts_small.jsonl"
SETS = {"mtbench": SHARED / "mtbench.jsonl", "heldout": ROOT / "data_prep" / "prompts" / "heldout_train_dist.jsonl"}


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--train-prompts", type=int, default=24, help="training prompts whose rounds train DISCO")
    ap.add_argument("--mtbench", type=int, default=12)
    ap.add_argument("--heldout", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=8)
    ap.add_argument("--ks", default="1,2,3,4,6")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    from draftlab import costs, disco
    from draftlab.checkpoint import resolve_checkpoint
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.drafters import load_drafter
    from draftlab.evaluator import evaluate_side_by_side, load_average, prompt_generator, speculative_generate
    from draftlab.hub import checkpoint_target
    from draftlab.rounds import RoundLog, read_rounds
    from draftlab.target import eos_ids, load_target
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    torch.set_num_threads(args.threads)
    CACHE.mkdir(parents=True, exist_ok=True)
    folder = resolve_checkpoint(args.checkpoint)
    target, tokenizer = load_target(checkpoint_target(folder), "auto", "cpu")
    drafter = load_drafter(folder, target).eval()
    eos = eos_ids(tokenizer, target)
    greedy = Sampling()
    encode = lambda path, limit: [encode_prompt(tokenizer, p.messages) for p in load_prompts(str(path), limit=limit)]
    train_ids = encode(TRAIN, args.train_prompts + 4)
    load_start = load_average()

    # 1. rounds of fixed chains on training prompts
    rounds_file = CACHE / "rounds_train.jsonl"
    if not (CACHE / "rounds_train.done").exists():
        log(f"logging rounds of chains of {args.max_length} on {args.train_prompts} training prompts")
        start = time.perf_counter()
        proposer = drafter.proposer(target)
        with RoundLog(rounds_file) as rounds:
            for i, p in enumerate(train_ids[:args.train_prompts]):
                speculative_generate(target, proposer, p, TreeSpec(kind="chain", draft_length=args.max_length), greedy,
                                     args.max_new_tokens, eos, prompt_generator(target.device, 0, i),
                                     rounds.for_prompt(i, p))
        (CACHE / "rounds_train.done").write_text(f"{time.perf_counter() - start:.1f} s\n")
    rows = read_rounds(rounds_file)

    # 2. the classifier
    if not (CACHE / "classifier" / disco.CONFIG_NAME).exists():
        x, y = disco.examples_from_rounds(rows)
        model, history = disco.train_classifier(x, y)
        losses = history.pop("train_loss")
        disco.save_classifier(model, CACHE / "classifier", {"rounds": [str(rounds_file.relative_to(ROOT))],
                                                            "round_rows": len(rows), "train_loss_first": losses[0],
                                                            "train_loss_last": losses[-1], **history})
    classifier = disco.load_classifier(CACHE / "classifier")
    log(f"classifier: {classifier.info['examples']} examples, accepted {classifier.info['positive_rate']:.3f}, "
        f"loss {classifier.info['train_loss_first']:.3f} -> {classifier.info['train_loss_last']:.3f}, "
        f"validation accuracy {classifier.info.get('val_accuracy', float('nan')):.3f}")

    # 3. costs measured here (auto's choice and DISCO's round costs)
    shape_file = CACHE / "shape.json"
    if not shape_file.exists():
        log("measuring costs (auto_draft_length on 4 training prompts)")
        shape = costs.auto_draft_length(target, drafter.proposer(target), train_ids[args.train_prompts:], greedy,
                                        max_length=args.max_length, max_new_tokens=64, eos_token_ids=eos)
        shape_file.write_text(json.dumps(shape, indent=2))
    shape = json.loads(shape_file.read_text())
    ints = lambda d: {int(k): v for k, v in d.items()}
    round_costs = disco.RoundCosts(ints(shape["draft_cost"]), ints(shape["verify_cost"]), shape["round_overhead"])
    auto_k = shape["chosen_draft_length"]
    log(f"auto: k={auto_k}; target step {shape['target_step_cost'] * 1e3:.1f} ms, draft step "
        f"{shape['draft_step_cost'] * 1e3:.1f} ms, overhead {shape['round_overhead'] * 1e3:.1f} ms")

    # 4. side by side per prompt set
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    results = {}
    for name, path in SETS.items():
        count = getattr(args, name)
        done = CACHE / f"score_{name}.json"
        if done.exists():
            results[name] = json.loads(done.read_text())
            continue
        log(f"scoring {count} {name} prompts: fixed k {ks}, auto k={auto_k}, DISCO <= {args.max_length}, "
            f"{args.repeats} repeats")
        drafts = {f"k={k}": (drafter.proposer(target), TreeSpec(kind="chain", draft_length=k)) for k in ks}
        drafts[f"auto (k={auto_k})"] = (drafter.proposer(target), TreeSpec(kind="chain", draft_length=auto_k))
        drafts["DISCO"] = (disco.wrap(drafter.proposer(target), classifier, round_costs, args.max_length, "classifier"),
                           TreeSpec(kind="chain", draft_length=args.max_length))
        reports = evaluate_side_by_side(target, drafts, encode(path, count), sampling=greedy,
                                        max_new_tokens=args.max_new_tokens, eos_token_ids=eos, repeats=args.repeats)
        keep = ("acceptance_length", "per_position_acceptance", "mean_draft_length", "wasted_draft_tokens", "rounds",
                "new_tokens", "speedup", "speedup_min", "speedup_max", "speedups", "tokens_per_second",
                "baseline_tokens_per_second", "lossless", "load_average", "calibration")
        results[name] = {label: {k: r.get(k) for k in keep if k != "calibration" or label == "DISCO"}
                         for label, r in reports.items()}
        for label, r in results[name].items():
            log(f"{name} {label}: tau {r['acceptance_length']:.3f}, mean draft {r['mean_draft_length']:.2f}, speedup "
                f"{r['speedup']:.3f}x [{r['speedup_min']:.3f}, {r['speedup_max']:.3f}], lossless {r['lossless']}")
        done.write_text(json.dumps(results[name], indent=2))
    write(args, folder, shape, classifier, results, load_start, load_average())


def write(args, folder, shape, classifier, results, load_start, load_end) -> None:
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    labels = list(next(iter(results.values())))
    pooled = {}
    for label in labels:
        new = sum(results[s][label]["new_tokens"] for s in results)
        rounds = sum(results[s][label]["rounds"] for s in results)
        pooled[label] = {"acceptance_length": new / rounds, "lossless": all(results[s][label]["lossless"]
                                                                          for s in results)}
    headline = {}
    for s, rows in results.items():
        fixed = {k: r for k, r in rows.items() if k.startswith("k=")}
        best = max(fixed, key=lambda k: fixed[k]["speedup"])
        d = rows["DISCO"]
        headline[s] = {"best_fixed": best, "best_fixed_speedup": fixed[best]["speedup"],
                       "best_fixed_spread": [fixed[best]["speedup_min"], fixed[best]["speedup_max"]],
                       "disco_speedup": d["speedup"], "disco_spread": [d["speedup_min"], d["speedup_max"]],
                       "disco_vs_best_fixed": d["speedup"] / fixed[best]["speedup"] - 1,
                       "spreads_overlap": d["speedup_min"] <= fixed[best]["speedup_max"]
                       and fixed[best]["speedup_min"] <= d["speedup_max"]}
    result = {"header": {"command": "python bench/disco.py " + " ".join(sys.argv[1:]), "commit": commit,
                         "checkpoint": str(folder), "max_new_tokens": args.max_new_tokens,
                         "max_length": args.max_length, "repeats": args.repeats, "threads": args.threads,
                         "nproc": os.cpu_count(), "prompts": {"mtbench": args.mtbench, "heldout": args.heldout},
                         "train_prompts": args.train_prompts, "load_average": [load_start, load_end],
                         "draft_shape": shape, "classifier": classifier.info,
                         "specdec_acceptance_head": "not run: it needs a small_lm base drafter, none exists here"},
              "headline": headline, "pooled": pooled, "sets": results}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    info = classifier.info
    lines = ["# DISCO stop classifier against fixed chains and `--draft-length auto` (`bench/disco.py`)", "",
             f"Command: `{result['header']['command']}` at {commit}. Drafter: the EAGLE-3 head `{folder}` for "
             f"SmolLM2-135M-Instruct; greedy, {args.max_new_tokens} new tokens, {args.repeats} interleaved repeats "
             f"against the same target-only runs per prompt set, {args.threads} thread(s) on a {os.cpu_count()}-core "
             f"machine shared with other jobs (load average {load_start} at the start, {load_end} at the end).", "",
             f"DISCO's classifier was trained on {info['round_rows']} logged rounds (chains of {args.max_length}) of "
             f"{args.train_prompts} training prompts, none of them scored: {info['examples']} judged draft tokens, "
             f"{info['positive_rate']:.1%} accepted; loss {info['train_loss_first']:.3f} -> {info['train_loss_last']:.3f},"
             f" validation accuracy {info.get('val_accuracy', float('nan')):.3f} (always-reject would score "
             f"{1 - info['positive_rate']:.3f}). Costs measured here by `costs.auto_draft_length` on 4 other training "
             f"prompts: target step {shape['target_step_cost'] * 1e3:.1f} ms, draft step "
             f"{shape['draft_step_cost'] * 1e3:.1f} ms, round overhead {shape['round_overhead'] * 1e3:.1f} ms; "
             f"auto chose k = {shape['chosen_draft_length']}. The SpecDec++ acceptance head was not run (it needs a "
             "small_lm base drafter; none exists for SmolLM2 here).", ""]
    for s, rows in results.items():
        lines += [f"## {s} ({getattr(args, s)} prompts)", "",
                  "| drafting | tau | per-position acceptance | mean draft length | speedup (median) | min | max | lossless |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, r in rows.items():
            lines.append(f"| {label} | {r['acceptance_length']:.3f} | "
                         f"{', '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} | {r['mean_draft_length']:.2f} | "
                         f"{r['speedup']:.3f}x | {r['speedup_min']:.3f} | {r['speedup_max']:.3f} | "
                         f"{'yes' if r['lossless'] else 'NO'} |")
        h = headline[s]
        calib = rows["DISCO"].get("calibration") or {}
        lines += ["", f"Best fixed {h['best_fixed']}: {h['best_fixed_speedup']:.3f}x "
                      f"[{h['best_fixed_spread'][0]:.3f}, {h['best_fixed_spread'][1]:.3f}]; DISCO "
                      f"{h['disco_speedup']:.3f}x [{h['disco_spread'][0]:.3f}, {h['disco_spread'][1]:.3f}], "
                      f"{h['disco_vs_best_fixed']:+.1%} against it; the spreads "
                      f"{'overlap' if h['spreads_overlap'] else 'do not overlap'}."
                  + (f" DISCO's predicted acceptance: ECE {calib['ece']:.3f} over {calib['num_tokens']} judged tokens."
                     if calib else ""), ""]
    lines += ["tau over both sets: " + ", ".join(f"{label} {p['acceptance_length']:.3f}" for label, p in pooled.items())
              + "."]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
