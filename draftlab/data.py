"""Training conversations and prompt sets: reading rows, tokenising with the chat template, batching.

Row formats (JSON lines, a JSON list, either gzipped as `.gz`, or a `datasets` Hub id), each turned into a list of chat messages
`[{"role": "system"|"user"|"assistant", "content": str}, ...]`:
  - chat:            {"messages": [{"role": ..., "content": ...}, ...]}
  - ShareGPT:        {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}
  - prompt/response: {"prompt": ..., "response"|"completion"|"output": ..., "system": optional}
  - plain text:      {"text": ...}: a document the target did not write, placed as one assistant turn so that
                     every token is learned from (fixed-text white-box data: the target only scores it, and its
                     own next-token distributions are the labels; data_prep/fixed_text.py builds such a corpus)
Malformed rows are skipped, counted and reported with their location; `strict=True` stops at the first.
"""
from __future__ import annotations

import gzip
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from draftlab.errors import DataError

ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "chatgpt": "assistant"}
RESPONSE_KEYS = ("response", "completion", "output")


class RowError(ValueError):
    """One malformed row; the message is the reason, the caller adds the location."""


@dataclass
class ReadStats:
    """What `read_conversations` saw: rows read, conversations kept, and each malformed row (where, why)."""
    source: str
    rows: int = 0
    kept: int = 0
    malformed: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        """One line: counts, and the first malformed rows with their locations and reasons."""
        text = f"{self.kept} conversations from {self.rows} rows"
        if self.malformed:
            shown = "; ".join(f"{where}: {why}" for where, why in self.malformed[:3])
            more = f" (+{len(self.malformed) - 3} more)" if len(self.malformed) > 3 else ""
            text += f", {len(self.malformed)} malformed rows skipped ({shown}{more})"
        return text

    def summary(self) -> str:
        return f"{self.source}: {self}"


# ----------------------------------------------------------------------------------------------------------
# reading rows


def iter_rows(source: str, split: str = "train") -> Iterator[tuple[str, object]]:
    """Yield (location, row) from a .jsonl/.json file or a datasets Hub id; an unparsable line gives a RowError."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffixes[-2:] == [".json", ".gz"] or path.suffix == ".json":
            yield from _json_rows(path)
        else:
            yield from _jsonl_rows(path)
        return
    if path.exists():
        raise DataError(f"data source {source} is a folder: pass a .jsonl/.json file or a datasets Hub id")
    if source.endswith((".json", ".jsonl", ".gz")) or source.startswith(("/", ".", "~")):
        raise DataError(f"data file {source} does not exist: check the path")
    try:
        import datasets
        rows = datasets.load_dataset(source, split=split)
    except Exception as e:
        raise DataError(f"cannot load data set {source} (split {split}) from the Hub: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''} (pass a local .jsonl file instead)") from None
    for i, row in enumerate(rows):
        yield f"{source}[{i}]", row


def _not_utf8(e: UnicodeError, raw: bytes = b"") -> RowError:
    byte = f"byte 0x{raw[e.start]:02x} at column {e.start + 1}" if raw else "text that is not UTF-8"
    return RowError(f"not valid UTF-8 ({byte}): save the file as UTF-8")


def _open_bytes(path: Path):
    """The file's bytes, gunzipped when its name ends in .gz (prompt sets are shipped compressed)."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    try:
        yield from _jsonl_lines(path)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable gzip file ({type(e).__name__}: {e}); recompress it or pass "
                        "the .jsonl") from None


def _jsonl_lines(path: Path) -> Iterator[tuple[str, object]]:
    with _open_bytes(path) as f:  # bytes: a line that is not UTF-8 is one bad row, not the end of the file
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield f"{path}:{lineno}", _not_utf8(e, raw)
                continue
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", RowError(f"not valid JSON ({e.msg} at column {e.colno})")


