"""Collect the speculators / draftlab side by side (bench/peer_speculators.sh) into OUT.json and OUT.md.

Training figures: wall time and peak RSS from /usr/bin/time -v; training tokens = the training conversations'
tokens x epochs (padding excluded; the same count on both sides); training tokens/s = those tokens over the
summed time of the training steps (draftlab: metrics.jsonl train_seconds; speculators: its profiler's
profile/step_ms per step, read from the console log), and over the whole process's CPU seconds (user + sys,
startup and checkpoints included), which is the fairer figure on a machine other jobs share. Evaluation
figures: the `draftlab eval` reports. Load: the 1-minute load average sampled every 30 s during each stage.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
from pathlib import Path


def time_v(log: Path) -> dict:
    """wall seconds, peak RSS (GB), user + sys CPU seconds from a /usr/bin/time -v block at the end of a log."""
    text = log.read_text(errors="replace")
    out = {}
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([0-9:.]+)", text)
    if m:
        parts = [float(x) for x in m.group(1).split(":")]
        out["wall_seconds"] = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if m:
        out["peak_rss_gb"] = int(m.group(1)) / 1024 ** 2
    u = re.search(r"User time \(seconds\): ([0-9.]+)", text)
    s = re.search(r"System time \(seconds\): ([0-9.]+)", text)
    if u and s:
        out["cpu_seconds"] = float(u.group(1)) + float(s.group(1))
    return out


def load_stats(path: Path) -> dict | None:
    if not path.is_file():
        return None
    vals = [float(line.split()[1]) for line in path.read_text().splitlines() if len(line.split()) >= 2]
    if not vals:
        return None
    return {"mean": statistics.mean(vals), "min": min(vals), "max": max(vals), "samples": len(vals)}


def speculators_records(log: Path) -> list[dict]:
    """key=value records of speculators' rich console log (one record per INFO line, wrapped lines joined)."""
    recs, cur = [], None
    for line in log.read_text(errors="replace").splitlines():
        if re.search(r"INFO\s", line):
            if cur:
                recs.append(cur)
            cur = {} if re.search(r"INFO\s+(train|val)/", line) else None
        if cur is not None:
            for k, v in re.findall(r"([a-z_]+/[a-zA-Z0-9_/]+|global_step|epoch|lr)=([-0-9.e+]+)", line):
                try:
                    cur[k] = float(v)
                except ValueError:
                    pass
    if cur:
        recs.append(cur)
    return recs


