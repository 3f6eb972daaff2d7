"""Offline stores: the target runs once over the training conversations and its features (and top-k
log-probabilities) go to disk, so training steps read them instead of running the target.

A store is a folder:
    manifest.json              what it holds and for which target and data (written first, updated per shard)
    shard_00000.safetensors    consecutive dataset rows; tensors:
        rows [R] (dataset indices), offsets [R+1] (token offsets of each row in the shard),
        h{i} [N, d] for every stored hidden-state index i (`output_hidden_states` numbering, normalised to
            0..L so that -1 is stored as L), in the store's dtype (bf16 by default),
        and with topk_logits = k > 0: teacher_topk_ids [N, k] int32, teacher_topk_logprobs [N, k] float32
            (full-vocabulary log-probs, best first), teacher_tail_mass [N] float32 (1 - sum of the top-k probs).
    N = the shard's tokens. A row is never split between shards.

Building is resumable: shards are written to a temporary name and renamed, and the manifest records each
finished shard with its sha256, so an interrupted build keeps what it finished. Opening checks the target
fingerprint, the data (a hash of every row's token ids), the requested layers and the shard sizes; each
shard's checksum is verified the first time a batch reads it (or all at once with `verify_all=True`).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from draftlab.errors import describe_disk_full, is_disk_full
from draftlab.data import DataError
from draftlab.runlock import LOCK_NAME, FolderLock

MANIFEST = "manifest.json"
FORMAT = 1
OTHER_TARGET = "use that target or another store path"


class StoreError(DataError):
    """A feature store that cannot be used (wrong target or data, incomplete, corrupt); one-line message."""


# ----------------------------------------------------------------------------------------------------------
# planning


def _num_layers(target) -> int:
    return int(target.config.get_text_config().num_hidden_layers)


def normalise_layers(layers, num_layers: int) -> list[int]:
    """`output_hidden_states` indices -> 0..L (so -1 and L name the same post-norm state)."""
    out = []
    for i in layers:
        if not -(num_layers + 1) <= int(i) <= num_layers:
            raise StoreError(f"hidden-state index {i} is out of range for a target with {num_layers} layers "
                             f"(valid: 0..{num_layers} or -1)")
        out.append(int(i) % (num_layers + 1))
    return out


def data_hash(dataset, rows: range | None = None) -> str:
    """A hash of every row's token ids (of `rows`, default all), in order: equal only for the same tokenised data."""
    h = hashlib.sha256()
    for i in rows if rows is not None else range(len(dataset)):
        ids = np.asarray(dataset[i]["input_ids"], dtype=np.int64)
        h.update(len(ids).to_bytes(8, "little"))
        h.update(ids.tobytes())
    return h.hexdigest()[:24]


def _plan_shards(lengths: list[int], shard_tokens: int) -> list[dict]:
    """Consecutive row ranges of about shard_tokens tokens each (a row is never split)."""
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        tokens += n
        if tokens >= shard_tokens or i == len(lengths) - 1:
            shards.append({"file": f"shard_{len(shards):05d}.safetensors", "rows": [start, i + 1], "tokens": tokens,
                           "sha256": None, "bytes": None})
            start, tokens = i + 1, 0
    return shards


def bytes_per_token(num_layers: int, hidden_size: int, dtype: torch.dtype, topk_logits: int) -> int:
    feats = num_layers * hidden_size * torch.finfo(dtype).bits // 8
    return feats + (topk_logits * 8 + 4 if topk_logits > 0 else 0)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _read_manifest(path: Path) -> dict | None:
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{file} is corrupt ({e.msg} at line {e.lineno}): remove the store folder to rebuild it") \
            from None


# ----------------------------------------------------------------------------------------------------------
# building


