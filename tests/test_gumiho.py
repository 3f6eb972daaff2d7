"""Gumiho heads: the serial and parallel parts both train, the MLP terms' alignment, drafting past depth s from the
MLP heads (against a no-cache reference), lossless greedy and sampled speculation on chains and trees, tau rising
on a learnable task, save -> load, the recipe with in-loop evaluation and resume, the official layout export."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from draftlab.drafters.gumiho import GumihoHeads
from draftlab.evaluator import speculative_generate, target_generate
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling
from test_draft_vocab import V, _exact_joint, six_token_target  # noqa: F401 (a fixture)
from test_eagle import _batch, _features, _fit, _ids
from test_eagle import _reference as _reference_serial

SMALL = dict(serial_tokens=2, serial_layers=1, mlp_heads=3, mlp_layers=1)
SPECS = [TreeSpec(kind="chain", draft_length=5), TreeSpec(kind="static"),
         TreeSpec(kind="dynamic", depth=5, top_k=3, total_tokens=12)]


@pytest.fixture(autouse=True)
def keep_thread_count():
    """train.num_threads=1 in the training runs below must not leak into other tests."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _heads(model, seed: int = 0, **cfg) -> GumihoHeads:
    torch.manual_seed(seed)
    return GumihoHeads.from_target(model, SimpleNamespace(**{**SMALL, **cfg}))


def _grads(heads) -> dict[str, float]:
    """Summed |grad| of the serial part (fc, decoder layers) and of the parallel part (MLP heads)."""
    out = {"serial": 0.0, "parallel": 0.0}
    for name, p in heads.named_parameters():
        if p.requires_grad and p.grad is not None:
            out["parallel" if name.startswith("mlps.") else "serial"] += p.grad.abs().sum().item()
    return out


def test_shapes_frozen_pieces_and_both_parts_get_gradients(tiny_target):
    model, tok = tiny_target
    heads = _heads(model)
    d = model.config.hidden_size
    trainable = [n for n, p in heads.named_parameters() if p.requires_grad]
    assert all(n.startswith(("fc.", "layers.", "mlps.")) for n in trainable)
    assert any(n.startswith("mlps.") for n in trainable) and any(n.startswith("layers.") for n in trainable)
    assert not any("embed" in n or "lm_head" in n for n in heads.state_dict())
    assert len(heads.layers) == 1 and len(heads.mlps) == 3 and heads.mlps[0][0].in_features == 2 * d

    ids = _ids(tok, "Speculative decoding drafts tokens and the target verifies them.")[None].repeat(2, 1)
    batch, feats = _batch(ids), _features(model, ids)
    loss, metrics = heads.loss(batch, feats)
    assert {"loss_reg", "loss_cls", "acc", "acc_mlp0", "acc_mlp2", "loss_reg_mlp1"} <= set(metrics)
    loss.backward()
    grads = _grads(heads)
    assert grads["serial"] > 0 and grads["parallel"] > 0
    for mlp in heads.mlps:                        # every head's input projection is trained
        assert mlp[0].weight.grad.abs().sum() > 0

    # The parallel heads' terms alone reach the serial part (joint training), once a step has made the
    # zero-initialised MLP projections non-zero.
    torch.optim.SGD([p for p in heads.parameters() if p.requires_grad], lr=0.1).step()     # the grads above
    heads.zero_grad()
    sum(scale * (t.reg + t.cls) for scale, t in heads.position_terms(batch, feats)[1:]).backward()
    grads = _grads(heads)
    assert grads["serial"] > 0 and grads["parallel"] > 0
    with pytest.raises(ValueError, match="serial_tokens=0"):
        _heads(model, serial_tokens=0)


def test_mlp_head_i_reads_s_fused_pairs_and_predicts_the_feature_s_plus_i_ahead(tiny_target):
    """Explicit per-slot computation of MLP head i's regression term: slot t reads
    [FC(emb(x_{t+2}), f^_{t+1}); FC(emb(x_{t+3}), f^_{t+2})] and is regressed on f_{t+3+i}, weighted by
    loss_mask[t+4+i]."""
    model, _ = tiny_target
    heads = _heads(model).eval()
    with torch.no_grad():
        for mlp in heads.mlps:
            mlp[0].weight.normal_(0, 0.05)
    torch.manual_seed(1)
    B, T, d, s = 2, 11, model.config.hidden_size, 2
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    feats = torch.randn(B, T, d)
    loss_mask = (torch.rand(B, T) < 0.8).long()
    _, metrics = heads.loss(_batch(ids, loss_mask), feats)
    for i in range(len(heads.mlps)):
        reg = weight = 0.0
        for b in range(B):
            serial = _reference_serial(heads, feats[b, :-1], ids[b, 1:])              # serial[t] = f^_{t+1}
            for t in range(T - 2 - s - i):
                w = float(loss_mask[b, t + 2 + s + i])
                pairs = torch.cat([heads.fuse(serial[t + j], ids[b, t + 2 + j]) for j in range(s)])
                with torch.no_grad():
                    pred = heads.mlps[i](pairs)
                reg += w * F.smooth_l1_loss(pred, feats[b, t + 1 + s + i]).item()
                weight += w
        assert metrics[f"loss_reg_mlp{i}"] == pytest.approx(reg / weight, rel=1e-4), i


