"""The round log: one JSON line per speculative round, written by `draftlab eval --log-rounds FILE` (or by any engine
that writes the same rows) and read by DISCO's stop classifier (`disco.py`) and online updates.

Format version 1. Every line is one JSON object with these keys (the `Round` dataclass below):

    version               1
    prompt                index of the prompt in the scored set (0-based)
    round                 index of the round within that prompt's decoding (0-based)
    prompt_hash           sha256 of the prompt's token ids written as decimal numbers joined by ",", first 16 hex
    prompt_ids            the prompt's token ids in its round 0; null in later rounds (the hash ties them together):
                          a prompt of a few hundred tokens is stored once instead of once per round
    context               committed tokens before the round, the root included (prompt length + tokens emitted so far)
    root                  the newest committed token (the tree's root; the target has not seen it yet)
    tokens, parents       the draft nodes: token ids and parent node indices (-1 = the root); a chain of k has
                          parents [-1, 0, ..., k-2]; an empty list when nothing was drafted
    q                     per node, the probability its proposal distribution gave its token (sampled proposals);
                          null for deterministic proposals (greedy, top-k, prompt lookup)
    draft_stats           per node, [top-1 probability, top-2 probability, entropy in nats] of the drafter's own
                          temperature-1 distribution the node was drafted from; null when the proposer has none
                          (prompt lookup) or the writer does not record them
    accepted              the accepted path: node indices from depth 1 down (its length = accepted draft tokens)
    bonus                 the token the target added after the accepted path
    target_topk_ids       the target's top-k token ids at each verified position: row r is the target's temperature-1
    target_topk_logprobs  distribution (log-probabilities, descending) for new token r, where the round's new tokens
                          are [tokens[i] for i in accepted] + [bonus]; so there are len(accepted) + 1 rows
    sampling              {"temperature", "top_p", "top_k"} applied to draft and target in that round
    drafter               optional, in round 0 rows only: {"checkpoint", "kind", "target"} of the drafter that
                          drafted (its checkpoint folder or label, its kind, target.target_fingerprint of the target),
                          so that what is trained from the log (DISCO's classifier) can be checked against what uses
                          it; logs without it still read

A prompt's committed sequence is prompt_ids + [round 0's root] + every round's new tokens in order; a round's
`context` is where its new tokens start. A round yields len(accepted) + 1 tokens, so over a prompt set the sum of
(len(accepted) + 1) equals the evaluator's `new_tokens` and the number of rows its `target_forwards`.

`RoundLog` writes rows (one file, flushed after every row so a learner can follow it); `read_rounds` reads them
back and stops at the first bad row with one line naming the file, the line and the problem.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor

from draftlab.errors import DataError

FORMAT_VERSION = 1
DEFAULT_TOPK = 8


@dataclass
class Round:
    """One row of the round log (see the module docstring for each key)."""

    version: int
    prompt: int
    round: int
    prompt_hash: str
    prompt_ids: list[int] | None
    context: int
    root: int
    tokens: list[int]
    parents: list[int]
    q: list[float] | None
    draft_stats: list[list[float]] | None
    accepted: list[int]
    bonus: int
    target_topk_ids: list[list[int]]
    target_topk_logprobs: list[list[float]]
    sampling: dict
    drafter: dict | None = None
    @property
    def new_tokens(self) -> list[int]:
        """The tokens this round appended: the accepted draft tokens, then the bonus."""
        return [self.tokens[i] for i in self.accepted] + [self.bonus]

    def judged(self) -> list[int]:
        """The nodes the target judged: children of the root or of an accepted node (their verdict is known)."""
        path = set(self.accepted)
        return [i for i, p in enumerate(self.parents) if p < 0 or p in path]


def drafter_identity(checkpoint: str | None, kind: str, target) -> dict:
    """The round log's `drafter` key: the drafter's checkpoint (folder or label; None for prompt lookup), its kind
    and the target's fingerprint."""
    from draftlab.target import target_fingerprint

    return {"checkpoint": checkpoint, "kind": kind, "target": target_fingerprint(target, None)}


