"""Is the engine's data the target's data? llama.cpp answers against transformers answers, as text and as training data.

    python bench/engine_faithfulness.py                          # every stage (each skips finished work)
    python bench/engine_faithfulness.py --stages report

The same 200 prompts (the first 200 rows of ../shared/bench/smollm2_answers.jsonl: greedy, up to 256 new tokens,
the target's chat template with its default system prompt, answered by draftlab's transformers backend on the GGUF
dequantised to fp32) are answered again by the llama.cpp backend (`data_prep/regenerate.py --backend llama_cpp
--weights bf16`, the fastest engine setting of bench/results/answer_throughput.md), with the same settings. A few of
them (--check) are answered once more by the transformers backend of this checkout, to confirm that the shared file
is what it writes today.

Text: the share of answers identical to the transformers answers, and for the others the first token position (in
the target's tokens, 0 = the first answer token) where they differ.

Training: an EAGLE-3 head (recipe eagle3_head as it ships, the side by side's settings of bench/peer_speculators.sh:
packed rows of at most 512 tokens, 4 a step, TTT 3 equal weights, AdamW lr 1e-3
constant, one thread, but a 2,048-token draft vocabulary: 200 conversations hold about 3,000 distinct assistant
tokens, fewer than the side by side's 4,096) trained on each answer set, each choosing its vocabulary from its own
answers, same prompts in the same order, the same number of steps (3 epochs
of the transformers set), seeds 0 and 1. The noise is the seed-to-seed spread of each answer set.

Scoring: bench/peer_ablation.py's: real speculative decoding, greedy, 128 new tokens, chain k=5 (and with --shapes
chain,dynamic the EAGLE-2 dynamic tree), the first 20 MT-bench first turns and the 24 held-out prompts, every output
checked against the cached target-only outputs. Progress: checkpoints/engine_faithfulness/ and
bench/results/cache/engine_faithfulness/; results: bench/results/engine_faithfulness.{json,md}.
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

from common import ROOT, SHARED, log

import peer_ablation as pa

ANSWERS = SHARED / "smollm2_answers.jsonl"
RUNS_DIR = ROOT / "checkpoints/engine_faithfulness"
CACHE = ROOT / "bench/results/cache/engine_faithfulness"
OUT = ROOT / "bench/results/engine_faithfulness"
SOURCES = {"transformers": "the shared answers (transformers backend, fp32)",
           "llama_cpp": "llama.cpp backend, the GGUF converted to bf16, 32 sequences at once"}
SEEDS = (0, 1)
VOCAB = 2048
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def answer(num: int, check: int, threads: int) -> None:
    """Write the prompt file, the llama.cpp answers and the transformers re-check (each resumable)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    prompts = CACHE / "prompts.jsonl"
    if not prompts.exists():
        with open(ANSWERS) as src, open(prompts, "w") as out:
            for _, line in zip(range(num), src):
                row = json.loads(line)
                out.write(json.dumps({"id": row["id"], "source": row["source"], "messages": row["messages"][:1]}) + "\n")
    common = ["--target", pa.TARGET, "--prompts", str(prompts), "--max-new-tokens", "256", "--no-progress",
              "--threads", str(threads)]
    runs = [("llama_cpp", ["--backend", "llama_cpp", "--weights", "bf16", "--parallel", "32"], None),
            ("transformers_check", ["--backend", "transformers", "--batch-size", "16"], check)]
    for name, extra, limit in runs:
        out = CACHE / f"{name}.jsonl"
        want = limit or num
        if out.exists() and sum(1 for _ in open(out)) >= want:
            continue
        log(f"answer {name}: {want} prompts")
        t0 = time.time()
        subprocess.check_call([sys.executable, "data_prep/regenerate.py", *common, *extra, "--out", str(out),
                               *(["--num", str(limit)] if limit else [])], cwd=ROOT)
        (CACHE / f"{name}.seconds").write_text(f"{time.time() - t0:.1f}\n")


