"""DISCO (and SpecDec++) against fixed chains and `--draft-length auto` on one SmolLM2 checkpoint, side by side.

    nohup python bench/disco.py > bench/results/cache/disco/run.log 2>&1 &
    nohup python bench/disco.py --checkpoint SMALL_LM_RUN --acceptance ACCEPTANCE_RUN --name disco_small_lm > LOG 2>&1 &

One chain drafter for SmolLM2-135M-Instruct (default: the EAGLE-3 head checkpoints/peer_ablation/base of the main
checkout, trained on 392 conversations of the training distribution). Stages, each cached in
bench/results/cache/NAME/ (--name, default disco; a rerun continues):
1. log: greedy chains of --max-length drafted on training prompts (data_prep/prompts/train_prompts_small.jsonl rows
   --train-from.., which the head was trained on; none of the scored prompts) written as a round log.
2. classifier: DISCO's stop classifier trained from that log (draftlab.disco.train_classifier).
3. costs: costs.auto_draft_length on 4 more training prompts: draft and verification costs measured on this machine
   and the pilot's per-position acceptance; auto's k and DISCO's round costs both come from it.
4. score: per prompt set (the first --mtbench MT-bench first turns, the first --heldout prompts of
   data_prep/prompts/heldout_train_dist.jsonl), fixed chains k in --ks, auto's k and DISCO (chains of up to
   --max-length) timed against the same interleaved target-only runs (evaluator.evaluate_side_by_side, --repeats,
   rotating order): tau, per-position acceptance, mean draft length, median speedup with its min and max, lossless.
   With --acceptance RUN (a SpecDec++ acceptance head, drafter kind `acceptance`, whose drafter.base is the small_lm
   drafter of --checkpoint; without --checkpoint that base is used), one more row per --thresholds value: the head's
   own proposer (AcceptanceHead.proposer, as `draftlab eval --adaptive-threshold`), chains of up to --max-length
   that stop once 1 - prod(p_hat) > threshold, with the head's min_draft.
--stop-after log|classifier|costs ends after that stage (e.g. to log rounds while the acceptance head still trains).
Writes bench/results/NAME.json and .md.
"""
from __future__ import annotations

import json
import os
import sys
import time

from common import CHECKPOINT, ROOT, SHARED, log, parser  # bench/common.py (it puts the checkout on sys.path)

