"""The CPU benchmark's report: goals (met / missed), the markdown table, and the tau / speedup plots.

Rows are `bench/cpu_smollm2.py`'s: one per drafter x tree x prompt set, the evaluator's report keys plus
`drafter`, `tree`, `prompt_set`, `train_seconds`, `train_tokens_per_second`, `peak_rss_mb`.
"""
from __future__ import annotations

from pathlib import Path

from draftlab.report import fmt

GOAL_SET = "mtbench"           # the goals are stated on MT-bench
EAGLE_TAU_CHAIN, EAGLE_TAU_TREE, EAGLE_SPEEDUP, INLOOP_SHARE = 3.0, 3.6, 2.0, 0.05


def _find(rows: list[dict], drafter: str, tree: str, prompt_set: str) -> dict | None:
    return next((r for r in rows if (r["drafter"], r["tree"], r["prompt_set"]) == (drafter, tree, prompt_set)), None)


def _goal(text: str, value, threshold: float, at_least: bool = True) -> dict:
    met = None if value is None else (value >= threshold if at_least else value <= threshold)
    return {"goal": text, "value": value, "threshold": threshold, "met": met}


def goals(rows: list[dict], header: dict) -> list[dict]:
    """The issue's goals as {"goal", "value", "threshold", "met"} (met None when not measured)."""
    out = []
    chain = _find(rows, "eagle", "chain", GOAL_SET)
    tree = _find(rows, "eagle", "dynamic", GOAL_SET)
    out.append(_goal("EAGLE head tau, chain k=5, MT-bench", chain and chain["acceptance_length"], EAGLE_TAU_CHAIN))
    out.append(_goal("EAGLE head tau, dynamic tree, MT-bench", tree and tree["acceptance_length"], EAGLE_TAU_TREE))
    speedups = [r["speedup"] for r in (chain, tree) if r and r.get("speedup") is not None]
    out.append(_goal("EAGLE head wall-clock speedup over target-only, MT-bench (best tree)",
                     max(speedups) if speedups else None, EAGLE_SPEEDUP))
    for prompt_set in sorted({r["prompt_set"] for r in rows}):
        lookup = _find(rows, "prompt_lookup", "chain", prompt_set)
        for drafter in sorted({r["drafter"] for r in rows} - {"prompt_lookup"}):
            mine = _find(rows, drafter, "chain", prompt_set)
            value = (mine["acceptance_length"] - lookup["acceptance_length"]) if mine and lookup else None
            out.append(_goal(f"{drafter} tau minus prompt lookup's (chain, {prompt_set}): beats it", value, 0.0))
            out[-1]["met"] = None if value is None else value > 0
    share = (header.get("in_loop_eval") or {}).get("share")
    out.append(_goal("in-loop evaluation share of training time", share, INLOOP_SHARE, at_least=False))
    return out


def _fmt(x, digits: int = 2) -> str:
    return fmt(x, digits)


def _tree(r: dict) -> str:
    t = r.get("tree_spec") or {}
    if r["tree"] == "chain":
        return f"chain k={r['draft_length']}"
    if r["tree"] == "dynamic":
        return f"dynamic (depth {t.get('depth')}, top-k {t.get('top_k')}, {t.get('total_tokens')} nodes)"
    return r["tree"]


def results_table(rows: list[dict]) -> list[str]:
    lines = ["| drafter | draft | prompts | tau | per-position acceptance | tok/s | target-only tok/s | speedup | "
             "speedup min-max (repeats) | lossless | train s | train tok/s | peak RSS MB | load avg | measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        spread = (f"{_fmt(r.get('speedup_min'))}-{_fmt(r.get('speedup_max'))} ({r.get('timing_repeats')})"
                  if r.get("timing_repeats") else "baseline timed once, earlier")
        load = (r.get("load_average") or [None])[0]
        lines.append(f"| {r['drafter']} | {_tree(r)} | {r['prompt_set']} ({r['num_prompts']}) | "
                     f"{_fmt(r['acceptance_length'])} | {acc} | {_fmt(r['tokens_per_second'], 1)} | "
                     f"{_fmt(r['baseline_tokens_per_second'], 1)} | {_fmt(r['speedup'])}x | {spread} | "
                     f"{_fmt(r['lossless'])} | {_fmt(r['train_seconds'], 0)} | {_fmt(r['train_tokens_per_second'], 0)} | "
                     f"{_fmt(r['peak_rss_mb'], 0)} | {_fmt(load, 2)} | "
                     f"{'cached from an earlier run' if r.get('from_cache') else 'this run'} |")
    return lines