def _start(heads, model, prompt: torch.Tensor):
    proposer = heads.proposer(model)
    proposer.reset(prompt)
    with torch.no_grad():
        out = model(prompt[None], output_hidden_states=True)
    proposer.commit(out.logits[0, -1].argmax().view(1), out.hidden_states[-1][0])
    return proposer


def test_chain_takes_depths_up_to_s_from_the_serial_head_and_the_rest_from_the_mlps(tiny_target):
    model, tok = tiny_target
    heads = _heads(model).eval()
    with torch.no_grad():
        for mlp in heads.mlps:
            mlp[0].weight.normal_(0, 0.05)
    prompt = _ids(tok, "The quick brown fox jumps")
    proposer = _start(heads, model, prompt)
    assert proposer.max_depth == 5
    seq = torch.cat([prompt, proposer.tokens[-1:]])
    feats = _features(model, seq[None])[0]
    tree = proposer.propose(TreeSpec(kind="chain", draft_length=8), Sampling(), None)
    assert len(tree) == 5 and tree.parents.tolist() == [-1, 0, 1, 2, 3]        # capped at s + K
    # reference: depth 1 from the real pairs, depth 2 from (f^_root, d_1), depths 3.. from the MLP heads
    out = _reference_serial(heads, feats[:-1], seq[1:])
    root = out[-1]
    assert tree.tokens[0] == heads.logits(root).argmax()
    after_d1 = _reference_serial(heads, torch.cat([feats[:-1], root[None]]), torch.cat([seq[1:], tree.tokens[:1]]))[-1]
    assert tree.tokens[1] == heads.logits(after_d1).argmax()
    with torch.no_grad():
        pairs = torch.cat([heads.fuse(root, tree.tokens[0]), heads.fuse(after_d1, tree.tokens[1])])
        for i in range(3):
            assert tree.tokens[2 + i] == heads.logits(heads.mlps[i](pairs)).argmax(), i
    # sampled: each node's q is the distribution it was drawn from
    sampling = Sampling(temperature=1.0)
    tree = proposer.propose(TreeSpec(kind="chain", draft_length=5), sampling, torch.Generator().manual_seed(0))
    assert tree.q.shape == (5, model.config.vocab_size) and torch.allclose(tree.q.sum(-1), torch.ones(5))


@pytest.mark.parametrize("serial_tokens", [1, 2])
@pytest.mark.parametrize("steps", [0, 20])
def test_greedy_speculation_is_lossless(tiny_target, serial_tokens, steps):
    model, tok = tiny_target
    heads = _heads(model, serial_tokens=serial_tokens)
    if steps:
        ids = _ids(tok, "Speculative decoding drafts tokens and the target verifies them.")[None].repeat(2, 1)
        _fit(heads, _batch(ids), _features(model, ids), steps)
    heads.eval()
    prompt = _ids(tok, "<|im_start|>user\nThe quick brown fox<|im_end|>\n<|im_start|>assistant\n")
    plain = target_generate(model, prompt, 24).tokens
    for spec in SPECS:
        result = speculative_generate(model, heads.proposer(model), prompt, spec, Sampling(), 24)
        assert result.tokens == plain, spec.kind
        assert 1 <= result.new_tokens / result.rounds <= min(spec.max_depth, serial_tokens + 3) + 1, spec.kind


@pytest.mark.parametrize("kind", ["chain", "dynamic", "static"])
def test_sampled_speculation_runs(tiny_target, kind):
    model, tok = tiny_target
    heads = _heads(model).eval()
    spec = TreeSpec(kind=kind, draft_length=5, depth=5, top_k=3, total_tokens=10)
    result = speculative_generate(model, heads.proposer(model), _ids(tok, "Write a short poem"), spec,
                                  Sampling(temperature=1.0, top_p=0.9), 16, None, torch.Generator().manual_seed(0))
    assert len(result.tokens) == 16 and all(0 <= a <= 5 for a in result.accepted)


