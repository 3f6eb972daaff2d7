"""Online updates of a served drafter from its round log (`draftlab serve-learn`).

Paper: Liu, Hu, Bailis, Cheung, Deng, Stoica, Zhang, "Online Speculative Decoding" (ICML 2024, arXiv 2310.07177);
with DistillSpec (Zhou et al., ICLR 2024) for the divergence. method_specs.md 4.1-4.2 hold what was read.

Specification, as read:
* [ABS] Keep updating the draft model on the queries a server actually sees, by online knowledge distillation,
  with spare compute of the serving cluster; reported +0.1 to +0.65 token acceptance rate, 1.22x-3.06x lower
  latency.
* [CODE, method_specs 4.2] Serve each request with speculative decoding, record the served tokens and where the
  target corrected the draft in a buffer; every few requests run one update on the buffer: the student's and the
  teacher's distributions on the served sequences, forward KL (soft cross-entropy to the teacher), small constant
  learning rate.

What draftlab builds:
* Input: a round log (`rounds.py`), written by `draftlab eval --log-rounds` or by any engine that writes the same
  rows; followed as it grows (`LogFollower` only reads it: the serving side never waits for the learner, which runs
  in its own process). A prompt's rows make one served conversation: its committed sequence, the positions of
  every token a round emitted (accepted drafts and bonus tokens: the verified positions) and the target's top-k
  at each of them.
* Loss at the verified positions only. small_lm: the drafter's divergence (drafter.distill_loss, forward KL by
  default) to the logged target top-k (`SmallLM.topk_loss`; the rest of the mass as a tail, as in offline
  white-box mode), so the learner needs no target forward. Feature-level heads (eagle, eagle3, medusa, ...): their
  own training loss (`drafter.loss`), whose teacher is the target's full distribution at those positions, with
  the target's features from one no-grad target forward in the learner (the log holds no hidden states).
* Small steps with a replay buffer: every `update_every` new conversations, `steps` AdamW steps on batches drawn
  from the new conversations and, with share `replay_share`, from the last `replay` conversations seen before.
* A gate on measured tau, not loss: after each update the candidate speculates greedily on a held-out prompt slice;
  it becomes the published checkpoint (`out/step_N`, `out/best`) only when its tau is at least the current one's,
  otherwise the weights go back to the current checkpoint's. So `out/best` never moves to a worse-scoring drafter.
* Resumable: after each update `out/serve_learn.pt` (written, then renamed) holds the log and drafter it learns
  from, the update counter, the conversations consumed (with a digest of them), the published step and its tau, the
  optimizer and the random states (batch draws, feature noise). A rerun with the same --out reads the log from the
  start, refills the replay buffer from the consumed conversations (the buffer is always the last `replay` of
  them) and updates only on the ones after: it ends where one uninterrupted run would.
* Recipe: `recipes/serve_learn.yaml` (`draftlab serve-learn --recipe serve_learn ...`) holds the options for a
  server that keeps appending to its log; options on the command line win. The published checkpoint is a normal
  step folder (`out/best`): `draftlab push OUT` exports it like any other.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from draftlab.errors import ConfigError, DataError
from draftlab.rounds import parse_row

STATE_NAME = "serve_learn.pt"


@dataclass
class Conversation:
    """One served prompt rebuilt from its rows: ids (prompt + emitted tokens), and per verified position (an index
    into ids of a token some round emitted) the target's top-k ids and log-probabilities for that token."""

    prompt: int
    ids: list[int]
    verified: list[int] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    rounds: int = 0
    accepted: int = 0


def conversation(rows) -> Conversation:
    """The rows of one prompt, in order (round 0 first) -> its Conversation."""
    first = rows[0]
    if first.round != 0:
        raise DataError(f"round log: prompt {first.prompt} starts at round {first.round}: its round 0 (with "
                        "prompt_ids) is missing")
    conv = Conversation(first.prompt, list(first.prompt_ids) + [first.root])
    for row in rows:
        if row.context != len(conv.ids):
            raise DataError(f"round log: prompt {row.prompt} round {row.round} starts at context {row.context}, the "
                            f"rows before it give {len(conv.ids)} tokens: rows missing or out of order")
        for r, token in enumerate(row.new_tokens):
            conv.verified.append(len(conv.ids))
            conv.ids.append(token)
            conv.topk_ids.append(row.target_topk_ids[r])
            conv.topk_logprobs.append(row.target_topk_logprobs[r])
        conv.rounds += 1
        conv.accepted += len(row.accepted)
    return conv


