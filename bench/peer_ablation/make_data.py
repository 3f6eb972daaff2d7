"""The side by side's training rows, rebuilt without speculators: the conversations of smollm2_answers.jsonl whose
indices bench/results/peer_speculators_first.json recorded as speculators' training split (data.train_source_indices).

    python bench/peer_ablation/make_data.py --out DIR [--data ../shared/bench/smollm2_answers.jsonl]
writes DIR/train.jsonl (messages rows, file order) and DIR/split.json (the indices and the source)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from draftlab.data import read_conversations

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=str(ROOT.parent / "shared/bench/smollm2_answers.jsonl"))
    ap.add_argument("--split-from", default=str(ROOT / "bench/results/peer_speculators_first.json"))
    args = ap.parse_args()
    recorded = json.loads(Path(args.split_from).read_text())["data"]
    indices = recorded["train_source_indices"]
    conversations, stats = read_conversations(args.data, limit=max(indices) + 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for i in indices:
            f.write(json.dumps({"messages": conversations[i]}) + "\n")
    (out / "split.json").write_text(json.dumps({"source": args.data, "split_from": args.split_from,
                                                "train_rows": len(indices), "train_source_indices": indices}) + "\n")
    print(f"{len(indices)} training conversations ({stats}) -> {out}/train.jsonl")


if __name__ == "__main__":
    main()
