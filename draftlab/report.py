"""The evaluation report: the JSON dict (DESIGN.md keys), a markdown table, a one-line summary, plots.

Counting rules (ARCHITECTURE.md): rounds == target forwards (prefill excluded); new_tokens = sum over rounds
of (accepted + 1) before truncation; acceptance_length (tau) = new_tokens / target_forwards, micro-averaged
over all rounds of all prompts; the per-sample list and its mean (macro) are reported too.
Draft cost: mean_draft_length = mean over rounds of the proposed tree's depth (a chain's length);
wasted_draft_tokens = drafted nodes that were not accepted (rejected, or never judged after a rejection).
Calibration (proposers that predict acceptance): predicted P(accept) of each judged draft node vs its verdict.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from draftlab.trees import TreeSpec
from draftlab.verify import Sampling


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _tau(results) -> float | None:
    return _ratio(sum(r.new_tokens for r in results), sum(r.rounds for r in results))


def calibration(predicted: list[float], outcome: list[int], bins: int = 10) -> dict | None:
    """Reliability of predicted acceptance probabilities against 0/1 verdicts (None when there are none).

    Equal-width bins over [0, 1]; ece = sum_b (n_b / N) |mean predicted_b - accepted share_b| (in [0, 1]).
    Returns {ece, brier, num_tokens, mean_predicted, accepted_rate, bins: [{lo, hi, count, mean_predicted,
    accepted_rate}]} (empty bins have count 0 and null means).
    """
    n = len(predicted)
    if n == 0:
        return None
    rows = [{"lo": b / bins, "hi": (b + 1) / bins, "count": 0, "sum_p": 0.0, "sum_y": 0} for b in range(bins)]
    for p, y in zip(predicted, outcome):
        row = rows[min(bins - 1, max(0, int(p * bins)))]
        row["count"] += 1
        row["sum_p"] += p
        row["sum_y"] += y
    ece = sum(abs(r["sum_p"] - r["sum_y"]) for r in rows) / n       # sum_b n_b/N |mean_p - mean_y|
    return {
        "ece": ece,
        "brier": sum((p - y) ** 2 for p, y in zip(predicted, outcome)) / n,
        "num_tokens": n,
        "mean_predicted": sum(predicted) / n,
        "accepted_rate": sum(outcome) / n,
        "bins": [{"lo": r["lo"], "hi": r["hi"], "count": r["count"],
                  "mean_predicted": _ratio(r["sum_p"], r["count"]), "accepted_rate": _ratio(r["sum_y"], r["count"])}
                 for r in rows],
    }


def build_report(results: list, baseline: dict, *, spec: TreeSpec, sampling: Sampling,
                 categories: list[str] | None = None, wall_seconds: float | None = None,
                 timing: dict | None = None) -> dict:
    """results: evaluator.GenerationResult per prompt; baseline: {"outputs", "tokens_per_second"} (e.g.
    evaluator.run_baseline's dict); timing: evaluator.interleaved_side_by_side's timing (median speeds, speedup spread),
    which replaces the speeds computed from `results` and `baseline`."""
    rounds = sum(r.rounds for r in results)
    accepted = [a for r in results for a in r.accepted]
    depths = [d for r in results for d in r.draft_depth]
    max_depth = max([spec.max_depth, *depths])
    # share of rounds whose draft token at depth i+1 was accepted, and the same among the rounds where that
    # depth was reached with all earlier drafts accepted (EAGLE's n-alpha)
    per_position = [_ratio(sum(a > i for a in accepted), rounds) or 0.0 for i in range(max_depth)]
    conditional = [_ratio(sum(a > i for a in accepted), sum(a >= i and d > i for a, d in zip(accepted, depths)))
                   for i in range(max_depth)]
    per_sample = [_ratio(r.new_tokens, r.rounds) for r in results]
    defined = [t for t in per_sample if t is not None]

    emitted = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    tps = _ratio(emitted, seconds)
    base_tps = baseline.get("tokens_per_second")
    mismatched = [i for i, (r, b) in enumerate(zip(results, baseline["outputs"])) if b is None or r.tokens != list(b)]

    report = {
        "acceptance_length": _tau(results),
        # as engines print it: the prefill forward and its token counted too (one of each per prompt)
        "acceptance_length_incl_prefill": _ratio(sum(r.new_tokens for r in results) + len(results),
                                                 rounds + len(results)),
        "acceptance_length_per_sample": per_sample,
        "acceptance_length_macro": sum(defined) / len(defined) if defined else None,
        "per_position_acceptance": per_position,
        "per_position_conditional_acceptance": conditional,
        "rounds": rounds,
        "new_tokens": sum(r.new_tokens for r in results),
        "target_forwards": rounds,
        "generated_tokens": emitted,
        "mean_draft_nodes": _ratio(sum(n for r in results for n in r.draft_nodes), rounds),
        "mean_draft_length": _ratio(sum(depths), rounds),
        "wasted_draft_tokens": sum(n for r in results for n in r.draft_nodes) - sum(accepted),
        "draft_length": spec.max_depth,
        "temperature": float(sampling.temperature),
        "sampling": sampling.to_dict(),
        "lossless": (not mismatched) if sampling.greedy else None,
        "lossless_mismatched_prompts": mismatched if sampling.greedy else None,
        "tokens_per_second": tps,
        "baseline_tokens_per_second": base_tps,
        "speedup": _ratio(tps, base_tps) if tps is not None and base_tps else None,
        "num_prompts": len(results),
        "tree": spec.to_dict(),
        "wall_seconds": wall_seconds,
    }
    if timing:
        report.update(timing)
    if categories is not None and any(c is not None for c in categories):
        groups: dict[str, list] = {}
        for r, c in zip(results, categories):
            groups.setdefault("uncategorized" if c is None else str(c), []).append(r)
        report["per_category"] = {c: {"acceptance_length": _tau(rs), "num_prompts": len(rs)}
                                  for c, rs in sorted(groups.items())}
    calib = calibration([p for r in results for p in getattr(r, "predicted", [])],
                        [y for r in results for y in getattr(r, "outcome", [])])
    if calib is not None:
        report["calibration"] = calib
    return report


def _clean(x):
    """NaN/inf are not JSON: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_report(report: dict, path: str | Path) -> None:
    """Written under a temporary name and renamed into place: a reader sees the old report or the new one."""
    from draftlab.runlock import write_atomic

    write_atomic(path, json.dumps(_clean(report), indent=2) + "\n", f"report {path}")


def fmt(x, digits: int = 3) -> str:
    """A table cell: "-" for None, yes/NO for a flag, a float to `digits` places."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def tree_label(report: dict) -> str:
    tree = report.get("tree") or {"kind": "chain", "draft_length": report.get("draft_length")}
    if tree.get("kind") == "dynamic":
        return f"dynamic tree (depth {tree.get('depth')}, top-k {tree.get('top_k')}, {tree.get('total_tokens')} nodes)"
    if tree.get("kind") == "static":
        return f"static tree ({len(tree.get('choices') or [])} nodes)"
    return f"chain k={tree.get('draft_length')}"


def summary_line(report: dict) -> str:
    """One line for logs: tau, speedup, losslessness."""
    parts = [f"tau {fmt(report['acceptance_length'], 2)} ({tree_label(report)}, T={report['temperature']:g})",
             f"{fmt(report['tokens_per_second'], 1)} tok/s vs {fmt(report['baseline_tokens_per_second'], 1)}"
             f" target-only = {fmt(report['speedup'], 2)}x"]
    if report.get("adaptive"):
        parts.insert(1, f"adaptive: mean draft length {fmt(report['mean_draft_length'], 2)}")
    if report.get("lossless") is not None:
        parts.append(f"lossless {fmt(report['lossless'])}")
    parts.append(f"{report['num_prompts']} prompts")
    return " | ".join(parts)


def report_markdown(report: dict) -> str:
    """A markdown table a user can paste (model card, PR)."""
    rows = [
        ("acceptance length tau (micro)", fmt(report["acceptance_length"])),
        ("tau, mean per prompt (macro)", fmt(report.get("acceptance_length_macro"))),
        ("tau incl. the prefill's forward and token", fmt(report.get("acceptance_length_incl_prefill"))),
        ("draft", tree_label(report)),
        ("temperature", fmt(report["temperature"], 2)),
        ("per-position acceptance", ", ".join(fmt(x, 2) for x in report["per_position_acceptance"])),
        ("mean draft length", fmt(report.get("mean_draft_length"), 2)),
        ("wasted draft tokens", fmt(report.get("wasted_draft_tokens"))),
        ("rounds (target forwards)", fmt(report["rounds"])),
        ("new tokens", fmt(report["new_tokens"])),
        ("tokens/s speculative", fmt(report["tokens_per_second"], 1)),
        ("tokens/s target-only", fmt(report["baseline_tokens_per_second"], 1)),
        ("speedup", fmt(report["speedup"], 2) + "x" if report["speedup"] is not None else "-"),
        ("lossless (greedy identity)", fmt(report["lossless"]) if report["lossless"] is not None else "n/a"),
        ("prompts", fmt(report["num_prompts"])),
    ]
    if report.get("adaptive"):
        rule = report["adaptive"].get("description") or (f"1 - prod(p_hat) > {report['adaptive']['threshold']:g}, "
                                                         f"min {report['adaptive']['min_draft']}")
        rows.insert(3, ("adaptive stopping", rule))
    if report.get("calibration"):
        rows.append(("calibration ECE", f"{report['calibration']['ece']:.3f} "
                                        f"({report['calibration']['num_tokens']} judged draft tokens)"))
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    if report.get("fixed_k"):
        lines += ["", "| drafting | mean draft length | wasted draft tokens | tau | speedup |", "|---|---|---|---|---|"]
        runs = [(f"adaptive (<= {report['draft_length']})", report)]
        runs += [(f"fixed k={k}", r) for k, r in report["fixed_k"].items()]
        lines += [f"| {name} | {fmt(r.get('mean_draft_length'), 2)} | {fmt(r.get('wasted_draft_tokens'))} | "
                  f"{fmt(r['acceptance_length'])} | {fmt(r['speedup'], 2)} |" for name, r in runs]
    if report.get("per_category"):
        lines += ["", "| category | tau | prompts |", "|---|---|---|"]
        lines += [f"| {c} | {fmt(v['acceptance_length'])} | {v['num_prompts']} |"
                  for c, v in report["per_category"].items()]
    return "\n".join(lines) + "\n"


def save_plots(report: dict, out_dir: str | Path, prefix: str = "eval") -> list[str]:
    """PNG plots: per-position acceptance bars, and tau per category when present. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    acc = report["per_position_acceptance"]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(range(1, len(acc) + 1), acc, color="tab:blue")
    ax.set(xlabel="draft depth", ylabel="share of rounds accepted", ylim=(0, 1),
           title=f"tau = {fmt(report['acceptance_length'], 2)}")
    fig.tight_layout()
    paths.append(str(out_dir / f"{prefix}_per_position.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    cats = report.get("per_category")
    if cats:
        fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(cats)), 3))
        ax.bar(list(cats), [v["acceptance_length"] or 0 for v in cats.values()], color="tab:green")
        ax.set(ylabel="tau", title="acceptance length per category")
        ax.tick_params(axis="x", labelrotation=45)
        fig.tight_layout()
        paths.append(str(out_dir / f"{prefix}_per_category.png"))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    if report.get("calibration"):
        paths.append(str(plot_calibration(report["calibration"], out_dir / f"{prefix}_calibration.png")))
    return paths


def plot_calibration(calib: dict, path: str | Path) -> Path:
    """Reliability diagram: accepted share against mean predicted P(accept) per bin, the diagonal, the counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    filled = [b for b in calib["bins"] if b["count"]]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(4.5, 5), height_ratios=[3, 1], sharex=True)
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":", label="perfect calibration")
    ax.plot([b["mean_predicted"] for b in filled], [b["accepted_rate"] for b in filled], marker="o",
            label="acceptance head")
    ax.set(ylabel="accepted share", xlim=(0, 1), ylim=(0, 1),
           title=f"calibration: ECE {calib['ece']:.3f} ({calib['num_tokens']} tokens)")
    ax.legend(fontsize=8, loc="upper left")
    bx.bar([(b["lo"] + b["hi"]) / 2 for b in calib["bins"]], [b["count"] for b in calib["bins"]],
           width=0.9 / len(calib["bins"]), color="tab:grey")
    bx.set(xlabel="predicted P(accept)", ylabel="tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
