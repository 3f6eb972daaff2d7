"""Online updates (`draftlab serve-learn`) on a shifted prompt distribution, against offline training on the same
conversations.

    nohup python bench/online_update.py > bench/results/cache/online_update/run.log 2>&1 &

The drafter: an EAGLE-3 head for SmolLM2-135M-Instruct trained on today's data (default: checkpoints/peer_ablation/base
of the main checkout: answers to pydoc / fortune / words prompts). The new distribution: coding prompts (HumanEval
tasks, ../shared/bench/humaneval_a.jsonl), split by row into a served stream (the first --served), a gate slice (the
next --gate, the held-out prompts serve-learn scores every candidate on) and a scoring slice (the next --score, used
by nothing else). Stages, cached in bench/results/cache/online_update/ (a rerun continues):
1. serve: greedy speculative decoding of the stream, chains of --draft-length, written as a round log.
2. online: `draftlab serve-learn` on that log: an update every --update-every conversations, --steps AdamW steps of
   --batch-size conversations each (replay share 0.5), published only when the gate slice's tau does not fall.
3. offline: the same drafter trained on the same served conversations with the same loss (the head's own, at the
   verified positions), learning rate, batch size and number of optimizer steps, all at once, ungated.
4. score: tau on the scoring slice (greedy, same chains) of the drafter before, after the online updates (its
   published checkpoint) and after offline training; and, for each, tau on the first --score MT-bench prompts (the
   general distribution, to see what the update costs there).
Writes bench/results/online_update.json and .md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from common import ROOT, SHARED, log, parser  # bench/common.py (it puts the checkout on sys.path)

CACHE = ROOT / "bench" / "results" / "cache" / "online_update"
OUT = ROOT / "bench" / "results" / "online_update"
CODING = SHARED / "humaneval_a.jsonl"
GENERAL = SHARED / "mtbench.jsonl"


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--served", type=int, default=24)
    ap.add_argument("--gate", type=int, default=6)
    ap.add_argument("--score", type=int, default=12)
    ap.add_argument("--general", type=int, default=12, help="MT-bench prompts scored too (0 = none)")
    ap.add_argument("--draft-length", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--update-every", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    from draftlab import online
    from draftlab.checkpoint import resolve_checkpoint, save_drafter
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.drafters import load_drafter
    from draftlab.evaluator import load_average, prompt_generator, speculative_generate
    from draftlab.checkpoint import checkpoint_target
    from draftlab.rounds import RoundLog
    from draftlab.target import eos_ids, load_target
    from draftlab.train import pad_id
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    torch.set_num_threads(args.threads)
    CACHE.mkdir(parents=True, exist_ok=True)
    load_start = load_average()
    folder = resolve_checkpoint(args.checkpoint)
    target_path = checkpoint_target(folder)
    target, tokenizer = load_target(target_path, "auto", "cpu")
    eos = eos_ids(tokenizer, target)
    rows = load_prompts(str(CODING), limit=args.served + args.gate + args.score)
    served, gate, scored = rows[:args.served], rows[args.served:args.served + args.gate], rows[args.served + args.gate:]
    encode = lambda prompts: [encode_prompt(tokenizer, p.messages) for p in prompts]
    gate_file = CACHE / "gate.jsonl"
    gate_file.write_text("".join(json.dumps({"id": p.id, "messages": p.messages}) + "\n" for p in gate))
    spec = TreeSpec(kind="chain", draft_length=args.draft_length)

    # 1. serve the stream
    rounds_file = CACHE / "served_rounds.jsonl"
    if not (CACHE / "served.done").exists():
        # resume: keep the prompts logged completely before (all but the last one seen), serve the rest
        kept = []
        if rounds_file.exists():
            lines = [line for line in rounds_file.read_text().splitlines(keepends=True) if line.endswith("\n")]
            last = json.loads(lines[-1])["prompt"] if lines else -1
            kept = [line for line in lines if json.loads(line)["prompt"] < last]
            rounds_file.write_text("".join(kept))
        start = len({json.loads(line)["prompt"] for line in kept})
        log(f"serving {len(served)} coding prompts (chains of {args.draft_length}; {start} logged before), logging rounds")
        drafter = load_drafter(folder, target).eval()
        proposer = drafter.proposer(target)
        with RoundLog(rounds_file, append=True) as rounds:
            for i, p in enumerate(encode(served)):
                if i < start:
                    continue
                speculative_generate(target, proposer, p, spec, Sampling(), args.max_new_tokens, eos,
                                     prompt_generator(target.device, 0, i), rounds.for_prompt(i, p))
        (CACHE / "served.done").write_text("done\n")
    convs = online.LogFollower(rounds_file).finish()

    # 2. online: the serve-learn command on the log
    online_dir = CACHE / "online"
    if not (online_dir / "best").exists() or not (CACHE / "online.done").exists():
        import shutil

        shutil.rmtree(online_dir, ignore_errors=True)
        log("serve-learn on the served log")
        command = [sys.executable, "-m", "draftlab.cli", "serve-learn", "--checkpoint", str(folder), "--rounds",
                   str(rounds_file), "--heldout", str(gate_file), "--out", str(online_dir), "--num-heldout",
                   str(args.gate), "--draft-length", str(args.draft_length), "--max-new-tokens",
                   str(args.max_new_tokens), "--update-every", str(args.update_every), "--steps", str(args.steps),
                   "--batch-size", str(args.batch_size), "--lr", str(args.lr)]
        start = time.perf_counter()
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        (CACHE / "online.done").write_text(f"{time.perf_counter() - start:.1f} s\n")
    updates = [json.loads(line) for line in (online_dir / "online.jsonl").read_text().splitlines()]

    # 3. offline: the same conversations, loss, lr, batch size and number of steps, at once
    offline_dir = CACHE / "offline"
    total_steps = sum(1 for _ in updates) * args.steps
    if not (offline_dir / "drafter_config.json").exists():
        log(f"offline: {total_steps} steps over the same {len(convs)} conversations")
        drafter = load_drafter(folder, target)
        drafter.train()
        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=args.lr)
        order = torch.Generator().manual_seed(0)
        losses = []
        for step in range(total_steps):
            pick = torch.randint(len(convs), (args.batch_size,), generator=order).tolist()
            batch = online.make_batch([convs[i] for i in pick], pad_id(tokenizer), hasattr(drafter, "topk_loss"),
                                      "cpu")
            loss, _ = online.update_loss(drafter, target, batch)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            losses.append(loss.item())
        save_drafter(drafter.eval(), offline_dir, extra_files={"losses.json": json.dumps(losses)})

    # 4. tau on the scoring slice (coding) and on MT-bench (general)
    score_file = CACHE / "scores.json"
    scores = json.loads(score_file.read_text()) if score_file.exists() else {}
    sets = [("coding", encode(scored))] + ([("general", encode(load_prompts(str(GENERAL), limit=args.general)))]
                                           if args.general else [])
    for label, path in (("before", folder), ("online", resolve_checkpoint(online_dir)), ("offline", offline_dir)):
        for name, prompts in sets:
            key = f"{label}/{name}"
            if key in scores:
                continue
            log(f"scoring {key}")
            drafter = load_drafter(path, target).eval()
            scores[key] = online.measured_tau(target, drafter, prompts, args.draft_length, args.max_new_tokens, eos)
            score_file.write_text(json.dumps(scores, indent=2))
    write(args, folder, convs, updates, total_steps, scores, resolve_checkpoint(online_dir).name, load_start,
          load_average())


def write(args, folder, convs, updates, total_steps, scores, published, load_start, load_end) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    served_tau = sum(len(c.verified) for c in convs) / sum(c.rounds for c in convs)
    result = {"header": {"command": "python bench/online_update.py " + " ".join(sys.argv[1:]), "commit": commit,
                         "checkpoint": str(folder), "served": args.served, "gate": args.gate, "score": args.score,
                         "draft_length": args.draft_length, "max_new_tokens": args.max_new_tokens,
                         "update_every": args.update_every, "steps": args.steps, "batch_size": args.batch_size,
                         "lr": args.lr, "threads": args.threads, "load_average": [load_start, load_end]},
              "served_tau": served_tau, "updates": updates, "published": published, "offline_steps": total_steps,
              "tau": scores}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Online updates from served rounds on coding prompts (`bench/online_update.py`)", "",
             f"Command: `{result['header']['command']}` at {commit}. Drafter: the EAGLE-3 head `{folder}` for "
             f"SmolLM2-135M-Instruct, trained on pydoc / fortune / words answers. New distribution: HumanEval prompts "
             f"(`humaneval_a.jsonl`): {args.served} served (greedy, chains of {args.draft_length}, "
             f"{args.max_new_tokens} new tokens; served tau {served_tau:.3f}), the next {args.gate} as serve-learn's "
             f"gate slice, the next {args.score} for scoring only. Online: an update every {args.update_every} "
             f"conversations, {args.steps} AdamW steps of {args.batch_size} conversations (replay share 0.5), lr "
             f"{args.lr:g}, published only when the gate's tau does not fall. Offline: the same {len(convs)} "
             f"conversations, loss, lr and batch size, {total_steps} steps at once, ungated. One thread; load average "
             f"{load_start} at the start, {load_end} at the end (tau does not depend on load).", "",
             "| update | conversations | loss first -> last | candidate tau (gate) | published tau | kept |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {u['update']} | {u['conversations']} | {u['loss_first']:.3f} -> {u['loss_last']:.3f} | "
              f"{u['candidate_tau']:.3f} | {u['published_tau']:.3f} | {'yes' if u['kept'] else 'no'} |" for u in updates]
    lines += ["", f"Published after the stream: `{published}`.", "",
              f"| drafter | tau coding ({args.score} unseen HumanEval prompts) | tau general ({args.general} MT-bench) |",
              "|---|---|---|"]
    for label in ("before", "online", "offline"):
        general = scores.get(label + "/general")
        lines.append(f"| {label} | {scores[label + '/coding']:.3f} | {f'{general:.3f}' if general else '-'} |")
    gain_on, gain_off = scores["online/coding"] - scores["before/coding"], scores["offline/coding"] - scores["before/coding"]
    lines += ["", f"On the coding slice, the online updates moved tau by {gain_on:+.3f} and offline training on the same "
                  f"conversations by {gain_off:+.3f} (one seed, {args.score} prompts: differences of a few hundredths "
                  "are within what this size can tell apart)."]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