class LogFollower:
    """Reads a growing round log: `poll()` returns the conversations completed since the last call (a prompt is
    complete when a row of another prompt follows it; `finish()` closes the last one). Only whole lines are read,
    so a row being written is picked up at the next poll."""

    def __init__(self, path: str | Path):
        self.path, self.offset, self.line = Path(path), 0, 0
        self.pending: list = []

    def poll(self) -> list[Conversation]:
        done = []
        if not self.path.is_file():
            return done
        with open(self.path) as f:
            f.seek(self.offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break                                   # nothing more, or a row not fully written yet
                self.offset += len(line.encode())
                self.line += 1
                if not line.strip():
                    continue
                row = parse_row(line, self.path, self.line)
                if self.pending and (row.prompt != self.pending[0].prompt or row.round == 0):
                    done.append(conversation(self.pending))
                    self.pending = []
                self.pending.append(row)
        return done

    def finish(self) -> list[Conversation]:
        done = self.poll()
        if self.pending:
            done.append(conversation(self.pending))
            self.pending = []
        return done


def make_batch(convs: list[Conversation], pad_id: int, topk: bool, device) -> dict:
    """Right-padded batch: input_ids, attention_mask, loss_mask [B, T] (1 at the verified positions); topk=True adds
    teacher_topk_ids / teacher_topk_logprobs [B, T, k] and teacher_tail_mass [B, T] at the position before each
    verified token (the logits that predict it), a harmless uniform top-k elsewhere."""
    length = max(len(c.ids) for c in convs)
    B = len(convs)
    ids = torch.full((B, length), pad_id, dtype=torch.long)
    attn = torch.zeros(B, length, dtype=torch.long)
    mask = torch.zeros(B, length, dtype=torch.long)
    for b, c in enumerate(convs):
        ids[b, :len(c.ids)] = torch.tensor(c.ids)
        attn[b, :len(c.ids)] = 1
        mask[b, c.verified] = 1
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}
    if topk:
        k = min(len(row) for c in convs for row in c.topk_ids)
        top_ids = torch.arange(k).expand(B, length, k).clone()
        top_lp = torch.full((B, length, k), -float(torch.log(torch.tensor(float(k)))))
        for b, c in enumerate(convs):
            where = torch.tensor(c.verified) - 1
            top_ids[b, where] = torch.tensor([row[:k] for row in c.topk_ids])
            top_lp[b, where] = torch.tensor([row[:k] for row in c.topk_logprobs])
        batch.update(teacher_topk_ids=top_ids, teacher_topk_logprobs=top_lp,
                     teacher_tail_mass=(1.0 - top_lp.exp().sum(-1)).clamp(min=0.0))
    return {k: v.to(device) for k, v in batch.items()}


def update_loss(drafter, target, batch: dict) -> tuple[Tensor, dict]:
    """small_lm: divergence to the logged top-k; other kinds: their own loss over the target's features."""
    if hasattr(drafter, "topk_loss"):
        return drafter.topk_loss(batch)
    features = None
    if drafter.feature_layers:
        from draftlab.target import target_features

        with torch.no_grad():
            out = target.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    output_hidden_states=True)
            features = target_features(out.hidden_states, drafter.feature_layers)
    return drafter.loss(batch, features)


def measured_tau(target, drafter, prompts: list[Tensor], draft_length: int, max_new_tokens: int, eos=None) -> float:
    """Greedy speculative decoding of `prompts` with chains of draft_length: new tokens / target forwards."""
    from draftlab.evaluator import speculative_generate
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    drafter.eval()
    proposer = drafter.proposer(target)
    results = [speculative_generate(target, proposer, p, TreeSpec(kind="chain", draft_length=draft_length),
                                    Sampling(), max_new_tokens, eos) for p in prompts]
    return sum(r.new_tokens for r in results) / max(1, sum(r.rounds for r in results))


