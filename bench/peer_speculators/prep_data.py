"""Data for the speculators / draftlab side by side: one tokenisation, one train split, one draft vocabulary.

    python prep_data.py tokenize --data answers.jsonl --n 400 --target SPEC --max-length 512 --out DIR
        (draftlab's Python) the first N conversations, tokenised by draftlab's ChatDataset (the target's chat
        template, loss on assistant tokens) -> DIR/pretok.jsonl (input_ids + loss_mask: the "speculator format"
        that `speculators prepare-data` passes through unchanged) and DIR/sources.jsonl (the same rows' messages)
    python prep_data.py split --dir DIR --ratio 0.98
        (speculators' venv: datasets + torch) after `speculators prepare-data` wrote DIR/prepared (rows shuffled
        with seed 0): speculators' trainer trains on prepared rows [0, int(len * ratio)) and validates on the rest
        (speculators/train/data.py ArrowDataset). This writes exactly those training conversations, in their
        original file order, to DIR/train.jsonl for draftlab, the validation ones to DIR/val.jsonl, the assistant
        token counts of the training rows to DIR/token_freq_train.pt (speculators' --token-freq-path: both draft
        vocabularies are then the VOCAB most frequent assistant tokens of the same rows, ties by id), and
        DIR/split.json (counts).
    python prep_data.py steps --dir DIR --target SPEC --max-length 512 --epochs 3 --batch 4 --pack 512
        (draftlab's Python) draftlab's optimizer steps for EPOCHS epochs of DIR/train.jsonl: rows // batch per
        epoch when --pack is 0, else the packed rows of each epoch's permutation // batch (draftlab's own
        runtime.Batches, so the count is the one its training walks through)
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def cmd_tokenize(args) -> None:
    from draftlab.data import ChatDataset, read_conversations
    from draftlab.target import convert_gguf, load_target, resolve_target_path

    _, tokenizer = load_target(args.target, "float32", "cpu")
    conversations, stats = read_conversations(args.data, limit=args.n)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = 0
    with open(out / "pretok.jsonl", "w") as f, open(out / "sources.jsonl", "w") as g:
        for i, messages in enumerate(conversations):
            ds = ChatDataset([messages], tokenizer, args.max_length)   # one at a time: keeps the row <-> source link
            if len(ds) != 1:
                print(f"conversation {i} dropped by draftlab's tokenisation ({ds.summary()})")
                continue
            f.write(json.dumps({"input_ids": ds[0]["input_ids"], "loss_mask": ds[0]["loss_mask"]}) + "\n")
            g.write(json.dumps({"source_index": i, "messages": messages}) + "\n")
            rows += 1
    folder = resolve_target_path(args.target)
    folder = convert_gguf(folder) if folder.endswith(".gguf") else folder
    (out / "target_dir.txt").write_text(folder + "\n")
    print(f"{rows} rows ({stats}) -> {out}/pretok.jsonl; target folder {folder}")


def cmd_split(args) -> None:
    import torch
    from datasets import load_from_disk

    d = Path(args.dir)
    pretok = [json.loads(x) for x in open(d / "pretok.jsonl")]
    sources = [json.loads(x) for x in open(d / "sources.jsonl")]
    by_ids: dict[tuple, list[int]] = {}
    for i, row in enumerate(pretok):
        by_ids.setdefault(tuple(row["input_ids"]), []).append(i)
    prepared = load_from_disk(str(d / "prepared")).with_format(None)
    split_idx = int(len(prepared) * args.ratio)          # the expression speculators' ArrowDataset uses
    train, val, freq = [], [], Counter()
    for j in range(len(prepared)):
        ids, mask = list(prepared[j]["input_ids"]), list(prepared[j]["loss_mask"])
        i = by_ids[tuple(ids)].pop(0)
        if mask != pretok[i]["loss_mask"]:
            raise SystemExit(f"prepared row {j}: loss_mask differs from pretok row {i}")
        if j < split_idx:
            train.append(i)
            freq.update(t for t, m in zip(ids, mask) if m)
        else:
            val.append(i)
    for name, rows in (("train", train), ("val", val)):
        with open(d / f"{name}.jsonl", "w") as f:
            for i in sorted(rows):
                f.write(json.dumps({"messages": sources[i]["messages"]}) + "\n")
    torch.save(dict(freq), d / "token_freq_train.pt")
    info = {"prepared_rows": len(prepared), "ratio": args.ratio, "train_rows": len(train), "val_rows": len(val),
            "train_tokens": sum(len(pretok[i]["input_ids"]) for i in train),
            "train_assistant_tokens": sum(sum(pretok[i]["loss_mask"]) for i in train),
            "train_distinct_assistant_tokens": len(freq),
            "train_source_indices": sorted(sources[i]["source_index"] for i in train),
            "val_source_indices": sorted(sources[i]["source_index"] for i in val)}
    (d / "split.json").write_text(json.dumps(info) + "\n")
    print({k: v for k, v in info.items() if not k.endswith("indices")})


def cmd_steps(args) -> None:
    from draftlab.data import ChatDataset, read_conversations
    from draftlab.runtime import Batches
    from draftlab.target import load_target

    _, tokenizer = load_target(args.target, "float32", "cpu")
    ds = ChatDataset(read_conversations(str(Path(args.dir) / "train.jsonl"))[0], tokenizer, args.max_length)
    batches = Batches(ds, args.batch, 1, 0, args.seed, tokenizer.pad_token_id or 0, pack_tokens=args.pack)
    print(sum(len(batches.epoch_batches(e)) for e in range(args.epochs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenize")
    t.add_argument("--data", required=True)
    t.add_argument("--n", type=int, required=True)
    t.add_argument("--target", required=True)
    t.add_argument("--max-length", type=int, default=512)
    t.add_argument("--out", required=True)
    s = sub.add_parser("split")
    s.add_argument("--dir", required=True)
    s.add_argument("--ratio", type=float, required=True)
    st = sub.add_parser("steps", help="draftlab's optimizer steps for some epochs (packed or padded)")
    st.add_argument("--dir", required=True)
    st.add_argument("--target", required=True)
    st.add_argument("--max-length", type=int, default=512)
    st.add_argument("--epochs", type=int, required=True)
    st.add_argument("--batch", type=int, required=True)
    st.add_argument("--pack", type=int, default=0)
    st.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    {"tokenize": cmd_tokenize, "split": cmd_split, "steps": cmd_steps}[args.cmd](args)


if __name__ == "__main__":
    main()
