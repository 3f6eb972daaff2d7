"""Packed batches (train.pack_tokens, draftlab/packing.py): whole conversations end to end in a row, document-masked
attention and positions per conversation. The same conversations give the same loss packed and padded, for every
kind that packs; nothing is seen across a conversation boundary; the store and the online target features lay
packed rows out alike; and a packed run trains, saves, loads and stays lossless."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from draftlab import packing
from draftlab.data import ChatDataset, collate, read_conversations
from draftlab.drafters.eagle import EagleHead, ttt_mask
from draftlab.drafters.eagle3 import EagleHead3
from draftlab.drafters.medusa import MedusaHeads
from draftlab.drafters.small_lm import SmallLM
from draftlab.train import features_for


@pytest.fixture(scope="module")
def target(tiny_target_4_layers):
    return tiny_target_4_layers


@pytest.fixture(scope="module")
def six(target, tiny_chat_file):
    """Six conversations of different lengths (assistant loss masks as training uses them)."""
    convs, _ = read_conversations(tiny_chat_file)
    ds = ChatDataset(convs[:6], target[1], 160)
    assert len({len(r["input_ids"]) for r in ds}) > 1
    return ds


@pytest.fixture(scope="module")
def rows(six):
    return [six[i] for i in range(len(six))]


def _layouts(rows, pad_id):
    """The same six conversations padded (6 rows) and packed into 2 rows (with right padding after the shorter)."""
    padded = collate(rows, pad_id)
    packed = packing.collate_packed([rows[:4], rows[4:]], pad_id)
    return (list(range(6)), padded), ([[0, 1, 2, 3], [4, 5]], packed)


def test_pack_keeps_order_and_limit():
    lengths = [5, 3, 4, 6, 2, 7]
    rows = packing.pack(lengths, [0, 1, 2, 3, 4, 5], 10)
    assert rows == [[0, 1, 4], [2, 3], [5]]          # first fit: 4 (2 tokens) fills the first row's room
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    with pytest.raises(ValueError, match="pack_tokens"):
        packing.pack([11], [0], 10)


def test_packed_batches_walk_through_epochs_of_different_sizes(rows, six):
    """Each epoch's packing has its own number of rows; the data position still walks every epoch whole, in
    order, and a resumed position (a new Batches at the same micro_step) gives the same batches."""
    from draftlab.runtime import Batches

    batches = Batches(six, 1, 1, 0, seed=3, pad_token_id=0, pack_tokens=250)
    sizes = [len(batches.epoch_batches(e)) for e in range(6)]
    assert len(set(sizes)) > 1, sizes          # this seed's epochs pack into different numbers of rows
    seen = [batches.next()[0] for _ in range(sum(sizes))]
    start = 0
    for e, n in enumerate(sizes):
        assert seen[start:start + n] == batches.epoch_batches(e)
        assert sorted(i for b in seen[start:start + n] for r in b for i in r) == list(range(len(six)))
        start += n
    again = Batches(six, 1, 1, 0, seed=3, pad_token_id=0, pack_tokens=250)
    again.micro_step = sizes[0] + 1
    assert again.next()[0] == seen[sizes[0] + 1]


def test_collate_packed_layout(rows, target):
    batch = packing.collate_packed([rows[:3]], target[1].pad_token_id)
    n = [len(r["input_ids"]) for r in rows[:3]]
    assert batch["input_ids"].shape == (1, sum(n))
    assert batch["doc_ids"][0].tolist() == [1] * n[0] + [2] * n[1] + [3] * n[2]
    assert batch["position_ids"][0].tolist() == list(range(n[0])) + list(range(n[1])) + list(range(n[2]))
    assert batch["attention_mask"].all()
    assert batch["input_ids"][0, n[0]:n[0] + n[1]].tolist() == rows[1]["input_ids"]
    valid = torch.tensor([[True] * 4 + [False] + [True] * 3])
    docs = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]])
    assert packing.positions(valid, docs)[0].tolist() == [0, 1, 2, 3, 0, 0, 1, 2]


def test_target_features_of_packed_rows_equal_each_conversation_alone(rows, target):
    model, tok = target
    layers = (1, 2, -1)
    (idx_p, padded), (idx_k, packed) = _layouts(rows, tok.pad_token_id)
    fp = features_for(model, padded, idx_p, layers, None)
    fk = features_for(model, packed, idx_k, layers, None)
    for (b, a, e, one) in packing.spans(packed, idx_k):
        n = e - a
        assert torch.allclose(fk[b, a:e], fp[one, :n], atol=1e-5), one
    # changing the first conversation of a packed row leaves the next one's features untouched
    changed = {k: v.clone() for k, v in packed.items()}
    n0 = len(rows[0]["input_ids"])
    changed["input_ids"][0, 1:n0] = (changed["input_ids"][0, 1:n0] + 7) % len(tok)
    again = features_for(model, changed, idx_k, layers, None)
    assert not torch.allclose(again[0, :n0], fk[0, :n0])
    assert torch.equal(again[0, n0:], fk[0, n0:])


def _drafters(model):
    torch.manual_seed(0)
    return {
        "eagle": EagleHead.from_target(model, SimpleNamespace(feature_noise=0.0)),
        "hass": EagleHead.from_target(model, SimpleNamespace(feature_noise=0.0, harmonized_steps=3, topk_weight=0.5)),
        "eagle3": EagleHead3.from_target(model, SimpleNamespace(ttt_steps=3)),
        "eagle3_speculators_layout": EagleHead3.from_target(model, SimpleNamespace(
            ttt_steps=3, norm_before_fc=True, norm_before_residual=True, norm_output=True, train_lm_head=False,
            loss_position="input")),
        "eagle3_all_tokens_noise": EagleHead3.from_target(model, SimpleNamespace(
            ttt_steps=2, loss_tokens="all", feature_noise=0.2)),
        "medusa": MedusaHeads.from_target(model, SimpleNamespace(medusa_heads=3)),
        "small_lm": SmallLM.from_target(model, SimpleNamespace(num_layers=1)),
    }


def test_packed_and_padded_batches_give_the_same_loss(rows, target):
    model, tok = target
    (idx_p, padded), (idx_k, packed) = _layouts(rows, tok.pad_token_id)
    for name, drafter in _drafters(model).items():
        drafter.eval()
        layers = tuple(getattr(drafter, "feature_layers", ()))
        fp = features_for(model, padded, idx_p, layers, None) if layers else None
        fk = features_for(model, packed, idx_k, layers, None) if layers else None
        with torch.no_grad():
            loss_p, metrics_p = drafter.loss(padded, fp)
            loss_k, metrics_k = drafter.loss(packed, fk)
        assert loss_p.item() > 0, name
        assert torch.allclose(loss_p, loss_k, rtol=1e-4, atol=1e-5), (name, loss_p.item(), loss_k.item())
        for key in metrics_p:
            if key.startswith("acc"):
                assert abs(metrics_p[key] - metrics_k[key]) < 1e-6, (name, key)


def test_no_training_time_test_step_crosses_a_conversation(rows, target):
    model, tok = target
    docs = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]])
    valid = torch.tensor([[True, True, False, True, True, True, False, False]])
    for step in range(3):
        mask = ttt_mask(valid, step, docs)[0]            # [n, (step+1) n]
        first = mask[:, :8]
        for q in range(8):
            for k in range(8):
                if first[q, k] and q != k:
                    assert docs[0, q] == docs[0, k] and k <= q
    # the head's outputs on the second conversation do not move when the first one's tokens change
    head = EagleHead3.from_target(model, SimpleNamespace(ttt_steps=3)).eval()
    (_, _), (idx_k, packed) = _layouts(rows, tok.pad_token_id)
    layers = head.feature_layers
    feats = features_for(model, packed, idx_k, layers, None)
    d = head.hidden_size
    docs = packed["doc_ids"]
    valid = packing.same_doc(docs, 1)
    n0 = len(rows[0]["input_ids"])
    with torch.no_grad():
        base = head.ttt_outputs(feats[:, :-1, :-d], packed["input_ids"], valid, docs[:, :-1])
        ids = packed["input_ids"].clone()
        ids[0, 1:n0] = (ids[0, 1:n0] + 5) % len(tok)
        noisy = feats.clone()
        noisy[0, :n0] += 1.0
        moved = head.ttt_outputs(noisy[:, :-1, :-d], ids, valid, docs[:, :-1])
    for a, b in zip(base, moved):
        assert not torch.allclose(a[0, :n0 - 3], b[0, :n0 - 3])
        assert torch.allclose(a[0, n0:], b[0, n0:], atol=1e-6)
        assert torch.allclose(a[1], b[1], atol=1e-6)


def test_store_lays_packed_rows_out_like_the_online_features(six, rows, target, tmp_path):
    from draftlab.store import build_store, open_store

    model, tok = target
    (_, _), (idx_k, packed) = _layouts(rows, tok.pad_token_id)
    layers = (1, 2, -1)
    online = features_for(model, packed, idx_k, layers, None)
    build_store(tmp_path / "store", model, tok, six, layers, 0, dtype=torch.float32, progress=False)
    store = open_store(tmp_path / "store", model, tokenizer=tok, dataset=six, feature_layers=layers)
    stored = store.batch(idx_k, packed["input_ids"].shape[1])["features"]
    real = packed["attention_mask"].bool()
    assert torch.allclose(stored[real], online[real], atol=1e-5)
    assert not stored[~real].any()


@pytest.mark.parametrize("recipe,extra", [
    ("eagle3_head", ["drafter.ttt_steps=2", "drafter.draft_vocab_size=-1", "drafter.norm_before_fc=true",
                     "drafter.norm_before_residual=true", "drafter.norm_output=true", "drafter.train_lm_head=false",
                     "drafter.loss_position=input"]),
    ("eagle3_head", ["drafter.ttt_steps=2", "drafter.draft_vocab_size=-1", "drafter.loss_tokens=all",
                     "drafter.feature_noise=0.2", "drafter.init_from_target=true"]),
    ("eagle_head", ["drafter.harmonized_steps=2"]),
])
def test_packed_run_trains_saves_loads_and_stays_lossless(recipe, extra, tiny_target_dir, tiny_chat_file,
                                                          tiny_prompt_file, tmp_path):
    from safetensors.torch import load_file

    from draftlab.config import load_config
    from draftlab.drafters import load_drafter
    from draftlab.evaluator import evaluate
    from draftlab.target import load_target
    from draftlab.train import main
    from draftlab.data import encode_prompt, load_prompts
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    out = tmp_path / "run"
    cfg = load_config([f"recipe={recipe}", f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}",
                       f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}", "eval.num_prompts=2",
                       "eval.max_new_tokens=16", "eval.draft_length=3", "eval.tree=chain", "eval.every=4",
                       "train.max_steps=4", "train.batch_size=2", "train.pack_tokens=256", "data.max_length=128",
                       "train.warmup_steps=0", "train.lr=1e-3", "tracking=none", "train.keep_last=0", *extra])
    summary = main(cfg)
    report = json.loads((out / "step_4" / "eval.json").read_text())
    assert report["lossless"] is True and 1.0 <= report["acceptance_length"] <= 4.0
    saved = load_file(str(out / "step_4" / "model.safetensors"))
    if "drafter.train_lm_head=false" in extra:
        assert "lm_head.weight" not in saved and "input_norm.weight" in saved
    target, tok = load_target(tiny_target_dir, "float32", "cpu")
    drafter = load_drafter(out / "step_4", target)
    again = load_drafter(out / "step_4", target)
    prompts = [encode_prompt(tok, p.messages) for p in load_prompts(tiny_prompt_file, limit=2)]
    runs = [evaluate(target, d.proposer(target), prompts, spec=TreeSpec(kind="chain", draft_length=3),
                     sampling=Sampling(temperature=0.0), max_new_tokens=16, progress=False, repeats=1)
            for d in (drafter, again)]
    assert runs[0]["lossless"] and runs[1]["lossless"]
    assert runs[0]["acceptance_length"] == runs[1]["acceptance_length"] == report["acceptance_length"]
    assert summary["steps"] == 4


def test_packing_is_refused_where_it_cannot_apply(tiny_target_dir, tiny_chat_file):
    from draftlab.config import load_config

    base = [f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}", "eval.every=0", "out_dir=/tmp/x"]
    with pytest.raises(Exception, match="pack_tokens"):
        load_config(["recipe=eagle3_head", "train.pack_tokens=64", "data.max_length=128", *base])
    with pytest.raises(Exception, match="pack_tokens"):
        load_config(["recipe=medusa2_lora", "train.pack_tokens=4096", *base])
    with pytest.raises(Exception, match="pack_tokens"):
        load_config(["recipe=distill_online_whitebox", "train.pack_tokens=4096", *base])
    with pytest.raises(Exception, match="choose one"):
        load_config(["recipe=eagle_head", "train.pack_tokens=4096", "train.bucketed=true", *base])


def test_offline_run_without_evaluation_releases_the_target_layers_and_trains_the_same(
        tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path, capsys):
    """data.store + eval.every=0: the target's decoder layers are dropped (nothing runs them); the weights come out
    the same as a run that keeps them (one that evaluates its final step)."""
    from safetensors.torch import load_file

    from draftlab.config import load_config
    from draftlab.train import main

    common = ["recipe=eagle3_head", f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}",
              f"data.eval_prompts={tiny_prompt_file}", f"data.store={tmp_path / 'store'}", "data.max_length=128",
              "train.max_steps=3", "train.batch_size=2", "train.pack_tokens=256", "train.warmup_steps=0",
              "drafter.ttt_steps=2", "drafter.draft_vocab_size=-1", "eval.num_prompts=1", "eval.max_new_tokens=8",
              "tracking=none"]
    main(load_config(common + [f"out_dir={tmp_path / 'kept'}", "eval.every=3"]))
    capsys.readouterr()
    main(load_config(common + [f"out_dir={tmp_path / 'released'}", "eval.every=0"]))
    assert "released the target's decoder layers" in capsys.readouterr().out
    kept = load_file(str(tmp_path / "kept" / "step_3" / "model.safetensors"))
    released = load_file(str(tmp_path / "released" / "step_3" / "model.safetensors"))
    assert kept.keys() == released.keys()
    assert all(torch.equal(kept[k], released[k]) for k in kept)


def test_eagle3_all_tokens_and_feature_noise(rows, target):
    """loss_tokens=all also learns where the loss mask is 0 (prompt tokens); feature noise acts in training only."""
    model, tok = target
    batch = collate(rows[:2], tok.pad_token_id)
    silent = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    head = EagleHead3.from_target(model, SimpleNamespace(ttt_steps=2)).eval()
    every = EagleHead3.from_target(model, SimpleNamespace(ttt_steps=2, loss_tokens="all")).eval()
    every.load_state_dict(head.state_dict())
    feats = features_for(model, batch, [0, 1], head.feature_layers, None)
    with torch.no_grad():
        assert head.loss(silent, feats)[0].item() == 0.0       # nothing counted
        assert every.loss(silent, feats)[0].item() > 0.0
    noisy = EagleHead3.from_target(model, SimpleNamespace(ttt_steps=2, feature_noise=0.2))
    noisy.load_state_dict(head.state_dict())
    with torch.no_grad():
        noisy.eval()
        assert torch.equal(noisy.loss(batch, feats)[0], head.loss(batch, feats)[0])
        noisy.train()
        assert not torch.equal(noisy.loss(batch, feats)[0], head.loss(batch, feats)[0])