def _json_rows(path: Path) -> Iterator[tuple[str, object]]:
    try:  # bytes that are not UTF-8 become lone surrogates here, and their row a bad row below
        with _open_bytes(path) as f:
            raw = f.read()
        data = json.loads(raw.decode("utf-8-sig", errors="surrogateescape"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); a .json data file must hold one list "
                        "of rows (use .jsonl for one row per line)") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json data file must hold a list of rows, found {type(data).__name__}")
    for i, row in enumerate(data):
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            row = _not_utf8(e)
        yield f"{path}[{i}]", row


def _turn(turn: object, role_key: str, content_key: str) -> dict:
    if not isinstance(turn, dict):
        raise RowError(f"a turn is {type(turn).__name__}, expected an object with {role_key}/{content_key}")
    role, content = turn.get(role_key), turn.get(content_key)
    if role not in ROLES:
        raise RowError(f"unknown {role_key} {role!r} (expected one of {', '.join(ROLES)})")
    if not isinstance(content, str):
        raise RowError(f"turn {content_key} must be a string, found {type(content).__name__}")
    return {"role": ROLES[role], "content": content}


def parse_messages(row: object) -> list[dict]:
    """One row in any supported format -> chat messages; raises RowError with the reason."""
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected a JSON object")
    if "messages" in row:
        turns, keys = row["messages"], ("role", "content")
    elif "conversations" in row:
        turns = row["conversations"]
        first = turns[0] if isinstance(turns, list) and turns else {}
        keys = ("role", "content") if isinstance(first, dict) and "role" in first else ("from", "value")
    elif "prompt" in row:
        response = next((row[k] for k in RESPONSE_KEYS if k in row), None)
        turns = [{"role": "user", "content": row["prompt"]}]
        if response is not None:
            turns.append({"role": "assistant", "content": response})
        if row.get("system"):
            turns.insert(0, {"role": "system", "content": row["system"]})
        keys = ("role", "content")
    elif "text" in row:
        turns, keys = [{"role": "assistant", "content": row["text"]}], ("role", "content")
    else:
        raise RowError("no `messages`, `conversations`, `prompt` or `text` field")
    if not isinstance(turns, list) or not turns:
        raise RowError("the conversation is empty or not a list")
    return [_turn(t, *keys) for t in turns]


def read_conversations(source: str, strict: bool = False, limit: int | None = None,
                       split: str = "train") -> tuple[list[list[dict]], ReadStats]:
    """Read training conversations (each with at least one assistant turn) and the reading stats.

    Malformed rows are skipped and recorded in `stats.malformed`; with `strict=True` the first one raises
    DataError naming file:line. `limit` stops after that many conversations are kept.
    """
    conversations, stats = [], ReadStats(source=str(source))
    for where, row in iter_rows(str(source), split):
        if limit is not None and stats.kept >= limit:
            break
        stats.rows += 1
        try:
            if isinstance(row, RowError):
                raise row
            messages = parse_messages(row)
            if not any(m["role"] == "assistant" for m in messages):
                raise RowError("no assistant turn to learn from (prompt-only row in a training file?)")
        except RowError as e:
            if strict:
                raise DataError(f"{where}: {e} (fix the row, or drop strict mode to skip malformed rows)") from None
            stats.malformed.append((where, str(e)))
            continue
        conversations.append(messages)
        stats.kept += 1
    return conversations, stats


# ----------------------------------------------------------------------------------------------------------
# tokenising


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:
        raise DataError(f"the chat template rejected a conversation: {type(e).__name__}: {e}") from None


