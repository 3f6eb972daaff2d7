"""The target answers prompts: black-box training data whose replies come from the target itself.

One loop for every answering backend (`draftlab.engines`: transformers, llama_cpp, openai). Rows are appended
to a JSONL file as `{"id", "messages": prompt messages + assistant reply, "finish", "backend", "model_sha256",
"chat_template", "sampling"}` (`finish` is `eos` when the target ended its turn, `length` when it hit
`max_new_tokens`), written and synced as each group of answers arrives, so an interrupted run resumes where it
stopped: ids already in the file are skipped. A prompt asked again under another id (same messages) is answered
once; its other ids get copies of that row, marked `copy_of`.
"""
from __future__ import annotations

import json
import os
import time

from tqdm.auto import tqdm

from draftlab.data import DataError, Prompt
from draftlab.engines import ServerError, TransformersBackend
from draftlab.errors import describe_disk_full, is_disk_full
from draftlab.runlock import FolderLock


def read_done_ids(out_path: str) -> set[str]:
    """Ids already answered in `out_path` (see `read_done`)."""
    return set(read_done(out_path)[0])


def prompt_key(messages: list[dict]) -> str:
    """What makes two prompts the same prompt: their messages (roles and contents), whatever their ids."""
    return json.dumps([[m.get("role"), m.get("content")] for m in messages], ensure_ascii=False)


def read_done(out_path: str) -> tuple[set[str], dict[str, dict]]:
    """Ids already answered in `out_path`, and each answered prompt's row by `prompt_key`. A half-written last line
    (a killed run) is cut off the file.

    A malformed line elsewhere is not ours to repair: it raises DataError and nothing is touched.
    """
    if not os.path.exists(out_path):
        return set(), {}
    with open(out_path, "rb") as f:
        lines = f.read().split(b"\n")  # the last item is what follows the final newline (b"" normally)
    done, by_key, pos = set(), {}, 0
    for n, line in enumerate(lines):
        row = _answer_row(line)
        if row is not None:
            done.add(str(row["id"]))
            if isinstance(row.get("messages"), list) and row["messages"]:
                by_key.setdefault(prompt_key(row["messages"][:-1]), row)
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
    return done, by_key


def _answer_row(line: bytes) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and "id" in row else None


def answer_prompts(model, tokenizer, prompts: list[Prompt], out_path: str, max_new_tokens: int = 256,
                   batch_size: int = 16, temperature: float = 0.0, progress: bool = True,
                   model_file: str | None = None) -> dict:
    """The transformers backend (the reference) answering every prompt not yet in `out_path`; see `answer_with`."""
    backend = TransformersBackend(model, tokenizer, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                  temperature=temperature, model_file=model_file)
    return answer_with(backend, prompts, out_path, progress=progress)


def answer_with(backend, prompts: list[Prompt], out_path: str, progress: bool = True) -> dict:
    """Answer every prompt not yet in `out_path` with `backend` (`draftlab.engines`), appending one chat row per
    prompt; returns {"answered", "skipped", "duplicates", "eos", "length", "new_tokens", "seconds"}.

    `answered` counts rows written, `duplicates` those of them copied from an earlier answer to the same messages,
    `skipped` ids already in the file (or repeated in `prompts`).
    """
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    lock = FolderLock(out_path + ".lock", f"answers file {out_path}", "wait for that process to finish (or stop "
                      "it), or write the answers to another file")
    with lock:  # one writer: two processes appending to one file would answer every prompt twice
        try:
            return _answer_missing(backend, prompts, out_path, progress)
        except OSError as e:
            if not is_disk_full(e):
                raise
            raise DataError(f"{describe_disk_full(e)}: the rows answered so far are kept in {out_path}; free "
                            "space, then run the same command again to answer the rest") from None


def _answer_missing(backend, prompts: list[Prompt], out_path: str, progress: bool) -> dict:
    done, answered = read_done(out_path)
    todo, repeats, copies, seen = [], {}, [], set(done)
    for p in prompts:  # skip answered ids; a prompt asked again under another id is answered once and copied
        if p.id in seen:
            continue
        seen.add(p.id)
        key = prompt_key(p.messages)
        if key in answered:
            copies.append((p, answered[key]))
        elif key in repeats:
            repeats[key].append(p)
        else:
            repeats[key] = []
            todo.append(p)
    meta = backend.describe()
    counts = {"answered": 0, "skipped": len(prompts) - len(seen - done), "duplicates": 0, "eos": 0, "length": 0,
              "new_tokens": 0}
    t0 = time.time()
    bar = tqdm(total=len(todo), desc=f"answering ({backend.name})", unit="prompt", disable=not progress)

    def write(f, prompt: Prompt, row: dict, copy_of: str | None = None) -> None:
        row = {**row, "id": prompt.id, "messages": prompt.messages + row["messages"][-1:]}
        if copy_of is not None:
            row["copy_of"] = copy_of
            counts["duplicates"] += 1
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
        counts["answered"] += 1
        counts[row["finish"]] = counts.get(row["finish"], 0) + 1

    try:
        with open(out_path, "a", encoding="utf-8") as f:
            for p, row in copies:
                write(f, p, row, copy_of=str(row["id"]))
            for group in backend.stream(todo):
                for a in group:
                    row = {"id": a.prompt.id, "messages": [{"role": "assistant", "content": a.text}],
                           "finish": a.finish, **meta}
                    write(f, a.prompt, row)
                    for p in repeats[prompt_key(a.prompt.messages)]:
                        write(f, p, row, copy_of=a.prompt.id)
                    counts["new_tokens"] += a.new_tokens
                f.flush()  # a killed run loses at most the group in flight
                os.fsync(f.fileno())
                bar.update(len(group))
                bar.set_postfix(tok_s=f"{counts['new_tokens'] / max(time.time() - t0, 1e-9):.1f}")
    except ServerError as e:
        raise ServerError(f"{e}: the {counts['answered']} rows answered in this run are kept in {out_path}; restart "
                          "the server (or fix --server-url), then run the same command again to answer the rest") \
            from None
    finally:
        bar.close()
    counts["seconds"] = round(time.time() - t0, 2)
    return counts