RESULTS = ROOT / "bench" / "results"
TRAIN = ROOT / "data_prep" / "prompts" / "train_prompts_small.jsonl"
SETS = {"mtbench": SHARED / "mtbench.jsonl", "heldout": ROOT / "data_prep" / "prompts" / "heldout_train_dist.jsonl"}
KIND_NAMES = {"eagle3": "EAGLE-3 head", "eagle": "EAGLE head", "small_lm": "small_lm drafter", "medusa": "Medusa heads"}
STAGES = ("log", "classifier", "costs")


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.set_defaults(checkpoint=None)     # None: common.CHECKPOINT, or the base of --acceptance
    ap.add_argument("--acceptance", default=None, metavar="RUN",
                    help="a SpecDec++ acceptance-head checkpoint whose base is --checkpoint: adds SpecDec++ rows")
    ap.add_argument("--thresholds", default=None,
                    help="comma-separated SpecDec++ stop thresholds (default: the head's drafter.adaptive_threshold)")
    ap.add_argument("--name", default="disco", help="cache bench/results/cache/NAME/, output bench/results/NAME.*")
    ap.add_argument("--stop-after", choices=STAGES, default=None)
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
    from draftlab.checkpoint import checkpoint_target
    from draftlab.rounds import RoundLog, read_rounds
    from draftlab.target import eos_ids, load_target
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    torch.set_num_threads(args.threads)
    cache, out = RESULTS / "cache" / args.name, RESULTS / args.name
    cache.mkdir(parents=True, exist_ok=True)
    if args.thresholds and not args.acceptance:
        sys.exit("--thresholds goes with --acceptance RUN (the SpecDec++ head they apply to)")
    acceptance = resolve_checkpoint(args.acceptance) if args.acceptance else None
    if acceptance is not None:    # the head names its base (an absolute step folder): it must be the drafter scored
        from draftlab.checkpoint import read_drafter_config

        head_config = read_drafter_config(acceptance)
        if head_config.get("kind") != "acceptance":
            sys.exit(f"--acceptance {args.acceptance}: a '{head_config.get('kind')}' checkpoint, not an acceptance "
                     "head")
        base = resolve_checkpoint(head_config["base"])
        if args.checkpoint and resolve_checkpoint(args.checkpoint).resolve() != base.resolve():
            sys.exit(f"--acceptance {args.acceptance} judges the drafter {base}, not --checkpoint {args.checkpoint}: "
                     "pass its base (or leave --checkpoint out)")
        args.checkpoint = args.checkpoint or str(base)
    folder = resolve_checkpoint(args.checkpoint or CHECKPOINT)
    target, tokenizer = load_target(checkpoint_target(folder), "auto", "cpu")
    drafter = load_drafter(folder, target).eval()
    head = load_drafter(acceptance, target).eval() if acceptance is not None else None
    thresholds = ([float(t) for t in args.thresholds.split(",") if t.strip()] if args.thresholds
                  else [head.settings["adaptive_threshold"]]) if head is not None else []
    eos = eos_ids(tokenizer, target)
    greedy = Sampling()
    encode = lambda path, limit: [encode_prompt(tokenizer, p.messages) for p in load_prompts(str(path), limit=limit)]
    train_ids = encode(TRAIN, args.train_prompts + 4)
    load_start = load_average()

    # 1. rounds of fixed chains on training prompts
    rounds_file = cache / "rounds_train.jsonl"
    if not (cache / "rounds_train.done").exists():
        log(f"logging rounds of chains of {args.max_length} on {args.train_prompts} training prompts")
        start = time.perf_counter()
        proposer = drafter.proposer(target)
        with RoundLog(rounds_file) as rounds:
            for i, p in enumerate(train_ids[:args.train_prompts]):
                speculative_generate(target, proposer, p, TreeSpec(kind="chain", draft_length=args.max_length), greedy,
                                     args.max_new_tokens, eos, prompt_generator(target.device, 0, i),
                                     rounds.for_prompt(i, p))
        (cache / "rounds_train.done").write_text(f"{time.perf_counter() - start:.1f} s\n")
    rows = read_rounds(rounds_file)
    if args.stop_after == "log":
        return

    # 2. the classifier
    if not (cache / "classifier" / disco.CONFIG_NAME).exists():
        x, y = disco.examples_from_rounds(rows)
        model, history = disco.train_classifier(x, y)
        losses = history.pop("train_loss")
        disco.save_classifier(model, cache / "classifier", {"rounds": [str(rounds_file.relative_to(ROOT))],
                                                            "round_rows": len(rows), "train_loss_first": losses[0],
                                                            "train_loss_last": losses[-1], **history})
    classifier = disco.load_classifier(cache / "classifier")
    log(f"classifier: {classifier.info['examples']} examples, accepted {classifier.info['positive_rate']:.3f}, "
        f"loss {classifier.info['train_loss_first']:.3f} -> {classifier.info['train_loss_last']:.3f}, "
        f"validation accuracy {classifier.info.get('val_accuracy', float('nan')):.3f}")
    if args.stop_after == "classifier":
        return

    # 3. costs measured here (auto's choice and DISCO's round costs)
    shape_file = cache / "shape.json"
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
    if args.stop_after == "costs":
        return

    # 4. side by side per prompt set
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    results = {}
    for name, path in SETS.items():
        count = getattr(args, name)
        drafts = {f"k={k}": (drafter.proposer(target), TreeSpec(kind="chain", draft_length=k)) for k in ks}
        drafts[f"auto (k={auto_k})"] = (drafter.proposer(target), TreeSpec(kind="chain", draft_length=auto_k))
        drafts["DISCO"] = (disco.wrap(drafter.proposer(target), classifier, round_costs, args.max_length, "classifier"),
                           TreeSpec(kind="chain", draft_length=args.max_length))
        for t in thresholds:     # the head's own proposer: draftlab eval --adaptive-threshold's code path
            drafts[specdec_label(t)] = (head.proposer(target, adaptive_threshold=t),
                                        TreeSpec(kind="chain", draft_length=args.max_length))
        done = cache / f"score_{name}.json"
        if done.exists():
            cached = json.loads(done.read_text())
            if list(cached) == list(drafts):
                results[name] = cached
                continue
            log(f"{done.name} holds the rows {list(cached)}, not {list(drafts)}: scoring again")
        log(f"scoring {count} {name} prompts: fixed k {ks}, auto k={auto_k}, DISCO <= {args.max_length}"
            + (f", SpecDec++ thresholds {thresholds} <= {args.max_length}" if thresholds else "")
            + f", {args.repeats} repeats")
        reports = evaluate_side_by_side(target, drafts, encode(path, count), sampling=greedy,
                                        max_new_tokens=args.max_new_tokens, eos_token_ids=eos, repeats=args.repeats)
        keep = ("acceptance_length", "per_position_acceptance", "mean_draft_length", "wasted_draft_tokens", "rounds",
                "new_tokens", "speedup", "speedup_min", "speedup_max", "speedups", "tokens_per_second",
                "baseline_tokens_per_second", "lossless", "load_average", "calibration")
        results[name] = {label: {k: r.get(k) for k in keep if k != "calibration" or adaptive_row(label)}
                         for label, r in reports.items()}
        for label, r in results[name].items():
            log(f"{name} {label}: tau {r['acceptance_length']:.3f}, mean draft {r['mean_draft_length']:.2f}, speedup "
                f"{r['speedup']:.3f}x [{r['speedup_min']:.3f}, {r['speedup_max']:.3f}], lossless {r['lossless']}")
        done.write_text(json.dumps(results[name], indent=2))
    write(args, out, folder, head, acceptance, shape, classifier, results, load_start, load_average())