def git_head(root: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except OSError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--spec-out", required=True)
    ap.add_argument("--dl-out", required=True)
    ap.add_argument("--eval-dir", required=True)
    ap.add_argument("--spec-venv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--settings", default="")
    args = ap.parse_args()
    data, spec, dl, ev = Path(args.data_dir), Path(args.spec_out), Path(args.dl_out), Path(args.eval_dir)
    settings = dict(kv.split("=", 1) for kv in args.settings.split())
    epochs = int(settings.get("EPOCHS", 3))
    split = json.loads((data / "split.json").read_text())
    tokens = split["train_tokens"] * epochs
    train_load = load_stats(data / "load_train.txt")

    # --- draftlab -----------------------------------------------------------------------------------------
    rows = [json.loads(x) for x in (dl / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    dl_seconds = sum(r["train_seconds"] for r in rows)
    dl_logged = sum(r["train_tokens"] for r in rows)
    dl_time = time_v(Path(str(dl) + ".train.log"))
    best = (dl / "best").read_text().strip() if (dl / "best").is_file() else sorted(dl.glob("step_*"))[-1].name
    dl_cfg = json.loads((dl / best / "drafter_config.json").read_text())
    last_epoch = rows[-max(1, len(rows) // epochs):]
    dl_row = {"trainer": "draftlab", "checkpoint": str(dl / best), "steps": rows[-1]["step"],
              "train_tokens": tokens, "train_tokens_logged": dl_logged, "train_seconds": dl_seconds,
              "train_tokens_per_second": dl_logged / dl_seconds,
              "padding_share": 1 - dl_logged / sum(r["train_tokens"] / (1 - r["padding_share"]) for r in rows),
              **{k: dl_time.get(k) for k in ("wall_seconds", "peak_rss_gb", "cpu_seconds")},
              "train_tokens_per_cpu_second": tokens / dl_time["cpu_seconds"] if dl_time.get("cpu_seconds") else None,
              "train_acc_last_epoch": {f"acc_{j}": statistics.mean(r[f"acc_{j}"] for r in last_epoch)
                                       for j in range(3) if f"acc_{j}" in last_epoch[-1]}}

    # --- speculators ----------------------------------------------------------------------------------------
    recs = speculators_records(spec / "train.log")
    steps = [r for r in recs if "profile/step_ms" in r]
    vals = [r for r in recs if any(k.startswith("val/") for k in r)]
    sp_seconds = sum(r["profile/step_ms"] for r in steps) / 1000
    sp_profiled = sum(r["profile/tokens_per_s"] * r["profile/step_ms"] / 1000 for r in steps)
    sp_time = time_v(spec / "train.log")
    last = steps[-max(1, len(steps) // epochs):]
    sp_row = {"trainer": "speculators 0.9.0", "checkpoint": str((spec / "checkpoint_best").resolve()),
              "steps": len(steps), "train_tokens": tokens, "train_tokens_profiled": sp_profiled,
              "train_seconds": sp_seconds, "train_tokens_per_second": tokens / sp_seconds,
              "train_tokens_per_second_their_profiler": sp_profiled / sp_seconds, "padding_share": 0.0,
              **{k: sp_time.get(k) for k in ("wall_seconds", "peak_rss_gb", "cpu_seconds")},
              "train_tokens_per_cpu_second": tokens / sp_time["cpu_seconds"] if sp_time.get("cpu_seconds") else None,
              "train_acc_last_epoch": {f"full_acc_{j}": statistics.mean(r.get(f"train/full_acc_{j}", 0.0) for r in last)
                                       for j in range(3)},
              "val": [{k: v for k, v in r.items() if k.startswith("val/") or k == "epoch"} for r in vals]}
    spec_cfg = json.loads((spec / "checkpoint_best" / "config.json").read_text())

    # --- the two draft vocabularies --------------------------------------------------------------------------
    from safetensors.torch import load_file
    import torch

    d2t = load_file(str(spec / "checkpoint_best" / "model.safetensors"))["d2t"]
    spec_vocab = (torch.arange(len(d2t)) + d2t).tolist()
    vocab_check = {"speculators": len(spec_vocab), "draftlab": len(dl_cfg.get("draft_vocab") or []),
                   "identical": spec_vocab == dl_cfg.get("draft_vocab")}

    # --- evaluations ---------------------------------------------------------------------------------------
    evals = []
    for trainer, tag in (("speculators", sp_row), ("draftlab", dl_row)):
        for path in sorted(ev.glob(f"{trainer}_*.json")):
            _, set_name, shape = path.stem.split("_", 2)
            rep = json.loads(path.read_text())
            evals.append({"trainer": tag["trainer"], "prompt_set": set_name, "tree": shape,
                          "tau": rep["acceptance_length"], "per_position_acceptance": rep["per_position_acceptance"],
                          "lossless": rep["lossless"], "speedup": rep["speedup"],
                          "tokens_per_second": rep.get("tokens_per_second"),
                          "baseline_tokens_per_second": rep.get("baseline_tokens_per_second"),
                          "num_prompts": rep["num_prompts"], "wall_seconds": rep.get("wall_seconds"),
                          "load_average": load_stats(ev / f"load_{set_name}_{shape}.txt"),
                          "eval_time": time_v(path.with_suffix(".log")) if path.with_suffix(".log").is_file() else {},
                          "report": str(path)})

    root = Path(__file__).resolve().parents[2]
    result = {"command": "bash bench/peer_speculators.sh " + args.spec_venv, "settings": settings,
              "git_revision": git_head(root), "data": split | {"source": "../shared/bench/smollm2_answers.jsonl"},
              "train_load_average": train_load, "features_load_average": load_stats(data / "load_features.txt"),
              "features": {"speculators_hidden_states": time_v(data / "hidden_states.log"),
                           "draftlab_store": time_v(data / "store.log")},
              "draft_vocab": vocab_check, "speculators_config": {k: spec_cfg.get(k) for k in (
                  "norm_before_fc", "norm_before_residual", "norm_output", "fc_norm", "embed_requires_grad",
                  "draft_vocab_size", "eagle_aux_hidden_state_layer_ids")},
              "training": [sp_row, dl_row], "evaluation": evals}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")

    f = lambda x, p=2: "-" if x is None else f"{x:,.{p}f}"  # noqa: E731
    lines = [f"Data: conversations {', '.join(str(i) for i in (split['train_source_indices'][:1]))}.. of the first "
             f"{settings.get('N')} of smollm2_answers.jsonl: {split['train_rows']} training rows "
             f"({split['train_tokens']:,} tokens, {split['train_assistant_tokens']:,} assistant tokens) x {epochs} "
             f"epochs; draft vocabularies identical: {vocab_check['identical']} ({vocab_check['speculators']} tokens).",
             f"Load average during training (1 min, every 30 s; 2 cores): mean {f(train_load and train_load['mean'])}, "
             f"min {f(train_load and train_load['min'])}, max {f(train_load and train_load['max'])}.", "",
             "| trainer | data | epochs | steps | tokens | train s | train tokens/s | tokens / CPU s | wall s | "
             "peak RSS GB | padding | train top-1 (last epoch, steps 0/1/2) |", "|---" * 12 + "|"]
    for r in (sp_row, dl_row):
        acc = " / ".join(f"{v:.3f}" for v in r["train_acc_last_epoch"].values())
        lines.append(f"| {r['trainer']} | {split['train_rows']} conversations | {epochs} | {r['steps']} | "
                     f"{r['train_tokens']:,} | {f(r['train_seconds'], 0)} | {f(r['train_tokens_per_second'], 1)} | "
                     f"{f(r['train_tokens_per_cpu_second'], 1)} | {f(r['wall_seconds'], 0)} | {f(r['peak_rss_gb'])} | "
                     f"{r['padding_share']:.1%} | {acc} |")
    lines += ["", "| trainer | prompt set | tree | tau | per-position acceptance | lossless | speedup | "
              "tokens/s (spec / target-only) | load average (mean, min-max) |", "|---" * 9 + "|"]
    for e in evals:
        la = e["load_average"]
        lines.append(f"| {e['trainer']} | {e['prompt_set']} ({e['num_prompts']}) | {e['tree']} | {e['tau']:.3f} | "
                     f"{' / '.join(f'{p:.3f}' for p in e['per_position_acceptance'])} | {e['lossless']} | "
                     f"{e['speedup']:.2f}x | {f(e['tokens_per_second'], 1)} / {f(e['baseline_tokens_per_second'], 1)} | "
                     + (f"{la['mean']:.2f} ({la['min']:.2f}-{la['max']:.2f})" if la else "-") + " |")
    out.with_name(out.name + ".tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