def rows_by_id(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, open(path))}


def reference(num: int) -> list[dict]:
    with open(ANSWERS) as f:
        return [json.loads(line) for _, line in zip(range(num), f)]


def compare(ref: list[dict], other: dict[str, dict], tok) -> dict:
    """Identical answers and the first differing token position of the others (over the ids both hold)."""
    same, firsts, lengths = 0, [], []
    for row in ref:
        if row["id"] not in other:
            continue
        a, b = row["messages"][-1]["content"], other[row["id"]]["messages"][-1]["content"]
        if a == b:
            same += 1
            continue
        ta, tb = tok(a, add_special_tokens=False)["input_ids"], tok(b, add_special_tokens=False)["input_ids"]
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        firsts.append(first)
        lengths.append((len(ta), len(tb)))
    n = same + len(firsts)
    firsts_sorted = sorted(firsts)
    return {"prompts": n, "identical": same, "identical_share": same / n if n else None,
            "mean_first_difference": sum(firsts) / len(firsts) if firsts else None,
            "median_first_difference": firsts_sorted[len(firsts) // 2] if firsts else None,
            "first_differences": firsts}


def make_data(num: int) -> None:
    """One training file per source (the same ids in the same order) and its feature store."""
    ref = reference(num)
    engine = rows_by_id(CACHE / "llama_cpp.jsonl")
    missing = [r["id"] for r in ref if r["id"] not in engine]
    if missing:
        raise SystemExit(f"{len(missing)} prompts have no llama.cpp answer in {CACHE / 'llama_cpp.jsonl'} (first: "
                         f"{missing[0]}): rerun with --stages answer")
    for source in SOURCES:
        folder = RUNS_DIR / "data" / source
        if (folder / "train.store" / "manifest.json").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "train.jsonl", "w") as f:
            for r in ref:
                f.write(json.dumps({"id": r["id"], "messages": (engine[r["id"]] if source == "llama_cpp" else r)["messages"]})
                        + "\n")
        log(f"features {source}")
        subprocess.check_call([sys.executable, "data_prep/dump_features.py", "--target", pa.TARGET, "--data",
                               str(folder / "train.jsonl"), "--out", str(folder / "train.store"), "--layers",
                               "2,15,27,-1", "--max-length", str(pa.MAXLEN), "--store-dtype", "float32",
                               "--no-progress"], cwd=ROOT, env=ENV)


def steps_for_epochs() -> int:
    """Optimizer steps of 3 epochs of the transformers set, packed as the runs pack (seed 0's data order)."""
    import torch

    from draftlab.data import ChatDataset, read_conversations
    from draftlab.packing import pack
    from draftlab.target import load_target

    tok = load_target(pa.TARGET, "float32", "cpu")[1]
    ds = ChatDataset(read_conversations(str(RUNS_DIR / "data/transformers/train.jsonl"))[0], tok, pa.MAXLEN)
    total = 0
    for epoch in range(pa.EPOCHS):
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(epoch)).tolist()
        total += len(pack(ds.lengths, order, pa.PACK)) // pa.PACKED_BATCH
    return total


def run_names() -> list[tuple[str, str, int]]:
    return [(f"{source}_seed{seed}", source, seed) for source in SOURCES for seed in SEEDS]


