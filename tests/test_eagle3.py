"""EagleHead3: aux-layer defaults, the training-time-test attention against an explicit inference-style
reference, no step seeing a future position, the loss alignment, the draft vocabulary (d2t/t2d), save -> load,
and lossless greedy speculation (chain, dynamic and static trees) untrained and after a few steps."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from draftlab.drafters.eagle3 import EagleHead3, default_aux_layers
from draftlab.vocab import vocab_maps
from draftlab.target import target_features
from draftlab.drafters import load_drafter


@pytest.fixture(scope="module")
def target(tiny_target_4_layers):
    return tiny_target_4_layers


@pytest.fixture(scope="module")
def dataset(target, tiny_chat_file):
    from draftlab.data import ChatDataset, read_conversations

    return ChatDataset(read_conversations(tiny_chat_file)[0], target[1], 160)


def _head(model, **cfg) -> EagleHead3:
    torch.manual_seed(0)
    return EagleHead3.from_target(model, SimpleNamespace(**cfg))


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text)["input_ids"])


def _features(model, ids: torch.Tensor, layers) -> torch.Tensor:
    with torch.no_grad():
        return target_features(model(ids, output_hidden_states=True).hidden_states, layers)


def _batch(ids: torch.Tensor, loss_mask=None, attention_mask=None) -> dict:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids) if attention_mask is None else attention_mask,
            "loss_mask": torch.ones_like(ids) if loss_mask is None else loss_mask}


def test_defaults_shapes_and_frozen_pieces(target):
    model, tok = target
    assert default_aux_layers(32) == [2, 16, 29] and default_aux_layers(2) == [1, 1, 1]
    for layers in range(4, 40):   # three distinct layers in 1..L-1 whenever the target has them
        aux = default_aux_layers(layers)
        assert len(set(aux)) == 3 and 1 <= min(aux) and max(aux) <= layers - 1, (layers, aux)
    head = _head(model)
    d, vocab = model.config.hidden_size, model.config.vocab_size
    assert head.aux_layers == default_aux_layers(4) and head.feature_layers == (1, 2, 3, -1)
    assert head.fc.in_features == 3 * d and head.fc.bias is None
    assert head.layer.self_attn.q_proj.in_features == 2 * d and head.lm_head.out_features == vocab
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trainable == set(head.state_dict()) and not any("embed" in n for n in trainable)
    assert not model.get_output_embeddings().weight.requires_grad
    with pytest.raises(ValueError, match="aux_layers"):
        _head(model, aux_layers=[1, 4])               # 4 = the post-norm state of a 4-layer target
    ids = _ids(tok, "The quick brown fox")[None]
    loss, metrics = head.loss(_batch(ids), _features(model, ids, head.feature_layers))
    assert torch.isfinite(loss) and {f"acc_{j}" for j in range(7)} <= set(metrics)


def _reference_outputs(head, aux, ids, steps):
    """Inference-style reference, one slot at a time: o^{(j)}_t is the last output of a plain causal forward
    over the real pairs 0..t (fused features, tokens x_1..x_{t+1}) followed by the draft entries
    (o^{(i-1)}_t, x_{t+1+i}) for i = 1..j at positions t+1..t+j. Returns [steps][n, d]."""
    n = aux.shape[0]
    fused = head.fc(aux)
    out = [torch.zeros(n, head.hidden_size) for _ in range(steps)]
    for t in range(n):
        inputs, tokens = list(fused[: t + 1]), list(ids[1: t + 2])
        for j in range(steps):
            if t + 1 + j >= len(ids):
                break
            if j > 0:
                inputs.append(out[j - 1][t])
                tokens.append(ids[t + 1 + j])
            L = len(inputs)
            causal = torch.full((L, L), torch.finfo(torch.float32).min).triu(1)[None, None]
            o = head(torch.stack(inputs)[None], torch.stack(tokens)[None], torch.arange(L)[None], causal)[0]
            out[j][t] = o[-1]
    return out


def test_ttt_matches_the_inference_reference(target):
    model, tok = target
    head = _head(model, ttt_steps=4).eval()
    torch.manual_seed(1)
    T, d = 9, model.config.hidden_size
    ids = torch.randint(0, model.config.vocab_size, (T,))
    aux = torch.randn(T - 1, 3 * d)
    with torch.no_grad():
        got = head.ttt_outputs(aux[None], ids[None], torch.ones(1, T - 1, dtype=torch.bool))
        ref = _reference_outputs(head, aux, ids, 4)
    assert len(got) == 4
    for j in range(4):
        usable = T - 1 - j                           # slots whose step-j token x_{t+1+j} exists
        torch.testing.assert_close(got[j][0, :usable], ref[j][:usable], atol=1e-5, rtol=1e-4)


def test_no_step_sees_a_future_position(target):
    """o^{(j)}_t may depend on g_0..g_t and x_1..x_{t+1+j} only: perturbing everything later changes nothing."""
    model, _ = target
    head = _head(model, ttt_steps=5).eval()
    torch.manual_seed(2)
    T, d, cut = 12, model.config.hidden_size, 5
    ids = torch.randint(0, model.config.vocab_size, (T,))
    aux = torch.randn(T - 1, 3 * d)
    ids2, aux2 = ids.clone(), aux.clone()
    aux2[cut + 1:] += torch.randn_like(aux2[cut + 1:])
    ids2[cut + 2:] = (ids2[cut + 2:] + 7) % model.config.vocab_size
    valid = torch.ones(1, T - 1, dtype=torch.bool)
    with torch.no_grad():
        a = head.ttt_outputs(aux[None], ids[None], valid)
        b = head.ttt_outputs(aux2[None], ids2[None], valid)
    changed = False
    for j in range(5):
        for t in range(T - 1):
            same = torch.allclose(a[j][0, t], b[j][0, t], atol=1e-6)
            if t + j <= cut:                         # inputs all at or before the cut
                assert same, (j, t)
            changed |= not same
    assert changed

    mask = EagleHead3.ttt_mask(valid, 3)[0]           # [n, 4n]: causal block, then one identity block per step
    n = T - 1
    assert torch.equal(mask[:, :n], torch.ones(n, n, dtype=torch.bool).tril())
    for block in range(1, 4):
        assert torch.equal(mask[:, block * n:(block + 1) * n], torch.eye(n, dtype=torch.bool))


def test_loss_alignment_and_padding(target):
    """Step j at slot t is scored against the target's distribution at t+1+j, weighted by loss_mask[t+2+j]."""
    model, tok = target
    head = _head(model, ttt_steps=3).eval()
    ids = _ids(tok, "Speculative decoding drafts tokens and the target verifies them")[None]
    T = ids.shape[1]
    feats = _features(model, ids, head.feature_layers)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :4] = 0
    loss, metrics = head.loss(_batch(ids, loss_mask), feats)
    d = model.config.hidden_size
    with torch.no_grad():
        outs = head.ttt_outputs(feats[:, :-1, :-d], ids, torch.ones(1, T - 1, dtype=torch.bool))
        full = model.get_output_embeddings()(feats[0, :, -d:])
    expected = 0.0
    for j in range(3):
        terms = [-(full[t + 1 + j].softmax(-1) * head.draft_logits(outs[j][0, t]).log_softmax(-1)).sum()
                 for t in range(T - 2 - j) if loss_mask[0, t + 2 + j]]
        step = torch.stack(terms).mean()
        assert metrics[f"loss_{j}"] == pytest.approx(step.item(), rel=1e-4)
        expected += 0.8 ** j * step.item()
    assert loss.item() == pytest.approx(expected, rel=1e-4)

    pad = 3
    for side in ("right", "left"):
        cat = (lambda a, g: torch.cat([a, g], 1)) if side == "right" else (lambda a, g: torch.cat([g, a], 1))
        junk_ids = torch.randint(0, model.config.vocab_size, (1, pad))
        batch = _batch(cat(ids, junk_ids), cat(loss_mask, torch.ones(1, pad, dtype=torch.long)),
                       cat(torch.ones_like(ids), torch.zeros(1, pad, dtype=torch.long)))
        padded, _ = head.loss(batch, cat(feats, 3 * torch.randn(1, pad, feats.shape[-1])))
        assert padded.item() == pytest.approx(loss.item(), rel=1e-4), side