def keeps(candidate_tau: float, current_tau: float) -> bool:
    """The gate: a candidate replaces the published drafter only when it scores at least as well."""
    return candidate_tau >= current_tau


@dataclass
class OnlineConfig:
    lr: float = 1e-4
    """AdamW learning rate (constant)."""
    update_every: int = 8
    """New conversations between updates."""
    steps: int = 4
    """Optimizer steps per update."""
    batch_size: int = 4
    """Conversations per step."""
    replay: int = 64
    """Replay buffer: the last this-many conversations used before."""
    replay_share: float = 0.5
    """Share of each batch drawn from the replay buffer (when it holds any)."""
    clip: float = 1.0
    """Gradient norm clipping."""
    seed: int = 0
    """Seed of the batch draws."""


LEARNER_OPTIONS = ("lr", "update_every", "steps", "batch_size", "replay", "replay_share", "seed")  # serve-learn's


def read_state(out_dir: str | Path, source: dict) -> dict | None:
    """The saved learner state of a serve-learn --out (None when there is none). source: {"rounds", "checkpoint"}
    of this run; another log or drafter than the recorded one is a ConfigError."""
    path = Path(out_dir) / STATE_NAME
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:
        raise ConfigError(f"--out {out_dir}: {path} is unreadable ({type(e).__name__}): give a new --out") from None
    for key, what in (("rounds", "round log"), ("checkpoint", "drafter")):
        if key in source and state["source"].get(key) != source[key]:
            raise ConfigError(f"--out {out_dir} learns from {what} {state['source'].get(key)}, not {source[key]}: "
                              f"rerun with that --{key}, or give a new --out")
    return state


def _digest(previous: str, conv: Conversation) -> str:
    """A running hash of the consumed conversations: a rerun checks that its log starts with the same ones."""
    return hashlib.sha256(f"{previous}|{conv.prompt}|{conv.ids}".encode()).hexdigest()[:16]