def train(name: str, source: str, seed: int, steps: int) -> None:
    out = RUNS_DIR / name
    if (out / "train.done").exists():
        return
    data = RUNS_DIR / "data" / source
    keep = [a for a in pa.COMMON if not a.startswith(("data.train=", "data.store=", "train.pack_tokens=",
                                                       "drafter.init_from_target=", "seed=",
                                                       "drafter.draft_vocab_size="))]
    args = keep + [f"data.train={data}/train.jsonl", f"data.store={data}/train.store", f"train.pack_tokens={pa.PACK}",
                   f"train.batch_size={pa.PACKED_BATCH}", f"train.max_steps={steps}", f"seed={seed}",
                   f"drafter.draft_vocab_size={VOCAB}",
                   f"out_dir={out}"] + (["train.resume=auto"] if out.exists() else [])
    log(f"train {name}: {steps} steps")
    with open(RUNS_DIR / f"{name}.train.log", "a") as f:
        code = subprocess.call(["/usr/bin/time", "-v", sys.executable, "-m", "draftlab.cli", "train", *args],
                               stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"training {name} failed (exit {code}): see {RUNS_DIR / f'{name}.train.log'}")
    (out / "train.done").write_text(time.strftime("%Y-%m-%d %H:%M:%S") + "\n")