def test_draft_vocabulary_and_maps(target, dataset):
    model, _ = target
    head = _head(model, draft_vocab_size=40)
    with pytest.raises(RuntimeError, match="prepare"):
        head.loss(_batch(torch.tensor([[1, 2, 3, 4]])), torch.zeros(1, 4, 4 * model.config.hidden_size))
    head.prepare(dataset)
    counts = torch.zeros(model.config.vocab_size)
    for row in dataset.rows:
        for t, m in zip(row["input_ids"], row["loss_mask"]):
            counts[t] += m
    vocab = head.draft_vocab
    assert len(vocab) == 40 and torch.equal(vocab, vocab.sort().values)
    assert counts[vocab].min() >= counts[~head.t2d].max()          # the most frequent assistant tokens
    d2t, t2d = head.d2t, head.t2d
    assert torch.equal(torch.arange(40) + d2t, vocab)               # draft id -> target id
    assert t2d.sum() == 40 and t2d[vocab].all()
    assert torch.equal(t2d.long().cumsum(0)[vocab] - 1, torch.arange(40))   # target id -> draft id
    assert torch.equal(vocab_maps(vocab, model.config.vocab_size)[0], d2t)
    torch.testing.assert_close(head.lm_head.weight, model.get_output_embeddings().weight[vocab])

    logits = head.logits(torch.randn(3, model.config.hidden_size))
    assert logits.shape == (3, model.config.vocab_size)
    assert torch.isinf(logits[:, ~t2d]).all() and torch.isfinite(logits[:, t2d]).all()
    distinct = int((counts > 0).sum())
    with pytest.raises(ValueError, match=f"only {distinct} distinct assistant tokens"):
        _head(model, draft_vocab_size=distinct + 1).prepare(dataset)