def specdec_label(threshold: float) -> str:
    return f"SpecDec++ (threshold {threshold:g})"


def adaptive_row(label: str) -> bool:
    """Rows whose proposer predicts acceptance (their reports keep the calibration)."""
    return label == "DISCO" or label.startswith("SpecDec++")


def run_training(folder: Path) -> dict:
    """What a checkpoint's run was trained on: recipe, data, steps, batch (from its run's config.yaml) and its
    training time (metrics.jsonl, the steps alone: no model loading); {} without a config.yaml."""
    from omegaconf import OmegaConf

    run = folder if (folder / "config.yaml").is_file() else folder.parent
    if not (run / "config.yaml").is_file():
        return {}
    cfg = OmegaConf.load(run / "config.yaml")
    info = {"run": str(run), "recipe": cfg.get("recipe"), "data": cfg.data.train, "max_length": cfg.data.max_length,
            "steps": cfg.train.max_steps, "batch_size": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum,
            "lr": cfg.train.lr, "kind": cfg.drafter.kind}
    for key in ("target_layers", "draft_vocab_size", "base", "adaptive_threshold", "min_draft", "acceptance_label"):
        if key in cfg.drafter:
            value = cfg.drafter[key]
            info[key] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"train_seconds"' in line]
        if steps:    # train_seconds: each line's logging interval
            info["train_seconds"] = sum(step["train_seconds"] for step in steps)
            info["train_loss_last"] = steps[-1].get("loss")
    return info


def training_text(info: dict) -> str:
    if not info:
        return "its training run is not described here"
    extra = "".join(f", {k} {info[k]}" for k in ("target_layers", "draft_vocab_size", "acceptance_label")
                    if k in info)
    took = f", {info['train_seconds'] / 60:.1f} min of training" if "train_seconds" in info else ""
    return (f"recipe `{info['recipe']}` ({info['kind']}{extra}), {info['steps']} steps of batch {info['batch_size']} x "
            f"{info['grad_accum']} at lr {info['lr']:g}, max length {info['max_length']}, on `{info['data']}`{took}")


def compare(row: dict, best: dict) -> dict:
    return {"speedup": row["speedup"], "spread": [row["speedup_min"], row["speedup_max"]],
            "vs_best_fixed": row["speedup"] / best["speedup"] - 1,
            "spreads_overlap": row["speedup_min"] <= best["speedup_max"] and best["speedup_min"] <= row["speedup_max"]}