def prompt_hash(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


class RoundLog:
    """Writes the round log of one evaluation to `path` (replaced if it exists; appended to with append=True).
    `topk`: target top-k per position; `drafter`: the drafter's identity (`drafter_identity`), written in round 0 rows.
    atomic=True (draftlab eval): rows go to `PATH.partial`, which `commit()` renames to `path` once the evaluation is
    complete (`discard()` removes it), so an existing log is replaced only by a whole one.

    `for_prompt(i, prompt_ids)` gives the logger `speculative_generate` calls once per round; it also asks the
    proposer to record draft statistics while that prompt decodes (`drafting.STATS_FLAG`), and only then.
    """

    def __init__(self, path: str | Path, topk: int = DEFAULT_TOPK, append: bool = False, drafter: dict | None = None,
                 atomic: bool = False):
        if topk < 1:
            raise DataError(f"round log top-k {topk}: give at least 1")
        self.final = Path(path)
        self.path = self.final.with_name(self.final.name + ".partial") if atomic and not append else self.final
        self.topk, self.rows, self.drafter = topk, 0, drafter
        self.logged: set[int] = set()       # the prompts with rows in this file (written by this log)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a" if append else "w")

    def commit(self) -> None:
        """The log is complete: close it and (atomic=True) rename it into place."""
        self.close()
        if self.path != self.final:
            import os

            os.replace(self.path, self.final)
            self.path = self.final

    def discard(self) -> None:
        """Close and remove a partial log (atomic=True only)."""
        self.close()
        if self.path != self.final:
            self.path.unlink(missing_ok=True)

    def for_prompt(self, index: int, prompt_ids: Tensor) -> "PromptLog":
        return PromptLog(self, index, prompt_ids.reshape(-1).tolist())

    def write(self, row: Round) -> None:
        data = asdict(row)
        if data["drafter"] is None:       # the optional key only where it says something
            del data["drafter"]
        try:
            self.file.write(json.dumps(data) + "\n")
            self.file.flush()
        except OSError as e:
            self._failed(e)
        self.rows += 1
        self.logged.add(data["prompt"])

    @property
    def prompts(self) -> int:
        """How many prompts this log wrote rows of."""
        return len(self.logged)

    def _failed(self, e: OSError):
        """A full disk names the log and the space left, and removes the partial log (atomic=True)."""
        from draftlab.errors import DiskFullError, free_bytes, human_bytes, is_disk_full

        if not is_disk_full(e):
            raise e
        try:
            self.file.close()
        except OSError:
            pass
        removed = ""
        if self.path != self.final:
            self.path.unlink(missing_ok=True)
            removed = f"; its partial {self.path.name} was removed"
        free = free_bytes(self.final.parent)
        room = f" ({human_bytes(free)} free there now)" if free is not None else ""
        raise DiskFullError(f"no space left on device writing round log {self.final}{room}{removed}: free some space "
                            "and run the command again") from None

    def close(self) -> None:
        if self.file.closed:
            return
        try:
            self.file.close()
        except OSError as e:
            self._failed(e)

    def __enter__(self) -> "RoundLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _set_stats_flag(proposer, on: bool) -> None:
    """Ask a proposer, and the drafter inside a wrapping proposer (`inner`), to record draft statistics."""
    from draftlab.drafting import STATS_FLAG

    while proposer is not None:
        setattr(proposer, STATS_FLAG, on)
        proposer = getattr(proposer, "inner", None)


class PromptLog:
    """The rows of one prompt's decoding (made by `RoundLog.for_prompt`)."""

    def __init__(self, log: RoundLog, index: int, prompt_ids: list[int]):
        self.log, self.index, self.prompt_ids, self.rounds = log, index, prompt_ids, 0
        self.hash = prompt_hash(prompt_ids)

    def begin(self, proposer) -> None:
        _set_stats_flag(proposer, True)

    def end(self, proposer) -> None:
        _set_stats_flag(proposer, False)

    def round(self, context: int, root: int, tree, path: list[int], bonus: int, target_logits: Tensor,
              sampling) -> None:
        """tree: the DraftTree; path, bonus: the verdict; target_logits [N+1, V] of the verification forward."""
        rows = torch.tensor([0] + [c + 1 for c in path], device=target_logits.device)
        top = target_logits[rows].float().log_softmax(-1).topk(min(self.log.topk, target_logits.shape[-1]))
        tokens = tree.tokens.tolist()
        q = None
        if tree.q is not None and tree.proposal != "topk":
            q = tree.q.float().gather(1, tree.tokens.to(tree.q.device)[:, None])[:, 0].tolist()
        stats = tree.draft_stats.float().tolist() if tree.draft_stats is not None else None
        self.log.write(Round(
            version=FORMAT_VERSION, prompt=self.index, round=self.rounds, prompt_hash=self.hash,
            prompt_ids=self.prompt_ids if self.rounds == 0 else None, context=context, root=root, tokens=tokens,
            parents=tree.parents.tolist(), q=q, draft_stats=stats, accepted=list(path), bonus=bonus,
            target_topk_ids=top.indices.tolist(), target_topk_logprobs=top.values.tolist(),
            sampling=sampling.to_dict(), drafter=self.log.drafter if self.rounds == 0 else None))
        self.rounds += 1


# --- reading ---------------------------------------------------------------------------------------------------
_KEYS = [f.name for f in fields(Round)]
_OPTIONAL = ("drafter",)


def _check(row: dict) -> str | None:
    """The first problem with a parsed row, or None."""
    if not isinstance(row, dict):
        return "not a JSON object"
    if row.get("version") != FORMAT_VERSION:
        return (f"format version {row.get('version')!r}, this draftlab reads version {FORMAT_VERSION} "
                "(write the log again with draftlab eval --log-rounds)")
    missing = [k for k in _KEYS if k not in row and k not in _OPTIONAL]
    if missing:
        return f"missing key(s) {', '.join(missing)}"
    unknown = [k for k in row if k not in _KEYS]
    if unknown:
        return f"unknown key(s) {', '.join(unknown)}"
    ints = ("prompt", "round", "context", "root", "bonus")
    if not all(isinstance(row[k], int) and row[k] >= 0 for k in ints):
        return f"{', '.join(ints)} must be integers >= 0"
    n = len(row["tokens"]) if isinstance(row["tokens"], list) else -1
    if n < 0 or not isinstance(row["parents"], list) or len(row["parents"]) != n:
        return "tokens and parents must be lists of the same length"
    if any(not isinstance(p, int) or not -1 <= p < i for i, p in enumerate(row["parents"])):
        return "every parent must be -1 or an earlier node's index"
    if row["round"] == 0 and not isinstance(row["prompt_ids"], list):
        return "round 0 must carry prompt_ids (a list of token ids)"
    path = row["accepted"]
    if not isinstance(path, list) or any(not isinstance(c, int) or not 0 <= c < n for c in path) or any(
            row["parents"][c] != (path[j - 1] if j else -1) for j, c in enumerate(path)):
        return "accepted must be a path of node indices from a child of the root downwards"
    for key, per_node in (("q", 1), ("draft_stats", 3)):
        value = row[key]
        if value is not None and (not isinstance(value, list) or len(value) != n or (
                per_node > 1 and any(not isinstance(v, list) or len(v) != per_node for v in value))):
            return f"{key} must be null or one entry per node" + (f" ({per_node} numbers each)" if per_node > 1 else "")
    ids, logps = row["target_topk_ids"], row["target_topk_logprobs"]
    if not isinstance(ids, list) or not isinstance(logps, list) or len(ids) != len(path) + 1 or len(logps) != len(ids) \
            or any(not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b) or not a
                   for a, b in zip(ids, logps)):
        return "target_topk_ids / target_topk_logprobs need len(accepted) + 1 rows of equal, non-zero length"
    if not isinstance(row["sampling"], dict) or "temperature" not in row["sampling"]:
        return "sampling must be an object with temperature, top_p, top_k"
    if row.get("drafter") is not None and not isinstance(row["drafter"], dict):
        return "drafter must be null or an object (checkpoint, kind, target)"
    return None


