"""Dump a feature store: the target runs once over the training conversations; hidden states (and top-k
log-probs) go to sharded safetensors with a manifest (see draftlab/store.py), for offline training.

    python data_prep/dump_features.py --target meta-llama/Llama-3.1-8B-Instruct --data conversations.jsonl \
        --out conversations.jsonl.store --layers -1 --max-length 2048
    python data_prep/dump_features.py ... --layers eagle3          # EAGLE-3: default aux layers + the last state
    python data_prep/dump_features.py ... --layers none --topk 20  # teacher top-20 log-probs only

--max-length and --limit must equal the training run's data.max_length and data.limit (the store records a
hash of the tokenised rows and training refuses a store made from other rows). Prints the disk estimate
before starting; rerunning the same command resumes an interrupted dump (finished shards are kept).
Training then reads it with data.store=OUT.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("draftlab") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from draftlab.data import ChatDataset, DataError, read_conversations
from draftlab.store import build_store
from draftlab.runlock import LockError
from draftlab.target import TargetError, load_target

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_layers(text: str, num_layers: int) -> tuple[int, ...]:
    """'-1' | '2,15,27,-1' | 'eagle3' (default EAGLE-3 aux layers + the last state) | 'none'."""
    if text == "none":
        return ()
    if text == "eagle3":
        from draftlab.drafters.eagle3 import default_aux_layers

        return tuple(default_aux_layers(num_layers)) + (-1,)
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise DataError(f"--layers {text!r}: give comma-separated hidden-state indices (e.g. -1 or 2,15,27,-1), "
                        "'eagle3' or 'none'") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF folder, Hub id, .gguf file or package:PKG/FILE")
    parser.add_argument("--data", required=True, help="training conversations (JSONL/JSON file or datasets Hub id)")
    parser.add_argument("--out", required=True, help="store folder (created; resumed when it holds a partial dump)")
    parser.add_argument("--layers", default="-1", help="hidden-state indices: -1 | 2,15,27,-1 | eagle3 | none")
    parser.add_argument("--topk", type=int, default=0, help="also store the target's top-k log-probs (0 = off)")
    parser.add_argument("--max-length", type=int, default=2048, help="= the training run's data.max_length")
    parser.add_argument("--limit", type=int, default=0, help="= the training run's data.limit (0 = all)")
    parser.add_argument("--strict", action="store_true", help="fail on the first malformed row")
    parser.add_argument("--store-dtype", default="bfloat16", choices=list(DTYPES), help="dtype of stored features")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shard-tokens", type=int, default=65536, help="tokens per shard (rows are never split)")
    parser.add_argument("--dtype", default="auto", help="target dtype: auto (bf16 on GPU, fp32 on CPU), ...")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.shard_tokens < 1 or args.max_length < 1 or args.topk < 0 or args.limit < 0:
        parser.error("--batch-size, --shard-tokens and --max-length must be positive; --topk, --limit >= 0")
    try:
        conversations, stats = read_conversations(args.data, strict=args.strict, limit=args.limit or None)
        model, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
        layers = parse_layers(args.layers, model.config.get_text_config().num_hidden_layers)
        if not layers and args.topk == 0:
            raise DataError("nothing to store: give --layers and/or --topk")
        dataset = ChatDataset(conversations, tokenizer, args.max_length)
        print(f"data: {len(dataset)} conversations ({stats.summary()}{dataset.summary()})", flush=True)
        store = build_store(args.out, model, tokenizer, dataset, layers, args.topk, dtype=DTYPES[args.store_dtype],
                            batch_size=args.batch_size, shard_tokens=args.shard_tokens,
                            progress=not args.no_progress)
    except (DataError, TargetError, LockError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = store.manifest
    print(f"{args.out}: {m['rows']} rows, {m['tokens']} tokens, {len(m['shards'])} shards, "
          f"{m['bytes_per_token']} bytes/token, layers {m['layers']}, top-k {m['topk_logits']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