def test_sampled_speculation_emits_the_target_distribution(six_token_target):
    """s = 1: the round's second draft token comes from an MLP head; the emitted tokens 2 and 3 still have exactly
    the target's joint distribution (the same statistical check as tests/test_draft_vocab.py)."""
    model = six_token_target
    heads = _heads(model, serial_tokens=1, mlp_heads=2).eval()
    with torch.no_grad():                        # MLP heads that draft something other than a constant
        for mlp in heads.mlps:
            mlp[0].weight.normal_(0, 0.3)
    sampling, spec = Sampling(temperature=1.0), TreeSpec(kind="chain", draft_length=2)
    prompt = torch.tensor([1, 4, 2])
    expected = _exact_joint(model, prompt, sampling).flatten()
    n = 2000
    counts = torch.zeros(V * V)
    for i in range(n):
        out = speculative_generate(model, heads.proposer(model), prompt, spec, sampling, 3,
                                   generator=torch.Generator().manual_seed(i))
        counts[out.tokens[1] * V + out.tokens[2]] += 1
    tvd = 0.5 * (counts / n - expected).abs().sum().item()
    bound = 1.5 * (expected * (1 - expected) / n).sqrt().sum().item()
    assert tvd < bound, f"TVD {tvd:.4f} >= {bound:.4f}"


def test_fitting_the_targets_own_text_raises_tau(tiny_target):
    """A learnable task end to end: heads fitted on the target's greedy text draft it back, the MLP depths too."""
    from conftest import CORPUS

    model, tok = tiny_target
    prompts = [_ids(tok, text)[:6] for text in CORPUS[:3]]
    ids = torch.stack([torch.cat([p, torch.tensor(target_generate(model, p, 30).tokens)]) for p in prompts])
    batch, feats = _batch(ids), _features(model, ids)
    spec = TreeSpec(kind="chain", draft_length=5)

    def tau(heads):
        results = [speculative_generate(model, heads.eval().proposer(model), p, spec, Sampling(), 30) for p in prompts]
        assert all(r.tokens == target_generate(model, p, 30).tokens for r, p in zip(results, prompts))
        accepted = [a for r in results for a in r.accepted]
        return sum(a + 1 for a in accepted) / len(accepted), max(accepted)

    heads = _heads(model, feature_noise=0.0)
    before, _ = tau(heads)
    losses = _fit(heads, batch, feats, 60)
    after, longest = tau(heads)
    print(f"tau {before:.2f} -> {after:.2f}, longest {longest}, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.75 * losses[0]       # the soft CE is bounded below by the target's entropy
    assert after > before + 0.5 and 1 <= after <= 6
    assert longest > 2                     # some round accepted a token drafted by an MLP head


def test_config_round_trip_and_checkpoint_give_identical_drafts(tiny_target, tmp_path):
    from draftlab.checkpoint import save_drafter
    from draftlab.drafters import load_drafter

    model, tok = tiny_target
    heads = _heads(model, seed=5, mlp_decay=0.7).eval()
    with torch.no_grad():
        for p in heads.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
    config = json.loads(json.dumps(heads.drafter_config()))
    assert config["kind"] == "gumiho" and config["serial_tokens"] == 2 and config["mlp_decay"] == 0.7
    loaded = load_drafter(save_drafter(heads, tmp_path / "step_1"), model).eval()
    assert isinstance(loaded, GumihoHeads) and loaded.mlp_heads == 3
    prompt = _ids(tok, "The quick brown fox")
    for spec in SPECS:
        a = _start(heads, model, prompt).propose(spec, Sampling(), None)
        b = _start(loaded, model, prompt).propose(spec, Sampling(), None)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents), spec.kind
    with pytest.raises(ValueError, match="hidden_size"):
        GumihoHeads.from_config({**config, "target": {**config["target"], "hidden_size": 32}}, model)