def write(args, out, folder, head, acceptance, shape, classifier, results, load_start, load_end) -> None:
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
        specdec = {label: compare(r, fixed[best]) for label, r in rows.items() if label.startswith("SpecDec++")}
        if specdec:
            headline[s]["specdec"] = specdec
    drafter_training = run_training(folder)
    if head is not None:
        specdec_info = {"checkpoint": str(acceptance), "base": head.settings["base"],
                        "min_draft": head.settings["min_draft"], "training": run_training(acceptance)}
    else:
        specdec_info = "not run: it needs a small_lm base drafter (--acceptance RUN)"
    result = {"header": {"command": "python bench/disco.py " + " ".join(sys.argv[1:]), "commit": commit,
                         "checkpoint": str(folder), "drafter_training": drafter_training,
                         "max_new_tokens": args.max_new_tokens,
                         "max_length": args.max_length, "repeats": args.repeats, "threads": args.threads,
                         "nproc": os.cpu_count(), "prompts": {"mtbench": args.mtbench, "heldout": args.heldout},
                         "train_prompts": args.train_prompts, "load_average": [load_start, load_end],
                         "draft_shape": shape, "classifier": classifier.info,
                         "specdec_acceptance_head": specdec_info},
              "headline": headline, "pooled": pooled, "sets": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    info = classifier.info
    from draftlab.checkpoint import read_drafter_config

    kind = read_drafter_config(folder).get("kind", "")
    title = "DISCO stop classifier" + (" and SpecDec++ acceptance head" if head is not None else "")
    lines = [f"# {title} against fixed chains and `--draft-length auto` (`bench/disco.py`)", "",
             f"Command: `{result['header']['command']}` at {commit}. Drafter: the "
             f"{KIND_NAMES.get(kind, kind or 'drafter')} `{folder}` for SmolLM2-135M-Instruct "
             f"({training_text(drafter_training)}); greedy, {args.max_new_tokens} new tokens, {args.repeats} "
             f"interleaved repeats against the same target-only runs per prompt set, {args.threads} thread(s) on a "
             f"{os.cpu_count()}-core machine shared with other jobs (load average {load_start} at the start, "
             f"{load_end} at the end).", "",
             f"DISCO's classifier was trained on {info['round_rows']} logged rounds (chains of {args.max_length}) of "
             f"{args.train_prompts} training prompts, none of them scored: {info['examples']} judged draft tokens, "
             f"{info['positive_rate']:.1%} accepted; loss {info['train_loss_first']:.3f} -> {info['train_loss_last']:.3f},"
             f" validation accuracy {info.get('val_accuracy', float('nan')):.3f} (always-reject would score "
             f"{1 - info['positive_rate']:.3f}). Costs measured here by `costs.auto_draft_length` on 4 other training "
             f"prompts: target step {shape['target_step_cost'] * 1e3:.1f} ms, draft step "
             f"{shape['draft_step_cost'] * 1e3:.1f} ms, round overhead {shape['round_overhead'] * 1e3:.1f} ms; "
             f"auto chose k = {shape['chosen_draft_length']}.", ""]
    if head is not None:
        lines += [f"SpecDec++: the acceptance head `{acceptance}` on that drafter (base `{head.settings['base']}`; "
                  f"{training_text(specdec_info['training'])}); its rows draft chains of up to {args.max_length} "
                  f"tokens (at least min_draft {head.settings['min_draft']}) that stop once 1 - prod(p_hat) exceeds "
                  "the threshold, through the head's own proposer (`draftlab eval --adaptive-threshold`'s code path).",
                  ""]
    else:
        lines += ["The SpecDec++ acceptance head was not run (it needs a small_lm base drafter: `--acceptance RUN`).",
                  ""]
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
                     if calib else "")]
        for label, c in h.get("specdec", {}).items():
            calib = rows[label].get("calibration") or {}
            lines[-1] += (f" {label}: {c['speedup']:.3f}x [{c['spread'][0]:.3f}, {c['spread'][1]:.3f}], "
                          f"{c['vs_best_fixed']:+.1%} against the best fixed chain; the spreads "
                          f"{'overlap' if c['spreads_overlap'] else 'do not overlap'}."
                          + (f" Its predicted acceptance: ECE {calib['ece']:.3f} over {calib['num_tokens']} judged "
                             "tokens." if calib else ""))
        lines.append("")
    lines += ["tau over both sets: " + ", ".join(f"{label} {p['acceptance_length']:.3f}" for label, p in pooled.items())
              + "."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