def write_markdown(result: dict, path: str | Path) -> str:
    """The report as markdown (header facts, results, goals); returns the text."""
    h, rows = result["header"], result["rows"]
    b, m, d, e = h["budget"], h["machine"], h["data"], h["eval"]
    inloop = h.get("in_loop_eval") or {}
    lines = ["# CPU benchmark: drafters for SmolLM2-135M-Instruct", "",
             f"- command: `{h['command']}` (started {h['started']}, draftlab {h['versions'].get('draftlab_commit')})",
             f"- machine: {m['nproc']} CPUs, torch threads {m['torch_threads']}, load average at start "
             f"{', '.join(f'{x:.2f}' for x in m['load_average_at_start'])}; {m['platform']}",
             f"- versions: " + ", ".join(f"{k} {v}" for k, v in h["versions"].items() if k != "draftlab_commit"),
             f"- target: `{h['target']}`",
             f"- data: {d['conversations']} conversations answered by the target ({d['tokens']} tokens, "
             f"`{Path(d['file']).name}`)",
             f"- budget, the same for every drafter: {b['steps']} steps x {b['batch_size']} conversations "
             f"({b['epochs']:.2f} epochs, about {b['train_tokens']:.0f} tokens), max length {b['max_length']}, "
             f"lr {b['lr']} ({b['schedule']}, {b['warmup_steps']} warm-up steps)"
             + (f", extra overrides {b['extra_overrides']}" if b.get("extra_overrides") else ""),
             f"- evaluation: greedy, {e['max_new_tokens']} new tokens, prompts "
             + ", ".join(f"{k} {v}" for k, v in e["num_prompts"].items())
             + "; target-only and speculative decoding timed interleaved prompt by prompt (speedup: the median of "
               "the repeats, with its min and max); rows marked 'cached' were measured by an earlier run",
             f"- in-loop evaluation ({inloop.get('kind')} run: {inloop.get('evaluations')} evaluations of "
             f"{inloop.get('prompts')} prompts x {inloop.get('max_new_tokens')} tokens): "
             f"{_fmt(inloop.get('eval_seconds'), 1)} s of {_fmt(inloop.get('train_wall_seconds'), 1)} s training = "
             f"{_fmt(100 * inloop['share'] if inloop.get('share') is not None else None, 1)}%",
             f"- stage wall times (s): " + ", ".join(f"{k} {v}" for k, v in h["stage_seconds"].items()),
             f"- load average before each timed stage: "
             + ", ".join(f"{k} {v}" for k, v in h["load_average_before"].items()), ""]
    if h.get("failures"):
        lines += ["Failed kinds: " + "; ".join(f"{k}: {v}" for k, v in h["failures"].items()), ""]
    lines += ["## Results", ""] + results_table(rows)
    lines += ["", "train s: the training process's wall time without in-loop evaluation; train tok/s: real tokens "
              "over the time inside training steps (the loop's metrics.jsonl), or, where the loop does not log them, "
              "conversations seen x mean tokens per conversation over train s (`train_tokens_source` in the JSON); "
              "peak RSS: the training process's (prompt lookup: the evaluation process's).",
              "", "## Goals", "", "| goal | value | threshold | status |", "|---|---|---|---|"]
    for g in h["goals"]:
        status = "not measured" if g["met"] is None else ("met" if g["met"] else "MISSED")
        lines.append(f"| {g['goal']} | {_fmt(g['value'], 3)} | {g['threshold']} | {status} |")
    text = "\n".join(lines) + "\n"
    Path(path).write_text(text)
    return text


def plot_rows(rows: list[dict], out_dir: str | Path, stem: str) -> list[str]:
    """Two PNGs: tau and speedup per drafter, one bar per (tree, prompt set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    series = list(dict.fromkeys((r["tree"], r["prompt_set"]) for r in rows))
    width = 0.8 / max(len(series), 1)
    paths = []
    for key, ylabel, ref in (("acceptance_length", "tau (tokens per target forward)", 1.0),
                             ("speedup", "speedup over target-only", 1.0)):
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(drafters)), 3.8), dpi=100)
        for j, (tree, prompt_set) in enumerate(series):
            values = [next((r[key] or 0 for r in rows if (r["drafter"], r["tree"], r["prompt_set"])
                            == (d, tree, prompt_set)), 0) for d in drafters]
            ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(drafters))], values, width,
                   label=f"{tree}, {prompt_set}")
        ax.axhline(ref, color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(drafters)), drafters)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel.split(' (')[0]} per drafter")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        paths.append(str(Path(out_dir) / f"{stem}_{'tau' if key == 'acceptance_length' else 'speedup'}.png"))
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths
