"""Offline feature stores: same features / teacher log-probs / loss as online, resume after an interruption,
refusal of another target's store, other data, corrupt or truncated shards; ensure_store builds once."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftlab import store as store_mod
from draftlab.data import ChatDataset, DataError, collate, read_conversations
from draftlab.store import StoreError, build_store, ensure_store, open_store
from draftlab.target import target_features

LAYERS = (1, -1)


@pytest.fixture(scope="module")
def dataset(tiny_target, tiny_chat_file):
    conversations, _ = read_conversations(tiny_chat_file)
    return ChatDataset(conversations[:24], tiny_target[1], 160)


@pytest.fixture(scope="module")
def built(tiny_target, dataset, tmp_path_factory):
    """A float32 store with two layers and the top-5 log-probs, in several shards."""
    model, tok = tiny_target
    path = tmp_path_factory.mktemp("stores") / "store"
    store = build_store(path, model, tok, dataset, LAYERS, topk_logits=5, dtype=torch.float32, batch_size=5,
                        shard_tokens=200, progress=False)
    return path, store


def _online(model, dataset, rows):
    batch = collate([dataset[r] for r in rows], 0)
    with torch.no_grad():
        out = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               output_hidden_states=True)
    return batch, out


def test_store_matches_a_target_forward(built, tiny_target, dataset):
    model, _ = tiny_target
    path, store = built
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 2
    assert manifest["tokens"] == sum(dataset.lengths) and manifest["rows"] == len(dataset)
    assert manifest["layers"] == [1, 2] and manifest["target"]["hidden_size"] == model.config.hidden_size
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])

    rows = [7, 0, 23, 12]                                   # across shards, out of order
    batch, out = _online(model, dataset, rows)
    T = batch["input_ids"].shape[1]
    extra = store.batch(rows, T)
    mask = batch["attention_mask"].bool()
    online = target_features(out.hidden_states, LAYERS)
    assert extra["features"].shape == online.shape and extra["features"].dtype == torch.float32
    torch.testing.assert_close(extra["features"][mask], online[mask], atol=1e-5, rtol=1e-4)
    assert (extra["features"][~mask] == 0).all()

    logp = model.get_output_embeddings()(out.hidden_states[-1]).float().log_softmax(-1)
    top = logp.topk(5, dim=-1)
    assert torch.equal(extra["teacher_topk_ids"][mask], top.indices[mask])
    torch.testing.assert_close(extra["teacher_topk_logprobs"][mask], top.values[mask], atol=1e-5, rtol=1e-4)
    tail = 1 - top.values.exp().sum(-1)
    torch.testing.assert_close(extra["teacher_tail_mass"][mask], tail[mask], atol=1e-5, rtol=1e-4)

    # A smaller k folds the dropped tokens into the tail; one layer alone; the store's own layer order.
    small = open_store(path, model, feature_layers=(-1,), topk_logits=2).batch(rows, T)
    torch.testing.assert_close(small["features"][mask], out.hidden_states[-1][mask], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(small["teacher_tail_mass"][mask], (1 - top.values[..., :2].exp().sum(-1))[mask],
                               atol=1e-5, rtol=1e-4)
    assert "teacher_topk_ids" not in open_store(path, model).batch(rows, T)


def test_online_and_offline_losses_agree(built, tiny_target, dataset):
    """The EAGLE head's loss on a batch is the same whether the features come from the target or the store."""
    from draftlab.drafters.eagle import EagleHead
    from draftlab.train import features_for

    model, tok = tiny_target
    path, _ = built
    torch.manual_seed(0)
    head = EagleHead.from_target(model, None).eval()      # eval: no feature noise
    rows = [3, 17, 9, 20]
    batch = collate([dataset[r] for r in rows], tok.pad_token_id)
    online = features_for(model, batch, rows, (-1,), None)
    offline = open_store(path, model, feature_layers=(-1,)).batch(rows, batch["input_ids"].shape[1])["features"]
    loss_on, _ = head.loss(batch, online)
    loss_off, _ = head.loss(batch, offline)
    assert loss_off.item() == pytest.approx(loss_on.item(), rel=1e-4)

    # A bf16 store (the default) agrees within bf16 precision.
    bf16 = build_store(path.parent / "bf16", model, tok, dataset, (-1,), dtype=torch.bfloat16, progress=False)
    loss_bf16, _ = head.loss(batch, bf16.batch(rows, batch["input_ids"].shape[1])["features"])
    assert loss_bf16.item() == pytest.approx(loss_on.item(), rel=2e-2)