def test_auto_draft_vocabulary_keeps_every_distinct_token_of_small_data(target, dataset, monkeypatch):
    import draftlab.drafters.eagle3 as eagle3

    model, _ = target
    distinct = len({t for row in dataset.rows for t, m in zip(row["input_ids"], row["loss_mask"]) if m})
    assert distinct < model.config.vocab_size - 1
    monkeypatch.setattr(eagle3, "AUTO_DRAFT_VOCAB", model.config.vocab_size - 1)   # more than the data holds
    head = _head(model, draft_vocab_size=-1)
    head.prepare(dataset)
    assert head.draft_vocab_size == distinct == len(head.draft_vocab) == head.lm_head.out_features
    reloaded = EagleHead3.from_config(head.drafter_config(), model)                 # the saved size, not auto
    assert torch.equal(reloaded.draft_vocab, head.draft_vocab) and reloaded.vocab_ready
    with pytest.raises(ValueError, match="-1"):
        _head(model, draft_vocab_size=-2)


def test_checkpoint_holds_the_vocabulary_maps(target, dataset, tmp_path):
    from safetensors.torch import load_file

    from draftlab.checkpoint import save_drafter
    from draftlab.drafters import load_drafter

    model, _ = target
    head = _head(model, draft_vocab_size=40)
    head.prepare(dataset)
    folder = save_drafter(head, tmp_path / "step_1")
    maps = load_file(str(folder / "d2t_t2d.safetensors"))
    assert torch.equal(maps["d2t"], head.d2t) and torch.equal(maps["t2d"], head.t2d)
    assert torch.equal(maps["d2t"] + torch.arange(40), head.draft_vocab)
    assert torch.equal(load_drafter(folder, model).draft_vocab, head.draft_vocab)