def assistant_char_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int, int]]:
    """Where each assistant reply sits in the rendered `text`: (content_start, content_end, turn_end).

    Found by rendering prefixes of the conversation: the text rendered up to the assistant header is where
    its content starts, the text rendered through the reply is where its turn ends. Templates that render an
    earlier turn differently once more turns follow (e.g. reasoning stripped) fall back to searching each
    message's content in order, so a reply quoted in the user turn before it is not mistaken for the reply.
    """
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        content = message["content"]
        turn_end = len(text)
        if message["role"] == "assistant":
            before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
            if text.startswith(before):
                cursor = max(cursor, len(before))
            through = _render(tokenizer, messages[:i + 1])
            if text.startswith(through):
                turn_end = len(through)
        start = text.find(content, cursor, turn_end)
        if start < 0 and content.strip():  # templates that trim the content
            content = content.strip()
            start = text.find(content, cursor, turn_end)
        if start < 0:
            if message["role"] == "assistant":
                raise DataError("an assistant reply does not appear in the rendered chat template text")
            continue  # e.g. a template that replaces or drops the system prompt
        cursor = start + len(content)
        if message["role"] == "assistant":
            spans.append((start, cursor, turn_end))
    return spans


def encode_conversation(tokenizer, messages: list[dict], max_length: int | None) -> dict[str, list[int]]:
    """Tokenise a conversation with the chat template: {input_ids [T], loss_mask [T]}, T <= max_length.

    loss_mask is 1 on the tokens of each assistant reply and on the token that closes the reply (the
    end-of-turn token, e.g. <|im_end|>), 0 on system/user turns and role headers.
    """
    text = _render(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    for start, end, turn_end in assistant_char_spans(tokenizer, messages, text):
        closed = False
        for j, (a, b) in enumerate(offsets):
            if b <= a:
                continue
            if a < end and b > start:
                mask[j] = 1
            elif a >= end and not closed:
                closed = True
                if a < turn_end:  # the first token after the reply, inside its turn: the end-of-turn token
                    mask[j] = 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask}


class ChatDataset(torch.utils.data.Dataset):
    """Conversations tokenised once: item i is {input_ids: list[int], loss_mask: list[int]}.

    Conversations with no assistant token left after truncation (or that the template rejects) are dropped;
    `dropped` counts them by reason, `truncated` counts the kept ones cut at max_length, `summary()` says both.
    `lengths[i]` is the token count of item i (for length bucketing).
    """

    def __init__(self, conversations: list[list[dict]], tokenizer, max_length: int | None):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')} has no chat template: "
                            "training data is tokenised with the target's chat template")
        self.rows: list[dict[str, list[int]]] = []
        self.dropped: Counter = Counter()
        self.truncated, self.max_length = 0, max_length
        for messages in conversations:
            try:
                row = encode_conversation(tokenizer, messages, None)
            except DataError:
                self.dropped["rejected by the chat template"] += 1
                continue
            if not any(row["loss_mask"]):
                self.dropped["no assistant token (empty replies)"] += 1
                continue
            if max_length is not None and len(row["input_ids"]) > max_length:
                row = {k: v[:max_length] for k, v in row.items()}
                if not any(row["loss_mask"]):
                    self.dropped[f"the prompt alone exceeds data.max_length={max_length} tokens"] += 1
                    continue
                self.truncated += 1
            self.rows.append(row)
        self.lengths = [len(r["input_ids"]) for r in self.rows]

    def summary(self) -> str:
        """'' when every conversation was kept whole, else '; N of M conversations dropped (K because ...);
        T cut at data.max_length=L tokens' (appended to the reading stats' line)."""
        text = ""
        if self.dropped:
            total = len(self.rows) + sum(self.dropped.values())
            reasons = ", ".join(f"{n} because {why}" for why, n in self.dropped.most_common())
            text += f"; {sum(self.dropped.values())} of {total} conversations dropped ({reasons})"
        if self.truncated:
            text += f"; {self.truncated} cut at data.max_length={self.max_length} tokens"
        return text

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]