def test_resume_after_interruption(tiny_target, dataset, built, tmp_path, monkeypatch, capsys):
    model, tok = tiny_target
    reference, _ = built
    path = tmp_path / "store"
    real_write, calls = store_mod._write_shard, []

    def dies_on_third_shard(tensors, file):
        calls.append(file.name)
        if len(calls) == 3:
            file.with_name(file.name + ".tmp").write_bytes(b"half a shard")   # what a kill leaves behind
            raise KeyboardInterrupt
        real_write(tensors, file)

    monkeypatch.setattr(store_mod, "_write_shard", dies_on_third_shard)
    with pytest.raises(KeyboardInterrupt):
        build_store(path, model, tok, dataset, LAYERS, topk_logits=5, dtype=torch.float32, batch_size=5,
                    shard_tokens=200, progress=False)
    assert "bytes" in capsys.readouterr().out                # the disk estimate comes first
    with pytest.raises(StoreError, match="incomplete"):
        open_store(path, model)
    kept = {f.name: f.stat().st_mtime_ns for f in path.glob("shard_*.safetensors")}
    assert len(kept) == 2

    monkeypatch.setattr(store_mod, "_write_shard", real_write)
    build_store(path, model, tok, dataset, LAYERS, topk_logits=5, dtype=torch.float32, batch_size=5,
                shard_tokens=200, progress=False)
    assert "2 of" in capsys.readouterr().out
    assert {f.name: f.stat().st_mtime_ns for f in path.glob("shard_*.safetensors") if f.name in kept} == kept
    assert not list(path.glob("*.tmp"))
    ours, theirs = (json.loads((p / "manifest.json").read_text())["shards"] for p in (path, reference))
    assert [s["sha256"] for s in ours] == [s["sha256"] for s in theirs]

    # Resuming with other settings is refused, and nothing is touched.
    with pytest.raises(StoreError, match="topk_logits"):
        build_store(path, model, tok, dataset, LAYERS, topk_logits=3, dtype=torch.float32, shard_tokens=200,
                    progress=False)


def test_another_target_or_other_data_is_refused(built, tiny_tokenizer, dataset):
    from conftest import build_tiny_llama

    path, _ = built
    other = build_tiny_llama(tiny_tokenizer, layers=3)
    with pytest.raises(StoreError, match="another target.*num_hidden_layers"):
        open_store(path, other)
    same_shape = build_tiny_llama(tiny_tokenizer, seed=1)    # same sizes: the fingerprint cannot tell them apart
    open_store(path, same_shape)
    fewer = ChatDataset([], tiny_tokenizer, 160)
    fewer.rows, fewer.lengths = dataset.rows[:-1], dataset.lengths[:-1]
    with pytest.raises(StoreError, match="other training data"):
        open_store(path, same_shape, dataset=fewer)
    with pytest.raises(StoreError, match=r"holds hidden states \[1, 2\] but \[0\]"):
        open_store(path, same_shape, feature_layers=(0,))
    assert issubclass(StoreError, DataError)                 # the CLI prints it as one line


def test_corrupt_or_truncated_shard_is_refused(built, tiny_target, tmp_path):
    import shutil

    model, _ = tiny_target
    path = tmp_path / "copy"
    shutil.copytree(built[0], path)
    shard = path / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF                                         # same size, one flipped byte in the tensor data
    shard.write_bytes(bytes(data))
    store = open_store(path, model)                           # sizes are fine: checked lazily
    manifest = json.loads((path / "manifest.json").read_text())
    first, last = manifest["shards"][1]["rows"]
    store.batch([0], 64)                                      # shard 0 is intact
    with pytest.raises(StoreError, match="shard_00001.safetensors is corrupt"):
        store.batch([first], 64)
    with pytest.raises(StoreError, match="corrupt"):
        open_store(path, model, verify_all=True)
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(StoreError, match="missing or truncated"):
        open_store(path, model)


def test_ensure_store_builds_once(tiny_target, dataset, tmp_path, capsys):
    model, tok = tiny_target
    path = tmp_path / "auto"
    first = ensure_store(path, model, tok, dataset, (-1,), progress=False)
    assert "tokens x" in capsys.readouterr().out
    stamp = (path / "manifest.json").stat().st_mtime_ns
    again = ensure_store(path, model, tok, dataset, (-1,), progress=False)
    assert capsys.readouterr().out == "" and (path / "manifest.json").stat().st_mtime_ns == stamp
    assert torch.equal(first.batch([1, 2], 40)["features"], again.batch([1, 2], 40)["features"])
    with pytest.raises(StoreError, match="no feature store"):
        open_store(tmp_path / "nothing", model)