def build_store(path, target, tokenizer, dataset, feature_layers, topk_logits: int = 0,
                dtype: torch.dtype = torch.bfloat16, batch_size: int = 8, shard_tokens: int = 65536,
                progress: bool = True) -> "Store":
    """Run the target over every dataset row (a `ChatDataset`: rows with input_ids) and write the store at
    `path`; resumes an interrupted build of the same plan. Returns the opened Store."""
    from draftlab.target import target_fingerprint

    path = Path(path)
    num_layers = _num_layers(target)
    layers = sorted(set(normalise_layers(feature_layers, num_layers)))
    lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    if not lengths:
        raise StoreError(f"cannot build the store {path}: the data set has no rows")
    hidden = int(target.config.get_text_config().hidden_size)
    plan = {"format": FORMAT, "target": target_fingerprint(target, tokenizer), "layers": layers,
            "hidden_size": hidden, "dtype": str(dtype).removeprefix("torch."), "topk_logits": int(topk_logits),
            "rows": len(lengths), "tokens": sum(lengths), "data_hash": data_hash(dataset),
            "bytes_per_token": bytes_per_token(len(layers), hidden, dtype, topk_logits),
            "shard_tokens": int(shard_tokens), "shards": _plan_shards(lengths, shard_tokens), "complete": False}
    lock, manifest = store_lock(path).acquire(), plan  # one builder at a time: a second one is refused
    try:
        manifest = _read_manifest(path)
        if manifest is None:
            path.mkdir(parents=True, exist_ok=True)
            manifest = plan
            _write_json(path / MANIFEST, manifest)
        else:
            _check_same_plan(path, manifest, plan)
        for tmp in path.glob("*.tmp"):                    # a shard or manifest cut off by the interruption
            tmp.unlink()

        done = [s for s in manifest["shards"] if s["sha256"] and _shard_intact(path, s)]
        todo = [i for i, s in enumerate(manifest["shards"]) if s not in done]
        print(f"feature store {path}: {plan['rows']} conversations, {plan['tokens']} tokens x "
              f"{plan['bytes_per_token']} bytes = {_human(plan['tokens'] * plan['bytes_per_token'])} on disk"
              + (f" ({len(done)} of {len(manifest['shards'])} shards already written)" if done else ""), flush=True)
        bar = tqdm(total=plan["tokens"], initial=sum(s["tokens"] for s in done), unit="tok", desc="features",
                   disable=not progress, dynamic_ncols=True)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        for i in todo:
            shard = manifest["shards"][i]
            tensors = _shard_tensors(target, dataset, range(*shard["rows"]), layers, topk_logits, dtype, batch_size,
                                     pad, bar)
            file = path / shard["file"]
            _write_shard(tensors, file)
            shard["sha256"], shard["bytes"] = _sha256(file), file.stat().st_size
            _write_json(path / MANIFEST, manifest)
        bar.close()
        manifest["complete"] = True
        _write_json(path / MANIFEST, manifest)
    except OSError as e:
        if not is_disk_full(e):
            raise
        for tmp in path.glob("*.tmp"):  # the cut-off shard: its space goes back, finished shards stay
            tmp.unlink(missing_ok=True)
        finished = sum(1 for s in manifest["shards"] if s["sha256"])
        left = sum(s["tokens"] for s in manifest["shards"] if not s["sha256"]) * plan["bytes_per_token"]
        raise StoreError(f"{describe_disk_full(e)} (feature store {path} needs about {_human(left)} more; its "
                         f"{finished} finished shards are kept): free space, then run the same build again to "
                         "resume it") from None
    finally:
        lock.release()
    return open_store(path, target, tokenizer=tokenizer, dataset=dataset, feature_layers=feature_layers,
                      topk_logits=topk_logits)