def test_official_layout_export_loads_back(tiny_target, tmp_path, monkeypatch):
    """The export's names are the reference code's (fc, layers, mlp.mlp.{i}.{j}.linear, embed_tokens); mapped back
    onto a fresh head they give the same drafts."""
    from safetensors.torch import load_file

    from draftlab import hub
    from draftlab.checkpoint import save_drafter

    model, tok = tiny_target
    heads = _heads(model, seed=2, mlp_layers=5, fc_bias=False).eval()
    with torch.no_grad():
        for mlp in heads.mlps:
            mlp[0].weight.normal_(0, 0.05)
    run = tmp_path / "run"
    save_drafter(heads, run / "step_1")
    (run / "best").write_text("step_1\n")
    out = hub.export_checkpoint(run, tmp_path / "export", target=model, tokenizer=tok, repo_id="me/gumiho",
                                target_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    config = json.loads((out / "config.json").read_text())
    assert config["serial_head_num"] == 2 and config["mlp_num"] == 3 and config["num_hidden_layers"] == 1
    assert config["hidden_size"] == model.config.hidden_size and config["bias"] is True
    weights = load_file(str(out / "model.safetensors"))
    assert set(torch.load(out / "pytorch_model.bin")) == set(weights)
    mlp_names = {n for n in weights if n.startswith("mlp.mlp.")}
    assert mlp_names == {f"mlp.mlp.{i}.{j}.linear.{p}" for i in range(3) for j in range(6) for p in ("weight", "bias")}
    assert not weights["fc.bias"].any() and "embed_tokens.weight" in weights
    assert "layers.0.input_layernorm.weight" not in weights
    assert "official Gumiho code" in (out / "README.md").read_text()

    back = {}
    for name, value in weights.items():
        if name.startswith("mlp.mlp."):
            i, j, rest = name.removeprefix("mlp.mlp.").split(".", 2)
            name = f"mlps.{i}.0.{rest.removeprefix('linear.')}" if j == "0" else f"mlps.{i}.{int(j) + 1}.{rest}"
        back[name] = value
    fresh = _heads(model, seed=9, mlp_layers=5, fc_bias=True).eval()
    own = {n for n, p in fresh.named_parameters() if p.requires_grad}
    fresh.load_state_dict({n: back[n] for n in own}, strict=False)
    assert own <= set(back)
    prompt = _ids(tok, "Numbers: 0 1 2 3")
    a = _start(heads, model, prompt).propose(SPECS[0], Sampling(), None)
    b = _start(fresh, model, prompt).propose(SPECS[0], Sampling(), None)
    assert torch.equal(a.tokens, b.tokens)


def test_recipe_trains_evaluates_losslessly_and_resumes(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path):
    """recipe=gumiho_heads composes, trains with lossless in-loop evaluation; 4 steps straight == 2 + resume 2."""
    from safetensors.torch import load_file

    from draftlab.config import load_config
    from draftlab.train import main

    def run(out, steps, *extra):
        main(load_config(["recipe=gumiho_heads", f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}",
                          f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}", "eval.num_prompts=2",
                          "eval.max_new_tokens=16", "eval.every=2", f"train.max_steps={steps}", "train.batch_size=4",
                          "train.grad_accum=1", "train.warmup_steps=0", "train.lr=1e-3", "train.schedule=constant",
                          "data.max_length=160", "tracking=none", "drafter.serial_layers=1", "drafter.mlp_heads=3",
                          "drafter.mlp_layers=1", "drafter.feature_noise=0.0", "eval.depth=5", "eval.top_k=3",
                          "eval.total_tokens=10", "train.save_every=2", "train.num_threads=1", *extra]))

    straight, split = tmp_path / "straight", tmp_path / "split"
    run(straight, 4)
    run(split, 2)
    run(split, 4, "train.resume=auto")
    for step in (2, 4):
        report = json.loads((straight / f"step_{step}" / "eval.json").read_text())
        assert report["lossless"] is True and 1 <= report["acceptance_length"] <= 5 + 1, step
    a, b = (load_file(str(r / "step_4" / "model.safetensors")) for r in (straight, split))
    assert a.keys() == b.keys() and any(k.startswith("mlps.") for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_trains_from_an_offline_feature_store(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path):
    """data.store: the same features from a store built on first use instead of a target forward per step."""
    import shutil

    from draftlab.config import load_config
    from draftlab.train import main

    data = tmp_path / "chat.jsonl"
    shutil.copy(tiny_chat_file, data)
    out = tmp_path / "run"
    main(load_config(["recipe=gumiho_heads", f"target.path={tiny_target_dir}", f"data.train={data}",
                      f"data.store={data}.store", f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}",
                      "eval.num_prompts=2", "eval.max_new_tokens=16", "eval.every=2", "eval.tree=chain",
                      "eval.draft_length=5", "train.max_steps=2", "train.batch_size=4", "train.warmup_steps=0",
                      "data.max_length=160", "tracking=none", "drafter.serial_layers=1", "drafter.mlp_heads=3",
                      "drafter.mlp_layers=1", "train.num_threads=1"]))
    assert json.loads((tmp_path / "chat.jsonl.store" / "manifest.json").read_text())["complete"]
    report = json.loads((out / "step_2" / "eval.json").read_text())
    assert report["lossless"] is True and 1 <= report["acceptance_length"] <= 6
