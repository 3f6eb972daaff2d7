"""Chat-like prompts written by the target itself, from its chat template's user prefix (Magpie-style).

The target is shown its template up to and including the header of a user turn, after a system prompt that names
the kind of request (one per MT-bench category), and samples at T > 0 until it ends the turn: what it writes is a
user message in the style it was tuned on. For a share of conversations it then answers that message (greedy,
with no steering system prompt: the answer the answering loop would give) and writes a follow-up user turn after
it, so those rows are `[user, assistant, user]`: a prompt with its history, whose last turn `data_prep/regenerate.py`
answers.

One code path for the local answering backends (`draftlab.engines`: llama_cpp, transformers): a prompt with a
`prefix` is that text continued as is. Rows are appended to a JSONL file a chunk at a time and synced, so a rerun
skips finished ids; each chunk draws from its own seed, so a rerun reproduces the same rows.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from draftlab.answers import read_done_ids
from draftlab.data import Prompt
from draftlab.errors import ConfigError, TargetError, describe_disk_full, is_disk_full
from draftlab.runlock import FolderLock

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SYSTEM_PROMPTS = {
    "writing": "You are a helpful writing assistant. Users ask you to write things for them: a story, a poem, an "
               "email, a blog post, a speech, a product description or an essay, often with a tone, length or "
               "audience in mind.",
    "roleplay": "You are a versatile role-play partner. Users ask you to pretend to be a character, a famous person "
                "or a professional, and to answer them in that role, staying in character.",
    "reasoning": "You are a careful reasoning assistant. Users give you logic puzzles, riddles and questions that "
                 "need step-by-step thinking, and ask you to explain how you reached the answer.",
    "math": "You are a math tutor. Users ask you to solve math problems: arithmetic, algebra, equations, geometry, "
            "probability and word problems with numbers.",
    "coding": "You are an expert programmer. Users ask you to write, explain or fix code: Python functions, "
              "JavaScript, SQL queries, algorithms and data structures.",
    "extraction": "You are a precise information-extraction assistant. Users paste a text, such as a review, an "
                  "article or a report, and ask you to extract, list, summarize or reformat information from it.",
    "stem": "You are a knowledgeable science and technology assistant. Users ask you questions about physics, "
            "chemistry, biology, engineering, computers and medicine.",
    "humanities": "You are a knowledgeable humanities assistant. Users ask you about history, philosophy, "
                  "literature, art, economics, law, politics and culture.",
}
FOLLOW_UP = ("The user has read your answer and now asks a follow-up: a change to it, more detail, an example, or "
             "a related question.")
SENTINEL = "\u2063draftlab-user-turn\u2063"  # stands in for the user's message to find where it would begin


@dataclass
class SynthSettings:
    user_temperature: float = 0.7   # sampling temperature of the user turns the target writes
    user_max_tokens: int = 128      # a user turn not ended by then is kept but marked unfinished (finish=length)
    answer_temperature: float = 0.0  # the answer before a follow-up: greedy, as data_prep/regenerate.py answers
    answer_max_tokens: int = 192
    multi_turn: float = 0.25        # share of conversations that get a follow-up turn
    chunk: int = 64                 # conversations per chunk: written together, seeded together
    seed: int = 0


@dataclass
class Planned:
    id: str
    index: int
    category: str
    multi_turn: bool


def parse_mix(text: str) -> dict[str, float]:
    """`equal` or `writing=2,math=1,...` -> {category: share} (shares normalised to sum 1); ConfigError if bad."""
    if text.strip() == "equal":
        return {c: 1 / len(CATEGORIES) for c in CATEGORIES}
    shares = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in CATEGORIES:
            raise ConfigError(f"unknown prompt category {name!r} in --mix: use {', '.join(CATEGORIES)}")
        try:
            shares[name] = float(value)
        except ValueError:
            raise ConfigError(f"--mix {part!r}: the share must be a number, e.g. {name}=1") from None
        if shares[name] < 0:
            raise ConfigError(f"--mix {part!r}: a share cannot be negative")
    if sum(shares.values()) <= 0:
        raise ConfigError(f"--mix {text!r} gives no category a share: e.g. equal or writing=1,math=1")
    total = sum(shares.values())
    return {c: v / total for c, v in shares.items()}


def unit_hash(*parts) -> float:
    """A number in [0, 1) fixed by `parts` (independent of Python's hash seed)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def plan(num: int, shares: dict[str, float], multi_turn: float, seed: int) -> list[Planned]:
    """The conversations to make: ids `synth-00000`..., categories interleaved so that every prefix of the plan
    follows the shares (smooth weighted round robin), the multi-turn ones drawn from a hash of (seed, index).
    The first N planned rows are the same whatever `num` is, so a larger run extends a smaller one."""
    made = {c: 0 for c in shares}
    planned = []
    for i in range(num):
        category = max(shares, key=lambda c: (shares[c] * (i + 1) - made[c], -CATEGORIES.index(c)))
        made[category] += 1
        planned.append(Planned(f"synth-{i:05d}", i, category, unit_hash(seed, i, "multi") < multi_turn))
    return planned


def user_prefix(render, messages: list[dict]) -> str:
    """The template's text for `messages` followed by the header of a new user turn (what the target continues
    to write the user's message). `render(messages)` is the backend's chat template."""
    try:
        text = render(messages + [{"role": "user", "content": SENTINEL}])
    except Exception as e:  # no template, or one that rejects a system turn
        raise TargetError(f"the target's chat template cannot render a conversation ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100] if str(e) else ''}): prompt synthesis writes user turns from "
                          "the template's user prefix, so the target needs a chat template") from None
    at = text.find(SENTINEL)
    if at < 0:
        raise TargetError("the chat template does not show a user message as written, so the user turn's prefix "
                          "cannot be found: prompt synthesis needs a template that renders the message verbatim")
    return text[:at]


@contextmanager
def sampling(backend, temperature: float, max_new_tokens: int, seed: int):
    """Run `backend` with these settings for one phase (transformers samples from torch's RNG, seeded here)."""
    saved = backend.temperature, backend.max_new_tokens, backend.seed
    backend.temperature, backend.max_new_tokens, backend.seed = temperature, max_new_tokens, seed
    torch.manual_seed(seed)
    try:
        yield backend
    finally:
        backend.temperature, backend.max_new_tokens, backend.seed = saved


def generate(backend, prompts: list[Prompt], temperature: float, max_new_tokens: int, seed: int) -> dict:
    """{prompt id: Answer} for one phase."""
    with sampling(backend, temperature, max_new_tokens, seed):
        return {a.prompt.id: a for group in backend.stream(prompts) for a in group}


def synthesize_chunk(backend, todo: list[Planned], s: SynthSettings, seed: int) -> tuple[list[dict], int]:
    """Write one chunk's conversations: first user turns, then for the multi-turn ones whose first turn ended, the
    answer and a follow-up user turn. Returns (rows, generated tokens)."""
    firsts = [Prompt(p.id, [], category=p.category,
                     prefix=user_prefix(backend.render, [{"role": "system", "content": SYSTEM_PROMPTS[p.category]}]))
              for p in todo]
    first = generate(backend, firsts, s.user_temperature, s.user_max_tokens, seed * 3)
    tokens = sum(a.new_tokens for a in first.values())
    follow = [p for p in todo if p.multi_turn and first[p.id].finish == "eos" and first[p.id].text.strip()]
    asked = [Prompt(p.id, [{"role": "user", "content": first[p.id].text.strip()}]) for p in follow]
    answers = generate(backend, asked, s.answer_temperature, s.answer_max_tokens, seed * 3 + 1) if asked else {}
    history = {q.id: q.messages + [{"role": "assistant", "content": answers[q.id].text.strip()}] for q in asked}
    seconds = [Prompt(p.id, [], category=p.category, prefix=user_prefix(backend.render, [
        {"role": "system", "content": f"{SYSTEM_PROMPTS[p.category]} {FOLLOW_UP}"}, *history[p.id]]))
        for p in follow]
    second = generate(backend, seconds, s.user_temperature, s.user_max_tokens, seed * 3 + 2) if seconds else {}
    tokens += sum(a.new_tokens for a in [*answers.values(), *second.values()])
    rows = []
    for p in todo:
        messages = [{"role": "user", "content": first[p.id].text.strip()}]
        finish = [first[p.id].finish]
        if p.id in second:
            messages = history[p.id] + [{"role": "user", "content": second[p.id].text.strip()}]
            finish += [answers[p.id].finish, second[p.id].finish]
        rows.append({"id": p.id, "category": p.category, "messages": messages,
                     "synth": {"finish": finish, "planned_multi_turn": p.multi_turn, "chunk_seed": seed}})
    return rows, tokens


def chunk_seed(seed: int, chunk: int) -> int:
    return int(unit_hash(seed, chunk, "chunk") * 2 ** 31)


def synthesize(backend, planned: list[Planned], out_path: str, s: SynthSettings, command: str = "",
               progress: bool = True) -> dict:
    """Make every planned conversation not yet in `out_path`, appending a chunk of rows at a time; returns
    {"made", "skipped", "new_tokens", "seconds"}. Each row records its category, the sampling settings, the
    backend's metadata (model file sha256, chat template hash) and the command that made it."""
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    lock = FolderLock(out_path + ".lock", f"prompt file {out_path}", "wait for that process to finish (or stop it), "
                      "or write the prompts to another file")
    with lock:
        try:
            return _synthesize_missing(backend, planned, out_path, s, command, progress)
        except OSError as e:
            if not is_disk_full(e):
                raise
            raise TargetError(f"{describe_disk_full(e)}: the rows made so far are kept in {out_path}; free space, "
                              "then run the same command again to make the rest") from None


def _synthesize_missing(backend, planned, out_path, s, command, progress) -> dict:
    user_prefix(backend.render, [{"role": "system", "content": SYSTEM_PROMPTS["writing"]}])  # no template: stop now
    done = read_done_ids(out_path)
    meta = {k: v for k, v in backend.describe().items() if k != "sampling"}
    meta["user_sampling"] = {"temperature": s.user_temperature, "top_p": 1.0, "top_k": 0,
                             "max_new_tokens": s.user_max_tokens}
    meta["answer_sampling"] = {"temperature": s.answer_temperature, "top_p": 1.0, "top_k": 0,
                               "max_new_tokens": s.answer_max_tokens}
    meta["settings"], meta["command"] = asdict(s), command
    todo = [p for p in planned if p.id not in done]
    counts = {"made": 0, "skipped": len(planned) - len(todo), "new_tokens": 0}
    t0 = time.time()
    bar = tqdm(total=len(todo), desc=f"writing prompts ({backend.name})", unit="conv", disable=not progress)
    try:
        with open(out_path, "a", encoding="utf-8") as f:
            for start in range(0, len(planned), s.chunk):  # chunks are fixed slices of the plan: fixed seeds
                chunk = [p for p in planned[start:start + s.chunk] if p.id not in done]
                if not chunk:
                    continue
                began = time.time()
                rows, tokens = synthesize_chunk(backend, chunk, s, chunk_seed(s.seed, start // s.chunk))
                took = round(time.time() - began, 2)
                for row in rows:
                    row["synth"].update(meta, chunk_seconds=took, chunk_tokens=tokens)
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
                counts["made"] += len(rows)
                counts["new_tokens"] += tokens
                bar.update(len(rows))
                bar.set_postfix(tok_s=f"{counts['new_tokens'] / max(time.time() - t0, 1e-9):.1f}")
    finally:
        bar.close()
    counts["seconds"] = round(time.time() - t0, 2)
    return counts
