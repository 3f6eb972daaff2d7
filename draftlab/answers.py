"""The target answers prompts: black-box training data whose replies come from the target itself.

Rows are appended to a JSONL file as `{"id", "messages": prompt messages + assistant reply, "finish"}`
(`finish` is `eos` when the target ended its turn, `length` when it hit `max_new_tokens`), flushed after each
batch, so an interrupted run resumes where it stopped: ids already in the file are skipped.
"""
from __future__ import annotations

import json
import os
import time

import torch
from tqdm.auto import tqdm

from draftlab.errors import describe_disk_full, is_disk_full
from draftlab.data import DataError, Prompt, encode_prompt
from draftlab.runlock import FolderLock


def read_done_ids(out_path: str) -> set[str]:
    """Ids already answered in `out_path`. A half-written last line (a killed run) is cut off the file.

    A malformed line elsewhere is not ours to repair: it raises DataError and nothing is touched.
    """
    if not os.path.exists(out_path):
        return set()
    with open(out_path, "rb") as f:
        lines = f.read().split(b"\n")  # the last item is what follows the final newline (b"" normally)
    done, pos = set(), 0
    for n, line in enumerate(lines):
        row = _answer_row(line)
        if row is not None:
            done.add(str(row["id"]))
        elif line.strip() and n < len(lines) - 1:
            raise DataError(f"{out_path}:{n + 1}: not an answer row (a JSON object with an id); fix or move "
                            "the file before resuming into it")
        elif line.strip():  # the half-written row of an interrupted run: cut it, it will be answered again
            with open(out_path, "r+b") as f:
                f.truncate(pos)
        pos += len(line) + 1
    if lines[-1].strip() and _answer_row(lines[-1]) is not None:  # complete, but its newline never came
        with open(out_path, "ab") as f:
            f.write(b"\n")
    return done


def _answer_row(line: bytes) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and "id" in row else None


def _stop_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[Prompt], max_new_tokens: int, temperature: float,
                   pad_id: int) -> list[tuple[str, str, int]]:
    """Answer one batch: (reply text, finish, new token count) per prompt, in order."""
    encoded = [encode_prompt(tokenizer, p.messages) for p in prompts]
    width = max(len(e) for e in encoded)
    # Left padding: every prompt ends at the same position, so the new tokens line up after it.
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, e in enumerate(encoded):
        input_ids[b, width - len(e):] = e
        attention_mask[b, width - len(e):] = 1
    device = next(model.parameters()).device
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
    stops, results = _stop_ids(model, tokenizer), []
    for seq in out[:, width:].tolist():
        end = next((i for i, t in enumerate(seq) if t in stops), None)
        tokens = seq if end is None else seq[:end]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        results.append((text, "length" if end is None else "eos", len(tokens)))
    return results


def answer_prompts(model, tokenizer, prompts: list[Prompt], out_path: str, max_new_tokens: int = 256,
                   batch_size: int = 16, temperature: float = 0.0, progress: bool = True) -> dict:
    """Answer every prompt not yet in `out_path`, appending one chat row per prompt; returns counts.

    Greedy by default (temperature 0). Returns {"answered", "skipped", "eos", "length", "seconds"}.
    """
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    lock = FolderLock(out_path + ".lock", f"answers file {out_path}", "wait for that process to finish (or stop "
                      "it), or write the answers to another file")
    with lock:  # one writer: two processes appending to one file would answer every prompt twice
        try:
            return _answer_missing(model, tokenizer, prompts, out_path, max_new_tokens, batch_size, temperature,
                                   progress)
        except OSError as e:
            if not is_disk_full(e):
                raise
            raise DataError(f"{describe_disk_full(e)}: the rows answered so far are kept in {out_path}; free "
                            "space, then run the same command again to answer the rest") from None


def _answer_missing(model, tokenizer, prompts: list[Prompt], out_path: str, max_new_tokens: int, batch_size: int,
                    temperature: float, progress: bool) -> dict:
    done = read_done_ids(out_path)
    todo, seen = [], set(done)
    for p in prompts:  # skip answered ids, and repeats within this prompt list
        if p.id not in seen:
            seen.add(p.id)
            todo.append(p)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    counts = {"answered": 0, "skipped": len(prompts) - len(todo), "eos": 0, "length": 0}
    t0, new_tokens = time.time(), 0
    bar = tqdm(total=len(todo), desc="answering", unit="prompt", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as f:
        for s in range(0, len(todo), batch_size):
            batch = todo[s:s + batch_size]
            for prompt, (text, finish, n) in zip(batch, generate_batch(model, tokenizer, batch, max_new_tokens,
                                                                      temperature, pad_id)):
                row = {"id": prompt.id, "messages": prompt.messages + [{"role": "assistant", "content": text}],
                       "finish": finish}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                counts[finish] += 1
                new_tokens += n
            f.flush()  # a killed run loses at most the batch in flight
            os.fsync(f.fileno())
            counts["answered"] += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.1f}")
    bar.close()
    counts["seconds"] = round(time.time() - t0, 2)
    return counts