def parse_row(line: str, path, number: int) -> Round:
    """One line of a round log -> Round; a bad line is a DataError naming the file and line number."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"round log {path} line {number}: not JSON ({e.msg})") from None
    problem = _check(row)
    if problem:
        raise DataError(f"round log {path} line {number}: {problem}")
    return Round(**row)


def read_rounds(path: str | Path) -> list[Round]:
    """Every row of a round log; a missing or empty file, or a bad row, is a DataError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"round log {path} not found: write one with draftlab eval --log-rounds {path}")
    with open(path) as f:
        rows = [parse_row(line, path, number) for number, line in enumerate(f, 1) if line.strip()]
    if not rows:
        raise DataError(f"round log {path} is empty: write one with draftlab eval --log-rounds {path}")
    return rows


def sequences(rows: list[Round]) -> dict[int, list[int]]:
    """{prompt index: its committed sequence (prompt + emitted tokens)} rebuilt from the rows, in order."""
    seqs: dict[int, list[int]] = {}
    for row in rows:
        if row.round == 0:
            seqs[row.prompt] = list(row.prompt_ids) + [row.root]
        seq = seqs.get(row.prompt)
        if seq is None or len(seq) != row.context:
            raise DataError(f"round log: prompt {row.prompt} round {row.round} starts at context {row.context} but "
                            f"the rows before it give {None if seq is None else len(seq)} tokens: rows missing or "
                            "out of order")
        seq.extend(row.new_tokens)
    return seqs