def report(num: int) -> None:
    from draftlab.target import load_target

    tok = load_target(pa.TARGET, "float32", "cpu")[1]
    ref = reference(num)
    text = {"llama_cpp": compare(ref, rows_by_id(CACHE / "llama_cpp.jsonl"), tok)}
    check = CACHE / "transformers_check.jsonl"
    if check.exists():
        text["transformers_check"] = compare(ref, rows_by_id(check), tok)
    seconds = {n: float((CACHE / f"{n}.seconds").read_text()) for n in ("llama_cpp", "transformers_check")
               if (CACHE / f"{n}.seconds").exists()}
    runs = []
    for name, source, seed in run_names():
        if not (RUNS_DIR / name / "train.done").exists():
            continue
        row = {"run": name, "answers": source, "seed": seed, **pa.training_figures(name, RUNS_DIR)}
        for s in pa.SETS:
            for t in pa.SHAPES:
                f = CACHE / f"{name}_{s}_{t}.json"
                if f.exists():
                    r = json.loads(f.read_text())
                    row[f"tau_{s}_{t}"], row[f"lossless_{s}_{t}"] = r["acceptance_length"], r["lossless"]
        runs.append(row)
    cells = [f"tau_{s}_{t}" for s in pa.SETS for t in pa.SHAPES if any(f"tau_{s}_{t}" in r for r in runs)]
    verdicts = {}
    for c in cells:
        by = {src: [r[c] for r in runs if r["answers"] == src and c in r] for src in SOURCES}
        if any(len(v) < len(SEEDS) for v in by.values()):
            continue
        mean = {src: sum(v) / len(v) for src, v in by.items()}
        noise = max(max(v) - min(v) for v in by.values())
        gap = mean["llama_cpp"] - mean["transformers"]
        verdicts[c] = {"mean": mean, "seed_spread": {src: max(v) - min(v) for src, v in by.items()},
                       "noise": noise, "difference": gap, "within_noise": abs(gap) <= noise}
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    doc = {"command": "python bench/engine_faithfulness.py", "git_revision": git, "prompts": num,
           "answers_reference": str(ANSWERS.relative_to(ROOT.parent)), "sources": SOURCES, "answer_seconds": seconds,
           "text": text, "runs": runs, "tau_agreement": verdicts,
           "settings": {"epochs_of_transformers_set": pa.EPOCHS, "pack_tokens": pa.PACK, "rows_per_step": pa.PACKED_BATCH,
                        "max_new_tokens": pa.MAX_NEW, "prompt_sets": {k: [str(v[0].relative_to(ROOT.parent)), v[1]]
                                                                      for k, v in pa.SETS.items()},
                        "shapes": pa.SHAPES, "seeds": list(SEEDS), "draft_vocab_size": VOCAB}}
    OUT.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")

    def num_(v, f):
        return "-" if v is None else format(v, f)

    lines = ["# Is the engine's data the target's data? (`python bench/engine_faithfulness.py`)", "",
             f"At {git[:12]}. " + " ".join(__doc__.split("\n\n")[2:6]).replace("\n", " "), "",
             "## The answers as text", "",
             "| answers | prompts | identical | mean first difference | median |", "|---|---|---|---|---|"]
    for name, t in text.items():
        lines.append(f"| {name} | {t['prompts']} | {t['identical']} ({num_(t['identical_share'], '.0%')}) | "
                     f"{num_(t['mean_first_difference'], '.1f')} | {num_(t['median_first_difference'], 'd')} |")
    lines += ["", "First difference: token position (0 = the first answer token) where an answer leaves the shared "
              "transformers answer, over the answers that are not identical. transformers_check: this checkout's "
              "transformers backend on the first prompts, against the shared file."
              + (" Answering took " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + " (wall, loaded machine)."
                 if seconds else ""), "", "## EAGLE-3 heads trained on each", "",
              "| run | answers | seed | steps | train tokens | train tokens/s | " + " | ".join(
                  c.removeprefix("tau_").replace("_", " ") for c in cells) + " | lossless |",
              "|---|---|---|---|---|---|" + "---|" * len(cells) + "---|"]
    for r in runs:
        checks = [v for k, v in r.items() if k.startswith("lossless_")]
        lines.append(f"| {r['run']} | {r['answers']} | {r['seed']} | {r['steps']} | {int(r['train_tokens']):,} | "
                     f"{num_(r.get('train_tokens_per_second'), '.1f')} | "
                     + " | ".join(num_(r.get(c), ".3f") for c in cells) + f" | {all(checks) if checks else '-'} |")
    if verdicts:
        lines += ["", "| cell | transformers (mean of seeds) | llama_cpp (mean) | difference | noise: largest seed "
                  "spread | within the noise |", "|---|---|---|---|---|---|"]
        for c, v in verdicts.items():
            lines.append(f"| {c.removeprefix('tau_').replace('_', ' ')} | {v['mean']['transformers']:.3f} | "
                         f"{v['mean']['llama_cpp']:.3f} | {v['difference']:+.3f} | {v['noise']:.3f} | "
                         f"{'yes' if v['within_noise'] else 'no'} |")
        lines += ["", "Noise: for each answer set, the difference between its two seeds' tau; the larger of the two. "
                  "With two seeds this is a rough measure: two runs bound the spread from below."]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="answer,data,train,eval,report")
    ap.add_argument("--num", type=int, default=200, help="prompts (the first N rows of the shared answers)")
    ap.add_argument("--check", type=int, default=16, help="prompts the transformers backend answers again (0 = none)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the answering backends")
    ap.add_argument("--jobs", type=int, default=2, help="runs trained / scored at the same time")
    ap.add_argument("--shapes", default="chain", help="draft shapes to score, of " + ", ".join(pa.SHAPES))
    ap.add_argument("--score", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = [t for t in args.shapes.split(",") if t]
    if not shapes or any(t not in pa.SHAPES for t in shapes):
        raise SystemExit(f"--shapes {args.shapes!r}: choose from {', '.join(pa.SHAPES)}")
    if args.score:
        return pa.score(args.score, shapes, RUNS_DIR, CACHE)
    stages = args.stages.split(",")
    CACHE.mkdir(parents=True, exist_ok=True)
    pa.CACHE.mkdir(parents=True, exist_ok=True)       # the shared target-only baselines
    if "answer" in stages:
        answer(args.num, args.check, args.threads)
    if "data" in stages:
        make_data(args.num)
    steps = steps_for_epochs() if "train" in stages else 0

    def one(run: tuple[str, str, int]) -> str | None:
        name, source, seed = run
        try:
            if "train" in stages:
                train(name, source, seed, steps)
            if "eval" in stages and (RUNS_DIR / name / "train.done").exists():
                pa.evaluate(name, shapes, CACHE, __file__)
        except (Exception, SystemExit) as e:
            log(f"{name} failed: {e}")
            return f"{name}: {e}"
        return None
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        failures = [f for f in pool.map(one, run_names()) if f]
    if "report" in stages:
        report(args.num)
    if failures:
        raise SystemExit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
