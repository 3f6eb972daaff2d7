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
    """HEAD, with ' + uncommitted edits to FILES' when tracked files differ from it (at report time)."""
    try:
        run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=10).stdout.strip()
        head, dirty = run("rev-parse", "HEAD"), run("diff", "--name-only", "HEAD")
        return (head + (f" + uncommitted edits to {', '.join(dirty.split())}" if dirty else "")) or None
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
    ap.add_argument("--command", default="")
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
    run_info = json.loads((dl / "run_info.json").read_text()) if (dl / "run_info.json").is_file() else {}
    dl_row = {"trainer": "draftlab", "checkpoint": str(dl / best), "steps": rows[-1]["step"],
              "git_revision": run_info.get("git_revision"), "git_dirty": run_info.get("git_dirty"),
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

    order = {"mtbench": 0, "heldout": 1, "chain": 0, "dynamic": 1, "speculators 0.9.0": 0, "draftlab": 1}
    evals.sort(key=lambda e: (order.get(e["prompt_set"], 9), order.get(e["tree"], 9), order.get(e["trainer"], 9)))
    root = Path(__file__).resolve().parents[2]
    result = {"command": args.command or "bash bench/peer_speculators.sh " + args.spec_venv, "settings": settings,
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
    lines = [f"Data: {split['train_rows']} of the first {settings.get('N')} conversations of smollm2_answers.jsonl "
             f"(the other {split['val_rows']} are speculators' validation rows): {split['train_rows']} training rows "
             f"({split['train_tokens']:,} tokens, {split['train_assistant_tokens']:,} assistant tokens) x {epochs} "
             f"epochs; draft vocabularies identical: {vocab_check['identical']} ({vocab_check['speculators']} tokens).",
             f"Load average during training (1 min, every 30 s; 2 cores): mean {f(train_load and train_load['mean'])}, "
             f"min {f(train_load and train_load['min'])}, max {f(train_load and train_load['max'])}.", "",
             "| trainer | data | epochs | steps | tokens | train s | train tokens/s | tokens / CPU s | wall s | "
             "peak RSS GB | padding | train top-1, TTT step 0 (last epoch) |", "|---" * 12 + "|"]
    for r in (sp_row, dl_row):
        acc = f"{list(r['train_acc_last_epoch'].values())[0]:.3f}"   # step 0: the same quantity on both sides
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
    sp_tps, dl_tps = sp_row["train_tokens_per_second"], dl_row["train_tokens_per_second"]
    sp_cpu, dl_cpu = sp_row["train_tokens_per_cpu_second"], dl_row["train_tokens_per_cpu_second"]
    lines += ["", "Train top-1 = the head's argmax equals the target's on assistant positions, TTT step 0, mean of the "
              "last epoch's logged steps (draftlab acc_0, speculators train/full_acc_0). Later steps are not compared: "
              "speculators' full_acc_j counts a position only when steps 0..j are all right, draftlab's acc_j scores "
              "step j alone (both in the JSON)."]
    reading = [f"- Training speed, draftlab / speculators: {dl_tps / sp_tps:.2f}x in tokens per second of training "
               "steps" + (f", {dl_cpu / sp_cpu:.2f}x in tokens per CPU second of the whole process" if sp_cpu and dl_cpu
                          else "") + f"; peak RSS {f(dl_row['peak_rss_gb'])} GB against {f(sp_row['peak_rss_gb'])} GB."]
    for set_name in sorted({e["prompt_set"] for e in evals}, key=lambda x: order.get(x, 9)):
        for shape in ("chain", "dynamic"):
            pair = {e["trainer"]: e for e in evals if e["prompt_set"] == set_name and e["tree"] == shape}
            if len(pair) == 2:
                a, b = pair["draftlab"], pair["speculators 0.9.0"]
                reading.append(f"- {set_name}, {shape}: tau draftlab {a['tau']:.3f}, speculators {b['tau']:.3f} "
                               f"(difference {a['tau'] - b['tau']:+.3f}); speedups {a['speedup']:.2f}x and "
                               f"{b['speedup']:.2f}x, both evaluations at the same time under the load shown.")
    reading.append("- Not measured here: which of the differences listed below makes the gap in tau (candidates: "
                   "speculators' three norm variants, its frozen draft LM head, the loss positions, packed against "
                   "padded batches). Each would need a run that changes only that one.")
    head = [
        "# EAGLE-3 side by side: speculators 0.9.0 and draftlab on the same data, scored by `draftlab eval`", "",
        f"Command: `{result['command']}` (settings {args.settings}); draftlab at {result['git_revision']} "
        "(when the report was written).",
        "Target: SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32), CPU, one thread per job. Both trainings ran "
        "at the same time, and the two evaluations of each prompt set and tree ran at the same time, on a 2-core "
        "machine that other jobs were also using: every time, speed and speedup figure below is a shared-machine "
        "figure (load average beside it) and only the side-by-side ratios mean much. tau and acceptance do not "
        "depend on the load.",
        f"draftlab trained at {dl_row['git_revision']} (git_dirty {dl_row['git_dirty']}, its run_info.json). Each "
        "pair of evaluations (one prompt set, one tree) started at the same moment and so ran the same draftlab code; "
        "other sessions committed to draftlab between pairs (an evaluator refactor that keeps the single-drafter "
        "timing and counting unchanged), and an EAGLE-3 loss change that computes the draft LM head only on counted "
        "slots landed after this training ran; it is meant to make draftlab's step faster than measured here (not "
        "measured in this benchmark).",
        "Evaluation: `draftlab eval`, greedy, 128 new tokens, --repeats 1 (target-only and speculative decoding "
        "timed interleaved prompt by prompt), chain = --draft-length 5, dynamic = EAGLE-2 tree --depth 5 --top-k 8 "
        "--total-tokens 48; mtbench = the first 20 MT-bench first turns, heldout = the 24 prompts of "
        "data_prep/prompts/heldout_train_dist.jsonl (training distribution, none of them in the training data).", ""]
    same = [
        "## What is the same", "",
        "- Data: the same conversations and the same tokens. draftlab's tokeniser (the target's chat template, loss on "
        "assistant tokens) wrote input_ids + loss_mask, which `speculators prepare-data` passes through unchanged; "
        "speculators trains on its prepared rows [0, int(rows x RATIO)) and validates on the rest, and draftlab "
        "trains on exactly those rows (bench/peer_speculators/prep_data.py split).",
        "- Target features stored before training on both sides (fp32): layers 2, 15, 27 as the fused input, and "
        "the last layer for the training target (speculators: pre-norm layer 30 + its own copy of the final norm; "
        "draftlab: post-norm state). Neither trainer runs the target while training.",
        "- Head: one Llama decoder layer reading [norm(embedding); norm(fused state)], fc from 3 x 576 to 576, "
        "draft vocabulary of the 4,096 most frequent assistant tokens of the training rows, ties by id (both "
        "libraries use that rule; speculators reads the same counts through --token-freq-path; the report checks "
        "that the two vocabularies are identical).",
        "- Loss: forward KL / soft cross-entropy to the target's distribution restricted to the draft vocabulary "
        "(the same gradient), TTT 3 steps weighted equally (speculators --ttt-step-loss-decay 1.0, draftlab "
        "drafter.ttt_decay=1.0), each step a mean over its valid positions.",
        "- Optimiser: AdamW lr 1e-3 constant (speculators --scheduler-type none; draftlab train.schedule=constant, "
        "no warm-up), betas (0.9, 0.999), weight decay 0.01 on every parameter, gradient clipping at norm 1.0, fp32, "
        "3 epochs, seed 0, OMP_NUM_THREADS=1.", ""]
    differ = [
        "## Differences that remain", "",
        "- Batches: speculators packs whole conversations into sequences of at most PACK tokens (no padding, "
        "document-masked attention), so its step count follows from the packing; draftlab takes BATCH "
        "conversations per step padded to the longest (padding share in the table), 3 x (rows // BATCH) steps.",
        "- Architecture variants: speculators' defaults norm_before_fc (an RMSNorm over the concatenated 1,728-wide "
        "input of fc), norm_before_residual (the layer's residual is the normed fused state) and norm_output (each "
        "step's output is normed before the LM head and before it is fed back) are on; draftlab's head has none of "
        "them (EAGLE-3 paper layout) and cannot switch them on for training (draftlab eval reads them from a "
        "speculators checkpoint).",
        "- Draft LM head: speculators keeps it frozen (the target's LM-head rows of the draft vocabulary); draftlab "
        "starts from the same rows and trains them (2.36 M more trainable parameters).",
        "- Loss positions: at TTT step j speculators weights the prediction of token t+2+j by the loss mask of "
        "token t+1+j, draftlab by that of token t+2+j (the predicted token): one position per conversation end "
        "differs (speculators also learns the newline after <|im_end|>, draftlab also the first assistant token).",
        "- Initialisation and random streams: each library's own (seed 0 on both sides, not the same numbers).",
        "- Checkpoints: speculators saves bf16 weights (trained in fp32) and validates on its 8 held-out rows every "
        "epoch (in its wall time, not in its step time); draftlab saves fp32 and evaluates nothing during training "
        "(eval.every=0).",
        "- Throughput accounting: draftlab's train seconds are its logged step times (train_seconds in "
        "metrics.jsonl); speculators' are the sum of its profiler's profile/step_ms, rounded to 3 significant "
        "digits in its console log. Training tokens are the conversations' tokens x epochs on both sides "
        "(speculators' own profiler counts one token fewer per conversation: train_tokens_per_second_their_profiler "
        "in the JSON).",
        "- speculators runs on the CPU only with bench/peer_speculators/cpu_train.py (two monkeypatches: .to(0) "
        "and torch.accelerator.synchronize) and with hidden states written by bench/peer_speculators/"
        "gen_hidden_states.py (transformers forward hooks, checked with speculators' own check_hidden_states) in "
        "place of its vLLM-only generate-offline-data; --draft-attn-impl sdpa (FlexAttention has no CPU backward), "
        "--loss-implementation eager (the fused loss needs triton), --optimizer adamw (its default Muon is far too "
        "slow on this CPU).", ""]
    feats = result["features"]
    prep = ["## Feature preparation (run at the same time, before training)", "",
            f"- speculators hidden states (400 prepared rows incl. its validation rows, layers 2/15/27/30, fp32): "
            f"{f(feats['speculators_hidden_states'].get('wall_seconds'), 0)} s wall, peak RSS "
            f"{f(feats['speculators_hidden_states'].get('peak_rss_gb'))} GB.",
            f"- draftlab feature store (the {split['train_rows']} training rows, indices 2/15/27/-1, fp32): "
            f"{f(feats['draftlab_store'].get('wall_seconds'), 0)} s wall, peak RSS "
            f"{f(feats['draftlab_store'].get('peak_rss_gb'))} GB.", ""]
    head = [x for line in head if line for x in (line, "")]        # one paragraph per line
    md = head + ["## Results", ""] + lines + ["", "Reading:", ""] + reading + [""] + same + differ + prep
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