def test_dump_features_script(tiny_target_dir, tiny_chat_file, tmp_path, capsys):
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "data_prep" / "dump_features.py"
    spec = importlib.util.spec_from_file_location("dump_features", script)
    dump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dump)
    out = tmp_path / "dumped"
    args = ["--target", tiny_target_dir, "--data", tiny_chat_file, "--out", str(out), "--layers", "eagle3",
            "--max-length", "160", "--limit", "8", "--no-progress"]
    assert dump.main(args + ["--topk", "4"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == 8 and manifest["topk_logits"] == 4
    assert manifest["dtype"] == "bfloat16" and manifest["layers"] == [1, 2]
    capsys.readouterr()
    assert dump.main(args + ["--topk", "2"]) == 2           # another plan for the same folder: one error line
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "topk_logits" in err[-1]      # (after the loading bar)


def test_offline_recipe_builds_its_store_beside_the_data(tiny_target_dir, tiny_chat_file, tiny_prompt_file,
                                                          tmp_path):
    """recipes/eagle_head_offline.yaml: one command builds FILE.jsonl.store on first use, trains from it, and the
    in-loop evaluation stays lossless."""
    import shutil

    from draftlab.config import load_config
    from draftlab.train import main

    data = tmp_path / "chat.jsonl"
    shutil.copy(tiny_chat_file, data)
    out = tmp_path / "run"
    main(load_config(["recipe=eagle_head_offline", f"target.path={tiny_target_dir}", f"data.train={data}",
                      f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}", "eval.num_prompts=2",
                      "eval.max_new_tokens=16", "eval.every=2", "train.max_steps=2", "train.batch_size=4",
                      "train.warmup_steps=0", "data.max_length=160", "tracking=none"]))
    manifest = json.loads((tmp_path / "chat.jsonl.store" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["layers"] == [2]
    assert json.loads((out / "step_2" / "eval.json").read_text())["lossless"] is True


def test_joined_stores_read_as_the_store_of_the_joined_data(tiny_target, tiny_target_dir, tiny_chat_file, built,
                                                            dataset, tmp_path, capsys):
    """Stores of two halves, joined, give the same rows as the store built over the whole data; joining refuses
    parts out of order, another layout, and an existing output, and the script writes the joined data too."""
    import importlib.util

    model, tok = tiny_target
    conversations, _ = read_conversations(tiny_chat_file)
    halves = [conversations[:10], conversations[10:24]]
    parts = []
    for i, half in enumerate(halves):
        part = ChatDataset(half, tok, 160)
        path = tmp_path / f"part{i}"
        build_store(path, model, tok, part, LAYERS, topk_logits=5, dtype=torch.float32, batch_size=5,
                    shard_tokens=200, progress=False)
        parts.append(path)
    joined = store_mod.join_stores(tmp_path / "joined", parts, dataset)
    assert joined["rows"] == len(dataset) and joined["data_hash"] == json.loads(
        (built[0] / "manifest.json").read_text())["data_hash"]
    store = open_store(tmp_path / "joined", model, tokenizer=tok, dataset=dataset, topk_logits=5, verify_all=True)
    rows, T = [9, 10, 0, 23], max(dataset.lengths)           # both sides of the seam
    whole, got = built[1].batch(rows, T), store.batch(rows, T)
    assert got.keys() == whole.keys()
    for key in whole:
        torch.testing.assert_close(got[key], whole[key])

    with pytest.raises(StoreError, match="not rows 0..13"):
        store_mod.join_stores(tmp_path / "swapped", parts[::-1], dataset)
    with pytest.raises(StoreError, match="already exists"):
        store_mod.join_stores(tmp_path / "joined", parts, dataset)
    other = tmp_path / "other_layers"
    build_store(other, model, tok, ChatDataset(halves[1], tok, 160), (-1,), dtype=torch.float32, progress=False)
    with pytest.raises(StoreError, match="layers"):
        store_mod.join_stores(tmp_path / "mixed", [parts[0], other], dataset)
    assert not (tmp_path / "swapped").exists() and not (tmp_path / "mixed").exists()

    script = Path(__file__).resolve().parents[1] / "data_prep" / "join_stores.py"
    spec = importlib.util.spec_from_file_location("join_stores", script)
    join = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(join)
    files = []
    for i, half in enumerate(halves):
        files.append(tmp_path / f"part{i}.jsonl")
        files[-1].write_text("".join(json.dumps({"messages": m}) + "\n" for m in half))
    args = ["--target", tiny_target_dir, "--max-length", "160", "--part", str(files[0]), str(parts[0]),
            "--part", str(files[1]), str(parts[1]), "--out-data", str(tmp_path / "all.jsonl"),
            "--out", str(tmp_path / "all.store")]
    assert join.main(args) == 0
    again, _ = read_conversations(str(tmp_path / "all.jsonl"))
    open_store(tmp_path / "all.store", model, tokenizer=tok, dataset=ChatDataset(again, tok, 160))
    capsys.readouterr()
    assert join.main(args) == 2                              # outputs exist: one line, nothing overwritten
    assert "already exists" in capsys.readouterr().err