def join_stores(path, parts, dataset) -> dict:
    """Write the store of `dataset` at `path` from finished stores of its consecutive parts (`parts`: store folders
    in the order their rows appear in `dataset`), without running the target: the new manifest lists the parts'
    shards end to end, and each shard is a hard link to the part's file (a copy across file systems). So a data set
    that grows by new conversations needs features only for the new ones. Each part must hold exactly its rows of
    `dataset` (checked by hash) and all parts the same target, layers, dtype and top-k. Returns the manifest;
    refuses an existing `path` (nothing is overwritten)."""
    path = Path(path)
    if path.exists():
        raise StoreError(f"{path} already exists: choose a new folder for the joined store (nothing was overwritten)")
    if not parts:
        raise StoreError("join_stores: give at least one store to join")
    manifests, start = [], 0
    for part in map(Path, parts):
        m = _read_manifest(part)
        if m is None or not m.get("complete"):
            raise StoreError(f"{part} is not a finished feature store ({MANIFEST} missing or the build unfinished): "
                             "finish it with data_prep/dump_features.py first")
        first = manifests[0][1] if manifests else m
        for key in ("format", "target", "layers", "hidden_size", "dtype", "topk_logits", "bytes_per_token"):
            if m.get(key) != first.get(key):
                raise StoreError(f"{part} has {key}={m.get(key)} but {manifests[0][0]} has {first.get(key)}: "
                                 "only stores of the same target, layers, dtype and top-k can be joined")
        rows = range(start, start + m["rows"])
        if rows.stop > len(dataset) or data_hash(dataset, rows) != m["data_hash"]:
            raise StoreError(f"{part} holds {m['rows']} rows that are not rows {rows.start}..{rows.stop - 1} of the "
                             f"joined data ({len(dataset)} rows): give the stores in the order of their data, with "
                             "the same data.max_length")
        for shard in m["shards"]:
            if not _shard_intact(part, shard):
                raise StoreError(f"shard {part / shard['file']} is missing or truncated: rebuild that store")
        manifests.append((part, m))
        start = rows.stop
    if start != len(dataset):
        raise StoreError(f"the stores hold {start} rows but the joined data has {len(dataset)}: every row needs "
                         "a store")
    first = manifests[0][1]
    joined = {**{k: first[k] for k in ("format", "target", "layers", "hidden_size", "dtype", "topk_logits",
                                       "bytes_per_token", "shard_tokens")},
              "rows": len(dataset), "tokens": sum(m["tokens"] for _, m in manifests),
              "data_hash": data_hash(dataset), "shards": [], "complete": False,
              "joined_from": [{"path": str(part.resolve()), "rows": m["rows"], "data_hash": m["data_hash"]}
                              for part, m in manifests]}
    path.mkdir(parents=True)
    offset = 0
    for part, m in manifests:
        for shard in m["shards"]:
            file = f"shard_{len(joined['shards']):05d}.safetensors"
            try:
                os.link(part / shard["file"], path / file)
            except OSError:                               # another file system: a copy
                shutil.copyfile(part / shard["file"], path / file)
            joined["shards"].append({**shard, "file": file,
                                     "rows": [shard["rows"][0] + offset, shard["rows"][1] + offset]})
        offset += m["rows"]
    joined["complete"] = True
    _write_json(path / MANIFEST, joined)
    return joined


def store_lock(path: Path) -> FolderLock:
    return FolderLock(path / LOCK_NAME, f"feature store {path}", "wait for that build to finish (or stop it), or "
                      "choose another store path")


def _check_same_plan(path: Path, old: dict, new: dict) -> None:
    """An existing (possibly partial) store must have been started with the same settings to be resumed."""
    for key in ("format", "layers", "hidden_size", "dtype", "topk_logits", "data_hash", "shard_tokens"):
        if old.get(key) != new[key]:
            raise StoreError(f"the store at {path} was started with {key}={old.get(key)} but this build asks for "
                             f"{key}={new[key]}: remove that folder or choose another store path (nothing was "
                             "overwritten)")
    from draftlab.target import check_fingerprint

    check_fingerprint(old.get("target", {}), new["target"], f"the store at {path}", OTHER_TARGET, StoreError)


def _shard_intact(path: Path, shard: dict) -> bool:
    file = path / shard["file"]
    return file.is_file() and file.stat().st_size == shard["bytes"]


@torch.no_grad()
def _shard_tensors(target, dataset, rows: range, layers: list[int], topk: int, dtype: torch.dtype,
                   batch_size: int, pad: int, bar) -> dict[str, torch.Tensor]:
    """Run the target over `rows` (batched by length, to pad little) and gather the shard's tensors."""
    from draftlab.data import collate

    per_row: dict[int, dict[str, torch.Tensor]] = {}
    order = sorted(rows, key=lambda r: len(dataset[r]["input_ids"]))
    device = next(target.parameters()).device
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batch = collate([dataset[r] for r in chunk], pad)
        out = target.base_model(input_ids=batch["input_ids"].to(device),
                                attention_mask=batch["attention_mask"].to(device), output_hidden_states=True)
        found = {f"h{i}": out.hidden_states[i] for i in layers}
        if topk > 0:
            logits = target.get_output_embeddings()(out.hidden_states[-1]).float()
            top = logits.log_softmax(-1).topk(topk, dim=-1)
            found["teacher_topk_ids"] = top.indices.int()
            found["teacher_topk_logprobs"] = top.values
            found["teacher_tail_mass"] = (1.0 - top.values.exp().sum(-1)).clamp(min=0.0)
        for b, r in enumerate(chunk):
            n = int(batch["attention_mask"][b].sum())
            per_row[r] = {k: (v[b, :n].to(dtype) if k.startswith("h") else v[b, :n]).cpu() for k, v in found.items()}
            per_row[r]["length"] = n
        bar.update(int(batch["attention_mask"].sum()))
    rows = list(rows)
    lengths = torch.tensor([per_row[r].pop("length") for r in rows])
    tensors = {k: torch.cat([per_row[r][k] for r in rows]).contiguous() for k in per_row[rows[0]]}
    tensors["rows"] = torch.tensor(rows, dtype=torch.int64)
    tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return tensors