class OnlineLearner:
    """Updates `drafter` from served conversations and publishes gated checkpoints in `out_dir`; continues the
    learner saved there, if any (module docstring).

    score(drafter) -> tau on the held-out slice (measured_tau with fixed prompts, or any function in tests).
    source: what the run learns from ({"rounds": log, "checkpoint": drafter}), recorded and checked on resuming."""

    def __init__(self, drafter, target, out_dir: str | Path, score, cfg: OnlineConfig, pad_id: int = 0,
                 source: dict | None = None):
        self.drafter, self.target, self.out, self.score, self.cfg, self.pad_id = drafter, target, Path(out_dir), \
            score, cfg, pad_id
        self.source = source or {}
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr)
        self.fresh: list[Conversation] = []
        self.buffer: deque[Conversation] = deque(maxlen=cfg.replay)
        self.rng = random.Random(cfg.seed)
        self.updates, self.seen, self.digest = 0, 0, ""
        self.skip, self.skip_digest = 0, ""       # on resuming: conversations the saved learner already consumed
        state = read_state(self.out, self.source)
        if state is None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.current_tau = score(drafter)
            self.current_state = self._state()
            self._publish(0, self.current_tau, {"update": 0, "conversations": 0})
            self._save()
        else:
            self._resume(state)

    def _save(self) -> None:
        """Everything a rerun needs to continue, written to a temporary file and then renamed over the old one."""
        path = self.out / STATE_NAME
        torch.save({"source": self.source, "updates": self.updates, "conversations": self.seen,
                    "digest": self.digest, "current_tau": self.current_tau,
                    "published": (self.out / "best").read_text().strip(), "optimizer": self.optimizer.state_dict(),
                    "rng": self.rng.getstate(), "torch_rng": torch.get_rng_state(),     # torch's: feature noise
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                   path.with_name(path.name + ".tmp"))
        os.replace(path.with_name(path.name + ".tmp"), path)

    def _resume(self, state: dict) -> None:
        from safetensors.torch import load_file

        from draftlab.checkpoint import WEIGHTS_NAME

        self.drafter.load_state_dict(load_file(str(self.out / state["published"] / WEIGHTS_NAME)), strict=False)
        self.current_tau, self.current_state = state["current_tau"], self._state()
        self.optimizer.load_state_dict(state["optimizer"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.updates, self.seen, self.digest = state["updates"], state["conversations"], state["digest"]
        self.skip = self.seen

    def _state(self) -> dict:
        """The weights a checkpoint holds (frozen pieces taken from the target stay out)."""
        from draftlab.checkpoint import trainable_state_dict

        return {k: v.detach().clone() for k, v in trainable_state_dict(self.drafter).items()}

    def _publish(self, update: int, tau: float, record: dict) -> None:
        from draftlab.checkpoint import save_drafter, write_text_atomic

        name = f"step_{update}"
        save_drafter(self.drafter, self.out / name,
                     extra_files={"eval.json": json.dumps({"acceptance_length": tau, **record}, indent=2)})
        write_text_atomic(self.out / "best", name)

    def add(self, convs: list[Conversation]) -> None:
        for conv in convs:
            if self.skip:          # consumed before the rerun: back into the replay buffer, not trained on again
                self._skip(conv)
                continue
            self.fresh.append(conv)
            self.seen += 1
            if len(self.fresh) >= self.cfg.update_every:
                self.update()

    def _skip(self, conv: Conversation) -> None:
        self.buffer.append(conv)
        self.skip_digest, self.skip = _digest(self.skip_digest, conv), self.skip - 1
        if not self.skip and self.skip_digest != self.digest:
            raise DataError(f"round log {self.source.get('rounds', '')}: its first {self.seen} conversations are not "
                            f"the ones --out {self.out} learned from: give a new --out for a new log")

    def _batch(self) -> list[Conversation]:
        n = self.cfg.batch_size
        old = round(n * self.cfg.replay_share) if self.buffer else 0
        return [self.rng.choice(self.fresh) for _ in range(n - old)] + \
               [self.rng.choice(self.buffer) for _ in range(old)]

    def update(self) -> dict | None:
        """One update on the new conversations (+ replay), then the gate. Returns the record (None if nothing new)."""
        if not self.fresh:
            return None
        self.updates += 1
        start = time.perf_counter()
        self.drafter.train()
        losses = []
        device = next(self.drafter.parameters()).device
        for _ in range(self.cfg.steps):
            batch = make_batch(self._batch(), self.pad_id, hasattr(self.drafter, "topk_loss"), device)
            loss, _ = update_loss(self.drafter, self.target, batch)
            self.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip)
            self.optimizer.step()
            losses.append(loss.item())
        self.drafter.eval()
        tau = self.score(self.drafter)
        kept = keeps(tau, self.current_tau)
        record = {"update": self.updates, "conversations": self.seen, "loss_first": losses[0], "loss_last": losses[-1],
                  "candidate_tau": tau, "published_tau": self.current_tau, "kept": kept,
                  "seconds": time.perf_counter() - start}
        if kept:
            self.current_tau, self.current_state = tau, self._state()
            self._publish(self.updates, tau, record)
        else:      # back to the published weights; the optimizer's moments belonged to the rejected steps
            self.drafter.load_state_dict(self.current_state, strict=False)
            self.optimizer = torch.optim.AdamW(self.params, lr=self.cfg.lr)
        for conv in self.fresh:
            self.digest = _digest(self.digest, conv)
        self.buffer.extend(self.fresh)
        self.fresh = []
        self._save()
        with open(self.out / "online.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def cmd_serve_learn(argv: list[str]) -> None:
    """`draftlab serve-learn`: follow a round log and update the drafter online (module docstring)."""
    from draftlab.config import parse_command_args
    from draftlab.errors import OneLineParser

    p = OneLineParser(prog="draftlab serve-learn", description="Update a drafter online from the round log a server "
                      "writes (draftlab eval --log-rounds); publish it only when its tau on held-out prompts does not "
                      "fall.")
    p.add_argument("--recipe", help="recipes/NAME.yaml with `command: serve-learn` (e.g. serve_learn) or a YAML "
                   "file: option values; options given here win")
    p.add_argument("--checkpoint", help="the served drafter (run or step folder)")
    p.add_argument("--rounds", help="round log to follow")
    p.add_argument("--heldout", help="JSONL prompts for the gate (none of them served)")
    p.add_argument("--out", help="new folder (step_N checkpoints, best, online.jsonl, "
                   f"{STATE_NAME}), or the --out of an earlier run on the same log and drafter: continue it")
    p.add_argument("--target", default=None, help="default: the checkpoint's")
    p.add_argument("--num-heldout", type=int, default=8)
    p.add_argument("--draft-length", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--follow", action=argparse.BooleanOptionalAction, default=False,
                   help="keep reading the log as it grows until it is idle (--no-follow: read what is there, then stop)")
    p.add_argument("--idle-seconds", type=float, default=60.0, help="with --follow: stop after this long without rows")
    p.add_argument("--poll-seconds", type=float, default=1.0)
    for name in LEARNER_OPTIONS:
        default = getattr(OnlineConfig, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                       help=f"default {default} (see draftlab/online.py OnlineConfig)")
    args = parse_command_args(p, argv, "serve-learn", required=("checkpoint", "rounds", "heldout", "out"))
    for name in ("num_heldout", "draft_length", "max_new_tokens", "update_every", "steps", "batch_size", "replay"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1")
    if not 0.0 <= args.replay_share <= 1.0 or args.lr <= 0:
        raise ConfigError("--replay-share must be in [0, 1] and --lr above 0")
    from draftlab.runlock import check_output, claim_outputs

    check_output("--out", args.out, folder=True, example="learned", inputs=[
        ("--checkpoint", args.checkpoint), ("--rounds", args.rounds), ("--heldout", args.heldout),
        ("--target", args.target), ("--recipe", args.recipe)])
    with claim_outputs([("--out", args.out)]):      # one learner per --out: a second is refused by the first's pid
        learn(args)


def learn(args) -> None:
    """`draftlab serve-learn` once its options are checked and --out is locked."""
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / STATE_NAME).is_file():
        raise ConfigError(f"--out {out} is not empty and not a serve-learn folder (no {STATE_NAME}): give a new folder")
    if not args.follow and not Path(args.rounds).is_file():
        raise DataError(f"round log {args.rounds} not found: write one with draftlab eval --log-rounds (or pass "
                        "--follow to wait for it)")
    from draftlab.checkpoint import checkpoint_target, resolve_checkpoint
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.drafters import load_drafter
    from draftlab.target import eos_ids, load_target
    from draftlab.train import pad_id

    folder = resolve_checkpoint(args.checkpoint)
    source = {"rounds": str(Path(args.rounds).resolve()), "checkpoint": str(folder.resolve())}
    read_state(out, source)                                 # another log or drafter fails before the model loads
    heldout = load_prompts(args.heldout, limit=args.num_heldout)
    target, tokenizer = load_target(args.target or checkpoint_target(folder), "auto", "auto")
    drafter = load_drafter(folder, target)
    prompts = [encode_prompt(tokenizer, h.messages) for h in heldout]
    eos = eos_ids(tokenizer, target)
    score = lambda d: measured_tau(target, d, prompts, args.draft_length, args.max_new_tokens, eos)
    cfg = OnlineConfig(**{k: getattr(args, k) for k in LEARNER_OPTIONS})
    learner = OnlineLearner(drafter, target, out, score, cfg, pad_id(tokenizer), source)
    published = f"{out / (out / 'best').read_text().strip()} (continued after {learner.updates} updates on " \
        f"{learner.seen} conversations)" if learner.skip else folder
    print(f"serve-learn: {published} scores tau {learner.current_tau:.3f} on {len(prompts)} held-out prompts; "
          f"following {args.rounds}", flush=True)
    follower = LogFollower(args.rounds)
    idle = time.monotonic()
    while True:
        convs = follower.poll()
        if convs:
            idle = time.monotonic()
            learner.add(convs)
        elif not args.follow or time.monotonic() - idle > args.idle_seconds:
            break
        else:
            time.sleep(args.poll_seconds)
    learner.add(follower.finish())
    if learner.skip:
        raise DataError(f"round log {args.rounds} holds fewer conversations than the {learner.seen} --out {out} "
                        "already learned from: give a new --out for a new log")
    learner.update()
    print(f"serve-learn: {learner.seen} conversations, {learner.updates} updates; published "
          f"{(out / 'best').read_text().strip()} (tau {learner.current_tau:.3f})", flush=True)

