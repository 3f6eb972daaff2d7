"""Packed batches: whole conversations laid end to end in rows of at most N tokens, no padding between them.

A packed row holds documents (conversations) 1..m in order, then right padding up to the batch's longest row.
`doc_ids` [B, T] numbers each row's documents from 1 (0 = padding) and `position_ids` [B, T] restart at 0 in
every document, so a model that reads them (a 4-D block-diagonal causal mask, positions per document) computes
exactly what it computes on each conversation alone. Unpacked batches (`data.collate`) are the case of one
document per row: `doc_ids(batch)` is then the attention mask, and every helper below reduces to the plain
right-padded rules, so packed and unpacked batches go through the same loss code.

Packing (`pack`) is first fit over the given order: a conversation joins the first row with room for it, else it
opens a new row, so rows come out nearly full. With the order a seeded permutation (runtime.Batches), the packing
is fixed by (seed, epoch), so a resumed run sees the same rows.
"""
from __future__ import annotations

import torch
from torch import Tensor


def pack(lengths: list[int], order: list[int], max_tokens: int, window: int = 64) -> list[list[int]]:
    """Dataset indices in `order`, grouped into rows of at most max_tokens tokens by first fit: each conversation
    goes into the first of the `window` newest rows that still has room for it, else it opens a new one (rows stay
    in the order they were opened, conversations in a row in `order`). A conversation longer than max_tokens is refused: data.max_length
    must not exceed train.pack_tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > max_tokens:
            raise ValueError(f"a conversation of {n} tokens does not fit a packed row of {max_tokens}: set "
                             f"train.pack_tokens to at least data.max_length")
        first = max(0, len(rows) - window)     # only the newest rows are searched: linear time on big data
        for r in range(first, len(rows)):
            if n <= room[r]:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_tokens - n)
    return rows


def collate_packed(groups: list[list[dict]], pad_token_id: int) -> dict[str, Tensor]:
    """Packed rows (each a list of dataset rows {input_ids, loss_mask}) -> input_ids, attention_mask, loss_mask,
    doc_ids, position_ids, each LongTensor [B, T] with T the longest packed row."""
    width = max(sum(len(r["input_ids"]) for r in g) for g in groups)
    keys = ("input_ids", "attention_mask", "loss_mask", "doc_ids", "position_ids")
    out = {k: torch.zeros(len(groups), width, dtype=torch.long) for k in keys}
    out["input_ids"].fill_(pad_token_id)
    for b, group in enumerate(groups):
        start = 0
        for d, row in enumerate(group, start=1):
            n = len(row["input_ids"])
            span = slice(start, start + n)
            out["input_ids"][b, span] = torch.tensor(row["input_ids"])
            out["loss_mask"][b, span] = torch.tensor(row["loss_mask"])
            out["attention_mask"][b, span] = 1
            out["doc_ids"][b, span] = d
            out["position_ids"][b, span] = torch.arange(n)
            start += n
    return out


def is_packed(batch: dict) -> bool:
    return "doc_ids" in batch


def doc_ids(batch: dict) -> Tensor:
    """[B, T] long: the document of every position (0 = padding); an unpacked batch has one document per row."""
    return batch["doc_ids"] if "doc_ids" in batch else batch["attention_mask"].long()


def same_doc(docs: Tensor, shift: int) -> Tensor:
    """[B, T - shift] bool: positions t and t + shift are real and in the same document."""
    T = docs.shape[1]
    if shift >= T:
        return torch.zeros(docs.shape[0], 0, dtype=torch.bool, device=docs.device)
    head = docs[:, : T - shift]
    return (head > 0) & (docs[:, shift:] == head)


def positions(valid: Tensor, docs: Tensor) -> Tensor:
    """[B, n] long: the number of valid slots before each slot within its document (so positions restart at 0 in
    every document and left padding inside a document is harmless); valid, docs [B, n]."""
    counts = valid.long().cumsum(-1)
    start = torch.ones_like(docs, dtype=torch.bool)
    start[:, 1:] = docs[:, 1:] != docs[:, :-1]
    before = torch.where(start, counts - valid.long(), torch.zeros_like(counts)).cummax(-1).values
    return (counts - before - 1).clamp(min=0)


def visible(docs: Tensor) -> Tensor:
    """bool [B, 1, T, T]: query t sees key s <= t of its own document (and itself, so no row is empty)."""
    T = docs.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    mask = causal & (docs[:, :, None] == docs[:, None, :]) & (docs[:, None, :] > 0)
    return (mask | torch.eye(T, dtype=torch.bool, device=docs.device))[:, None]


def spans(batch: dict, rows: list) -> list[tuple[int, int, int, int]]:
    """(batch row, start, end, dataset index) of every conversation of a batch; rows as runtime.Batches gives
    them (a dataset index per row, or a list of them per packed row)."""
    docs, out = doc_ids(batch), []
    for b, r in enumerate(rows):
        members = r if isinstance(r, list) else [r]
        counts = torch.bincount(docs[b], minlength=len(members) + 1)[1:].tolist()
        start = 0
        for one, n in zip(members, counts):
            out.append((b, start, start + n, one))
            start += n
    return out


def model_inputs(batch: dict, dtype: torch.dtype) -> dict[str, Tensor]:
    """attention_mask (and position_ids) for a transformers causal LM over the batch: the 2-D padding mask of an
    unpacked batch, or a packed batch's additive block-diagonal causal mask [B, 1, T, T] with positions per
    document."""
    if not is_packed(batch):
        return {"attention_mask": batch["attention_mask"]}
    from draftlab.trees import additive

    return {"attention_mask": additive(visible(batch["doc_ids"]), dtype), "position_ids": batch["position_ids"]}