def _write_shard(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Write atomically: a shard file either is complete or does not exist."""
    from safetensors.torch import save_file

    tmp = file.with_name(file.name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, file)


# ----------------------------------------------------------------------------------------------------------
# opening and reading


def open_store(path, target, *, tokenizer=None, dataset=None, feature_layers=None, topk_logits: int = 0,
               verify_all: bool = False) -> "Store":
    """Open a complete store for `target` (and `dataset`, checked by hash when given). feature_layers: the
    hidden-state indices `batch` returns, concatenated in that order (None = all stored ones)."""
    from draftlab.target import check_fingerprint, target_fingerprint

    path = Path(path)
    manifest = _read_manifest(path)
    if manifest is None:
        raise StoreError(f"no feature store at {path} ({MANIFEST} is missing): build it with "
                         "data_prep/dump_features.py, or let training build it (data.store=PATH)")
    if manifest.get("format") != FORMAT:
        raise StoreError(f"the store at {path} has format {manifest.get('format')}, this draftlab reads {FORMAT}: "
                         "rebuild it")
    if not manifest.get("complete"):
        finished = sum(1 for s in manifest["shards"] if s["sha256"])
        raise StoreError(f"the store at {path} is incomplete ({finished} of {len(manifest['shards'])} shards): "
                         "run the same build again to resume it")
    check_fingerprint(manifest["target"], target_fingerprint(target, tokenizer), f"the store at {path}", OTHER_TARGET,
                      StoreError)
    if dataset is not None and data_hash(dataset) != manifest["data_hash"]:
        raise StoreError(f"the store at {path} was built from other training data (different conversations, "
                         "tokenizer or data.max_length): point data.store at a new folder to rebuild it")
    num_layers = manifest["target"]["num_hidden_layers"]
    layers = manifest["layers"] if feature_layers is None else normalise_layers(feature_layers, num_layers)
    missing = [i for i in layers if i not in manifest["layers"]]
    if missing:
        raise StoreError(f"the store at {path} holds hidden states {manifest['layers']} but {missing} are needed: "
                         "point data.store at a new folder for this drafter")
    if topk_logits > manifest["topk_logits"]:
        raise StoreError(f"the store at {path} holds the target's top-{manifest['topk_logits']} log-probs but "
                         f"top-{topk_logits} are needed: point data.store at a new folder")
    for shard in manifest["shards"]:
        if not _shard_intact(path, shard):
            raise StoreError(f"shard {path / shard['file']} is missing or truncated: remove the store folder to "
                             "rebuild it")
    store = Store(path, manifest, layers, topk_logits)
    if verify_all:
        for i in range(len(manifest["shards"])):
            store._verify(i)
    return store


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "U8": torch.uint8, "BOOL": torch.bool}


class ShardReader:
    """Row ranges of a safetensors file's tensors, read with plain positioned reads (`get_slice(name)[a:b]`).
    A memory map (safetensors' safe_open) keeps every page a training epoch touched resident, so a run's peak
    memory grew by the whole store; here each batch's rows live only as long as the batch."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        size = int.from_bytes(os.pread(self.fd, 8, 0), "little")
        self.header = {k: v for k, v in json.loads(os.pread(self.fd, size, 8)).items() if k != "__metadata__"}
        self.start = 8 + size

    def get_slice(self, name: str) -> "_Rows":
        return _Rows(self, self.header[name])

    def close(self) -> None:
        os.close(self.fd)


class _Rows:
    def __init__(self, reader: ShardReader, info: dict):
        self.reader, self.dtype, self.shape = reader, _SAFETENSORS_DTYPES[info["dtype"]], info["shape"]
        self.offset = reader.start + info["data_offsets"][0]
        self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize

    def __getitem__(self, rows: slice) -> torch.Tensor:
        a, b, _ = rows.indices(self.shape[0])
        data = bytearray(os.pread(self.reader.fd, (b - a) * self.row_bytes, self.offset + a * self.row_bytes))
        return torch.frombuffer(data, dtype=self.dtype).reshape(b - a, *self.shape[1:]) if data else \
            torch.zeros(0, *self.shape[1:], dtype=self.dtype)


class Store:
    """Read access to an opened store. `batch(rows, length)` gives right-padded tensors for dataset rows."""

    def __init__(self, path: Path, manifest: dict, layers: list[int], topk_logits: int, max_open: int = 32):
        self.path, self.manifest, self.layers, self.topk = path, manifest, layers, topk_logits
        self.hidden_size = manifest["hidden_size"]
        self._starts = [s["rows"][0] for s in manifest["shards"]]
        self._open: OrderedDict[int, tuple] = OrderedDict()      # shard -> (ShardReader, offsets), LRU
        self._verified: set[int] = set()
        self.max_open = max_open

    @property
    def feature_size(self) -> int:
        return len(self.layers) * self.hidden_size

    def _verify(self, shard: int) -> None:
        if shard in self._verified:
            return
        entry = self.manifest["shards"][shard]
        if _sha256(self.path / entry["file"]) != entry["sha256"]:
            raise StoreError(f"shard {self.path / entry['file']} is corrupt (checksum mismatch): remove the store "
                             "folder to rebuild it")
        self._verified.add(shard)

    def _shard(self, shard: int) -> tuple:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        self._verify(shard)
        handle = ShardReader(self.path / self.manifest["shards"][shard]["file"])
        self._open[shard] = (handle, handle.get_slice("offsets")[:].tolist())
        if len(self._open) > self.max_open:
            self._open.popitem(last=False)[1][0].close()
        return self._open[shard]

    def row(self, row: int) -> dict[str, torch.Tensor]:
        """One dataset row: features [n, F] float32 (when layers) + teacher tensors [n, k] / [n] (when topk > 0)."""
        shard = bisect.bisect_right(self._starts, row) - 1
        entry = self.manifest["shards"][shard] if shard >= 0 else None
        if entry is None or not entry["rows"][0] <= row < entry["rows"][1]:
            raise StoreError(f"row {row} is not in the store at {self.path} ({self.manifest['rows']} rows)")
        handle, offsets = self._shard(shard)
        a, b = offsets[row - entry["rows"][0]], offsets[row - entry["rows"][0] + 1]
        out = {}
        if self.layers:
            out["features"] = torch.cat([handle.get_slice(f"h{i}")[a:b].float() for i in self.layers], dim=-1)
        if self.topk > 0:
            ids, logprobs = handle.get_slice("teacher_topk_ids")[a:b], handle.get_slice("teacher_topk_logprobs")[a:b]
            dropped = logprobs[:, self.topk:].exp().sum(-1)         # a smaller k than stored: fold into the tail
            out["teacher_topk_ids"] = ids[:, :self.topk].long()
            out["teacher_topk_logprobs"] = logprobs[:, :self.topk].float()
            out["teacher_tail_mass"] = handle.get_slice("teacher_tail_mass")[a:b].float() + dropped
        return out

    def batch(self, rows: list[int], length: int) -> dict[str, torch.Tensor]:
        """Right-padded tensors for dataset rows (as `data.collate` pads; an item that is a list of rows is a packed
        row, as `packing.collate_packed` lays it out): features [B, length, F] float32 (when
        the store was opened with layers) and,
        when topk > 0, teacher_topk_ids [B, length, k] long, teacher_topk_logprobs [B, length, k] float32,
        teacher_tail_mass [B, length] float32. Padding positions hold a harmless uniform top-k distribution."""
        B, k = len(rows), self.topk
        out = {"features": torch.zeros(B, length, self.feature_size)} if self.layers else {}
        if k > 0:
            out["teacher_topk_ids"] = torch.arange(k).expand(B, length, k).clone()
            out["teacher_topk_logprobs"] = torch.full((B, length, k), -float(np.log(k)))
            out["teacher_tail_mass"] = torch.zeros(B, length)
        for b, r in enumerate(rows):
            start = 0
            for one in (r if isinstance(r, list) else [r]):   # a packed row: its conversations end to end
                found = self.row(one)
                n = min(len(next(iter(found.values()))), length - start)
                for key, value in found.items():
                    out[key][b, start:start + n] = value[:n]
                start += n
        return out


def ensure_store(path, target, tokenizer, dataset, feature_layers, topk_logits: int = 0, accelerator=None,
                 **build_kwargs) -> Store:
    """Open the store at `path`, building it first when missing or unfinished (resumable). Under several
    processes the main one builds while the others wait; all then open it."""
    path = Path(path)
    main = accelerator is None or accelerator.is_main_process
    if main:
        manifest = _read_manifest(path)
        if manifest is None or not manifest.get("complete"):
            build_store(path, target, tokenizer, dataset, feature_layers, topk_logits, **build_kwargs)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return open_store(path, target, tokenizer=tokenizer, dataset=dataset, feature_layers=feature_layers,
                      topk_logits=topk_logits)