def _trained(model, tok, dataset, steps: int, **cfg) -> EagleHead3:
    from draftlab.data import collate

    head = _head(model, **cfg)
    if hasattr(head, "prepare"):
        head.prepare(dataset)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    head.train()
    for step in range(steps):
        batch = collate(dataset.rows[4 * step: 4 * step + 4], tok.pad_token_id)
        loss, _ = head.loss(batch, _features(model, batch["input_ids"], head.feature_layers))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def test_save_load_round_trip(target, dataset, tmp_path, monkeypatch):
    from draftlab import checkpoint
    from draftlab.drafters import DRAFTERS
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = target
    head = _trained(model, tok, dataset, 3, draft_vocab_size=48, ttt_steps=3)
    config = json.loads(json.dumps(head.drafter_config()))
    assert config["kind"] == "eagle3" and len(config["draft_vocab"]) == 48
    monkeypatch.setitem(DRAFTERS, "eagle3", EagleHead3)
    checkpoint.save_drafter(head, tmp_path / "step_3")
    loaded = load_drafter(tmp_path / "step_3", model).eval()
    assert torch.equal(loaded.draft_vocab, head.draft_vocab) and loaded.ttt_steps == 3
    prompt = _ids(tok, "<|im_start|>user\nNumbers: 0 1 2<|im_end|>\n<|im_start|>assistant\n")
    trees = []
    for drafter in (head, loaded):
        proposer = drafter.proposer(model)
        proposer.reset(prompt)
        with torch.no_grad():
            out = model(prompt[None], output_hidden_states=True)
        proposer.commit(out.logits[0, -1].argmax().view(1), target_features(out.hidden_states, proposer.feature_layers)[0])
        trees.append(proposer.propose(TreeSpec(kind="dynamic", depth=3, top_k=4, total_tokens=10), Sampling(), None))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    assert head.t2d[trees[0].tokens].all()                         # drafts are draft-vocabulary tokens


@pytest.mark.parametrize("steps", [0, 3])
def test_greedy_speculation_is_lossless(target, dataset, steps):
    from draftlab.evaluator import speculative_generate
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = target
    head = _trained(model, tok, dataset, steps, draft_vocab_size=64, ttt_steps=3)
    prompt = _ids(tok, "<|im_start|>user\nRepeat: The quick brown fox<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        plain = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    for spec in (TreeSpec(kind="chain", draft_length=4), TreeSpec(kind="dynamic", depth=3, top_k=3, total_tokens=10),
                 TreeSpec(kind="static")):
        result = speculative_generate(model, head.proposer(model), prompt, spec, Sampling(), 16)
        assert result.tokens == plain, spec.kind
        tau = result.new_tokens / result.rounds
        assert 1 <= tau <= spec.max_depth + 1


def test_recipe_trains_with_lossless_in_loop_evaluation(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path):
    """recipes/eagle3_head.yaml composes, prepares its vocabulary, trains and evaluates (once registered)."""
    from draftlab.config import load_config
    from draftlab.train import main

    out = tmp_path / "run"
    main(load_config(["recipe=eagle3_head", f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}",
                      f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}", "eval.num_prompts=2",
                      "eval.max_new_tokens=16", "eval.every=1", "train.max_steps=2", "train.batch_size=4",
                      "train.warmup_steps=0", "data.max_length=160", "tracking=none", "drafter.draft_vocab_size=64",
                      "drafter.ttt_steps=3", "eval.depth=3", "eval.total_tokens=12"]))
    for step in (1, 2):
        report = json.loads((out / f"step_{step}" / "eval.json").read_text())
        assert report["lossless"] is True and 1 <= report["acceptance_length"] <= 3 + 1
    assert len(json.loads((out / "step_2" / "drafter_config.json").read_text())["draft_vocab"]) == 64


def test_init_from_target_copies_the_last_layer(target):
    from types import SimpleNamespace

    model = target[0]
    head = EagleHead3.from_target(model, SimpleNamespace(init_from_target=True))
    last = model.model.layers[-1]
    d = model.config.hidden_size
    q = head.layer.self_attn.q_proj.weight
    assert torch.equal(q[:, d:], last.self_attn.q_proj.weight) and not q[:, :d].any()
    assert torch.equal(head.layer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(head.fc.weight[:, -d:], torch.eye(d)) and not head.fc.weight[:, :-d].any()
    assert head.drafter_config()["init_from_target"] is True