def collate(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest: input_ids, attention_mask, loss_mask, each LongTensor [B, T]."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {k: torch.zeros(len(rows), width, dtype=torch.long) for k in ("input_ids", "attention_mask", "loss_mask")}
    out["input_ids"].fill_(pad_token_id)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        out["input_ids"][b, :n] = torch.tensor(row["input_ids"])
        out["attention_mask"][b, :n] = 1
        out["loss_mask"][b, :n] = torch.tensor(row["loss_mask"])
    return out


class LengthBucketSampler(torch.utils.data.Sampler):
    """Batches of similar length, to waste little compute on padding; for `DataLoader(batch_sampler=...)`.

    Each epoch: shuffle the indices (seeded by seed + epoch), cut them into buckets of
    `batch_size * bucket_batches`, sort each bucket by length, cut it into batches, shuffle the batches.
    """

    def __init__(self, lengths: list[int], batch_size: int, bucket_batches: int = 64, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        self.lengths, self.batch_size, self.bucket = list(lengths), batch_size, batch_size * bucket_batches
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        n = len(self.lengths)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        batches = []
        for s in range(0, n, self.bucket):
            bucket = sorted(order[s:s + self.bucket], key=lambda i: self.lengths[i])
            batches += [bucket[j:j + self.batch_size] for j in range(0, len(bucket), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


# ----------------------------------------------------------------------------------------------------------
# prompt sets


@dataclass
class Prompt:
    """An evaluation / regeneration prompt: messages up to the first user turn (or the whole history when the row
    ends on a user turn); all user turns if given. `prefix`, when set, is text the backends continue as it is
    instead of the chat-templated messages (prompt synthesis: the target writes the user's turn itself)."""
    id: str
    messages: list[dict]
    turns: list[str] | None = None
    category: str | None = None
    prefix: str | None = None


def parse_prompt(row: object, default_id: str) -> Prompt:
    """One prompt row (`messages`, `conversations`, `prompt`, or MT-bench `turns`) -> Prompt; RowError if bad.

    A conversation that ends on a user turn is a prompt with its history (the next reply is the one to write);
    otherwise (an answers file read as prompts) the messages are cut after the first user turn.
    """
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected a JSON object")
    turns = row.get("turns")
    if turns is not None and (not isinstance(turns, list) or not turns
                              or not all(isinstance(t, str) for t in turns)):
        raise RowError("`turns` must be a non-empty list of strings (the user turns)")
    if turns is not None and "messages" not in row and "prompt" not in row:
        messages = [{"role": "user", "content": turns[0]}]
    else:
        messages = parse_messages(row)
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise RowError("no user turn to prompt with")
    row_id = row.get("id", row.get("question_id", default_id))
    category = row.get("category")
    end = len(messages) if messages[-1]["role"] == "user" else first_user + 1
    return Prompt(id=str(row_id), messages=messages[:end], turns=turns,
                  category=str(category) if category is not None else None)


def load_prompts(path: str, limit: int | None = None) -> list[Prompt]:
    """Read a prompt file (.jsonl or .json list); the first malformed row or a repeated id raises DataError."""
    if not os.path.isfile(os.path.expanduser(str(path))):
        what = "is a folder" if os.path.isdir(os.path.expanduser(str(path))) else "does not exist"
        raise DataError(f"prompt file {path} {what}: pass a .jsonl file with `messages` or `prompt` rows")
    prompts, seen = [], set()
    for n, (where, row) in enumerate(iter_rows(str(path))):
        if limit is not None and len(prompts) >= limit:
            break
        try:
            if isinstance(row, RowError):
                raise row
            prompt = parse_prompt(row, default_id=str(n))
            if prompt.id in seen:
                raise RowError(f"id {prompt.id!r} appears twice (ids must be unique)")
        except RowError as e:
            raise DataError(f"{where}: {e}") from None
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise DataError(f"prompt file {path} holds no prompts")
    return prompts


def encode_prompt(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Chat-template the prompt messages with the assistant header appended: LongTensor [P]."""
    enc = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
    return torch.tensor(ids, dtype=torch.long)
