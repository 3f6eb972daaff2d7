"""DFlashDrafter (drafters/dflash.py): the training block mask, anchors, the decayed block loss by hand, training's
block output against inference's, save -> load, resume, lossless greedy and sampled speculation, tau bounds, a
learnable toy task, and the DFlash export read back by `draftlab eval` as a foreign folder."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from draftlab.drafters.dflash import DFlashDrafter, block_mask, default_target_layers, sample_anchors
from draftlab.evaluator import speculative_generate
from draftlab.losses import block_cross_entropy
from draftlab.target import target_features
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling

SPECS = [TreeSpec(kind="chain", draft_length=3), TreeSpec(kind="dynamic", depth=3, top_k=3, total_tokens=10),
         TreeSpec(kind="static")]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread is many times faster than several on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tiny_target_4_layers):
    return tiny_target_4_layers


def _drafter(model, **cfg) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter.from_target(model, SimpleNamespace(**{"num_layers": 2, "block_size": 4, **cfg}))


def _ids(tok, text: str) -> torch.Tensor:
    return torch.tensor(tok(text)["input_ids"])


def _features(model, ids: torch.Tensor, layers) -> torch.Tensor:
    with torch.no_grad():
        return target_features(model(ids, output_hidden_states=True).hidden_states, layers)


def _batch(ids: torch.Tensor, loss_mask=None) -> dict:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids) if loss_mask is None else loss_mask}


def test_defaults_follow_the_method(target):
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33] and default_target_layers(32, 1) == [16]
    model, _ = target
    drafter = _drafter(model)
    assert drafter.target_layers == [1, 1] and drafter.feature_layers == (2, 2)     # outputs of layer i: index i+1
    assert drafter.fc.in_features == 2 * model.config.hidden_size
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert trainable == set(drafter.state_dict()) and not any("embed" in n or "lm_head" in n for n in trainable)
    assert {"layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight", "hidden_norm.weight",
            "fc.weight", "norm.weight"} <= trainable
    with pytest.raises(ValueError, match="target_layers"):
        _drafter(model, target_layers=[3])           # the last layer's output is the final-norm state


def test_a_chain_longer_than_the_block_is_refused_before_loading():
    from draftlab.config import load_config
    from draftlab.errors import ConfigError

    with pytest.raises(ConfigError, match="draft_length=5 exceeds the 3 tokens"):
        load_config(["recipe=dflash_head", "drafter.block_size=4", "eval.draft_length=5", "target.path=x",
                     "data.train=y"])


def test_block_mask_keeps_context_causal_and_blocks_apart():
    docs = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2, 0, 0]])            # two packed conversations, then padding
    anchors, keep = torch.tensor([[2, 5, 0]]), torch.tensor([[True, True, False]])
    bs, T = 3, 10
    mask = block_mask(anchors, keep, docs, bs)[0]
    assert mask.shape == (3 * bs, T + 3 * bs)
    context, blocks = mask[:, :T], mask[:, T:]
    assert context[:bs].nonzero()[:, 1].unique().tolist() == [0, 1]          # before anchor 2, same conversation
    assert context[bs:2 * bs].nonzero()[:, 1].unique().tolist() == [4]       # conversation 2 starts at 4, anchor 5
    assert not context[2 * bs:].any()                                        # an unused block sees no context
    block_of = torch.arange(3 * bs) // bs
    assert torch.equal(blocks, block_of[:, None] == block_of[None, :])      # bidirectional inside, nothing across


def test_no_block_sees_another_block_or_the_context_after_its_anchor(target):
    """Block n's output depends on the context before its anchor and its own block only: changing the features
    at and after the anchor, and the tokens of every other block, changes nothing; the context's keys come from
    the target's features alone (it is never a query), so no context position sees a block token."""
    model, tok = target
    drafter = _drafter(model, num_anchors=3).eval()
    ids = _ids(tok, "The quick brown fox jumps over the lazy dog again and again")[None]
    feats = _features(model, ids, drafter.feature_layers)
    T, bs = ids.shape[1], drafter.block_size
    anchors, keep = torch.tensor([[2, 5, 8]]), torch.ones(1, 3, dtype=torch.bool)
    docs, positions = torch.ones_like(ids), torch.arange(T)[None]

    def run(features, block_ids):
        from draftlab.trees import additive

        mask = additive(block_mask(anchors, keep, docs, bs)[:, None], torch.float32)
        kv = drafter.context_kv(drafter.context(features), positions)
        pos = (anchors[..., None] + torch.arange(bs)).view(1, -1)
        with torch.no_grad():
            return drafter.block_states(block_ids, pos, kv, mask).view(3, bs, -1)

    blocks = torch.full((1, 3 * bs), drafter.mask_token_id)
    blocks[0, ::bs] = ids[0, anchors[0]]
    base = run(feats, blocks)
    changed_feats = feats.clone()
    changed_feats[:, 5:] += torch.randn_like(changed_feats[:, 5:])
    changed_blocks = blocks.clone()
    changed_blocks[0, 0] = (changed_blocks[0, 0] + 1) % model.config.vocab_size     # block 0's anchor token
    changed_blocks[0, 2 * bs:] = 7                                                  # block 2, whole
    out = run(changed_feats, changed_blocks)
    torch.testing.assert_close(out[1], base[1])       # block 1 (anchor 5): features >= 5 and other blocks changed
    assert not torch.allclose(out[0], base[0]) and not torch.allclose(out[2], base[2])


def test_training_blocks_compute_what_inference_drafts(target):
    """The block at anchor a in training (all anchors in one forward) gives the logits the proposer drafts after
    committing x_0..x_a, with the target's features of positions 0..a-1."""
    model, tok = target
    drafter = _drafter(model, num_anchors=4).eval()
    ids = _ids(tok, "Numbers: 0 1 2 3 4 5 6 7 8 9")[None]
    feats = _features(model, ids, drafter.feature_layers)
    T, bs = ids.shape[1], drafter.block_size
    anchors = torch.tensor([[1, 4, 6, 9]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    from draftlab.trees import additive

    mask = additive(block_mask(anchors, keep, torch.ones_like(ids), bs)[:, None], torch.float32)
    blocks = torch.full((1, 4 * bs), drafter.mask_token_id)
    blocks[0, ::bs] = ids[0, anchors[0]]
    with torch.no_grad():
        kv = drafter.context_kv(drafter.context(feats), torch.arange(T)[None])
        trained = drafter.block_states(blocks, (anchors[..., None] + torch.arange(bs)).view(1, -1), kv, mask)
        trained = drafter.logits(trained.view(4, bs, -1)[:, 1:])
    for n, a in enumerate(anchors[0].tolist()):
        proposer = drafter.proposer(model)
        proposer.reset(ids[0, :a])
        proposer.commit(ids[0, a:a + 1], feats[0, :a])
        proposer.root()
        torch.testing.assert_close(proposer.logits, trained[n], atol=1e-4, rtol=1e-4)


def test_anchors_are_distinct_candidates_in_order():
    torch.manual_seed(0)
    candidates = torch.zeros(3, 20, dtype=torch.bool)
    candidates[0, 3:15] = True
    candidates[1, [4, 9]] = True
    anchors, keep = sample_anchors(candidates, 5)
    assert anchors.shape == (3, 5) and keep.sum(1).tolist() == [5, 2, 0]
    for row in range(3):
        chosen = anchors[row][keep[row]].tolist()
        assert chosen == sorted(set(chosen)) and all(candidates[row, a] for a in chosen)
    assert anchors[1][keep[1]].tolist() == [4, 9]


def test_block_loss_equals_the_hand_computed_one():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 3.0, 1.0]]])     # positions k = 1, 2, 3
    labels, offsets = torch.tensor([[0, 2, 1]]), torch.tensor([[1, 2, 3]])
    mask = torch.tensor([[1, 1, 0]])                                                   # k = 3 not counted
    gamma = 2.0

    def nll(row, label):
        return -(row[label] - math.log(sum(math.exp(v) for v in row)))

    rows = logits[0].tolist()
    expected = (nll(rows[0], 0) * 1.0 + nll(rows[1], 2) * math.exp(-1 / gamma)) / 2
    got = block_cross_entropy(logits, labels, mask, offsets, gamma)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    assert block_cross_entropy(logits, labels, mask, offsets, 0.0).item() == pytest.approx(
        (nll(rows[0], 0) + nll(rows[1], 2)) / 2, rel=1e-6)                               # no decay
    padded = block_cross_entropy(torch.cat([logits, logits], 1), torch.cat([labels, labels], 1),
                                 torch.cat([mask, torch.zeros_like(mask)], 1), torch.cat([offsets, offsets], 1), gamma)
    assert padded.item() == pytest.approx(expected, rel=1e-6)
    empty = block_cross_entropy(logits.requires_grad_(), labels, torch.zeros_like(mask), offsets, gamma)
    empty.backward()
    assert empty.item() == 0 and not logits.grad.any()


def test_loss_counts_assistant_labels_inside_each_conversation(target):
    model, tok = target
    drafter = _drafter(model, num_anchors=64)
    ids = _ids(tok, "The quick brown fox jumps over the lazy dog")[None]
    feats = _features(model, ids, drafter.feature_layers)
    loss, metrics = drafter.loss(_batch(ids), feats)
    assert torch.isfinite(loss) and loss > 0 and {"acc", "acc_1", "acc_3", "accept"} <= set(metrics)
    loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0
    nothing = drafter.loss(_batch(ids, torch.zeros_like(ids)), feats)[0]          # no assistant token
    assert nothing.item() == 0


def _fitted(model, ids, steps, **cfg):
    drafter = _drafter(model, **cfg)
    feats = _features(model, ids, drafter.feature_layers)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    drafter.train()
    for _ in range(steps):
        loss, _ = drafter.loss(_batch(ids), feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.mark.parametrize("steps", [0, 5])
def test_greedy_speculation_is_lossless_and_tau_is_bounded(target, steps):
    model, tok = target
    ids = _ids(tok, "The quick brown fox jumps over the lazy dog")[None]
    drafter = _fitted(model, ids, steps)
    prompt = _ids(tok, "<|im_start|>user\nRepeat: The quick brown fox<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        plain = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    for spec in SPECS:
        result = speculative_generate(model, drafter.proposer(model), prompt, spec, Sampling(), 16)
        assert result.tokens == plain, spec.kind
        tau = result.new_tokens / result.rounds
        assert 1 <= tau <= min(spec.max_depth, drafter.block_size - 1) + 1


def test_the_chain_is_the_blocks_argmax(target):
    model, tok = target
    drafter = _drafter(model, block_size=6).eval()
    prompt = _ids(tok, "Numbers: 0 1 2 3")
    proposer = drafter.proposer(model)
    proposer.reset(prompt)
    with torch.no_grad():
        out = model(prompt[None], output_hidden_states=True)
    proposer.commit(out.logits[0, -1].argmax().view(1), target_features(out.hidden_states, drafter.feature_layers)[0])
    for k in (1, 3, 5, 9):
        tree = proposer.propose(TreeSpec(kind="chain", draft_length=k), Sampling(), None)
        assert tree.tokens.tolist() == proposer.logits.argmax(-1)[:min(k, 5)].tolist()


def test_sampled_speculation_emits_the_target_distribution():
    """On a 6-token target, the second and third emitted tokens of sampled DFlash speculation follow the target's
    joint distribution (statistical test; drafts drawn independently per block position)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_draft_vocab import V, _exact_joint  # the exact joint of two emitted tokens over a V-token target

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False)).eval()
    drafter = DFlashDrafter.from_target(model, SimpleNamespace(num_layers=1, block_size=3, target_layers=[0, 1],
                                                               mask_token_id=5)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn_like(p))
    sampling, spec = Sampling(temperature=1.0), TreeSpec(kind="chain", draft_length=2)
    prompt = torch.tensor([1, 4, 2])
    expected = _exact_joint(model, prompt, sampling).flatten()
    n, counts, accepted = 1000, torch.zeros(V * V), 0
    for i in range(n):
        out = speculative_generate(model, drafter.proposer(model), prompt, spec, sampling, 3,
                                   generator=torch.Generator().manual_seed(i))
        counts[out.tokens[1] * V + out.tokens[2]] += 1
        accepted += sum(out.accepted)
    assert accepted > 0                                # drafts were accepted, so the rejection rule was exercised
    tvd = 0.5 * (counts / n - expected).abs().sum().item()
    bound = 1.5 * (expected * (1 - expected) / n).sqrt().sum().item()
    assert tvd < bound, f"TVD {tvd:.4f} >= {bound:.4f}"


def test_fitting_the_targets_own_text_raises_tau(target):
    """A drafter fitted on the target's greedy text drafts that text back: tau rises."""
    from conftest import CORPUS

    model, tok = target
    prompts = [_ids(tok, text)[:6] for text in CORPUS[:3]]
    with torch.no_grad():
        ids = torch.stack([model.generate(p[None], attention_mask=torch.ones(1, 6, dtype=torch.long),
                                          max_new_tokens=30, do_sample=False, eos_token_id=None,
                                          pad_token_id=tok.pad_token_id)[0] for p in prompts])
    spec = TreeSpec(kind="chain", draft_length=3)

    def tau(drafter):
        results = [speculative_generate(model, drafter.eval().proposer(model), p, spec, Sampling(), 30)
                   for p in prompts]
        return sum(r.new_tokens for r in results) / sum(r.rounds for r in results)

    before = tau(_drafter(model))
    after = tau(_fitted(model, ids, 60, num_anchors=64))
    assert after > before + 0.5, (before, after)


def test_save_load_gives_identical_drafts(target, tmp_path):
    from draftlab.checkpoint import save_drafter
    from draftlab.drafters import load_drafter

    model, tok = target
    drafter = _fitted(model, _ids(tok, "The quick brown fox jumps")[None], 3, mask_token_id=7)
    config = json.loads(json.dumps(drafter.drafter_config()))
    assert config["kind"] == "dflash" and config["mask_token_id"] == 7 and config["target_layers"] == [1, 1]
    loaded = load_drafter(save_drafter(drafter, tmp_path / "step_3"), model).eval()
    prompt = _ids(tok, "The quick brown fox")
    trees = []
    for d in (drafter, loaded):
        proposer = d.proposer(model)
        proposer.reset(prompt)
        with torch.no_grad():
            out = model(prompt[None], output_hidden_states=True)
        proposer.commit(out.logits[0, -1].argmax().view(1), target_features(out.hidden_states, d.feature_layers)[0])
        trees.append((proposer.propose(SPECS[1], Sampling(), None), proposer.logits))
    assert torch.equal(trees[0][0].tokens, trees[1][0].tokens) and torch.equal(trees[0][1], trees[1][1])


def _args(target_dir, data, prompts, out, *extra):
    return ["recipe=dflash_head", f"target.path={target_dir}", f"data.train={data}", f"data.eval_prompts={prompts}",
            f"out_dir={out}", "drafter.num_layers=1", "drafter.block_size=4", "drafter.num_anchors=16",
            "eval.num_prompts=2", "eval.max_new_tokens=12", "eval.draft_length=3", "train.batch_size=2",
            "train.warmup_steps=0", "train.schedule=constant", "train.lr=1e-3", "data.max_length=160",
            "train.pack_tokens=0", "tracking=none", "train.keep_last=0", *extra]


def test_recipe_trains_resumes_bit_identically_and_evaluates(tiny_target_dir, tiny_chat_file, tiny_prompt_file,
                                                            tmp_path):
    """recipes/dflash_head.yaml: in-loop evaluation is lossless with 1 <= tau <= k+1, and 2 steps + resume for 2
    more ends with the weights of 4 steps straight."""
    from safetensors.torch import load_file

    from draftlab.config import load_config
    from draftlab.train import main

    straight, split = tmp_path / "straight", tmp_path / "split"
    main(load_config(_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, straight, "train.max_steps=4",
                           "eval.every=2")))
    for step in (2, 4):
        report = json.loads((straight / f"step_{step}" / "eval.json").read_text())
        assert report["lossless"] is True and 1 <= report["acceptance_length"] <= 3 + 1
    assert (straight / "best").is_file()
    main(load_config(_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, split, "train.max_steps=2",
                           "eval.every=0")))
    main(load_config(_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, split, "train.max_steps=4",
                           "eval.every=0", "train.resume=auto")))
    a, b = (load_file(str(run / "step_4" / "model.safetensors")) for run in (straight, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra", [["train.pack_tokens=400"], ["data.store={tmp}/store"]], ids=["packed", "store"])
def test_packed_rows_and_an_offline_store_train(tiny_target_dir, tiny_chat_file, tiny_prompt_file, tmp_path, extra):
    from draftlab.config import load_config
    from draftlab.train import main

    out = tmp_path / "run"
    summary = main(load_config(_args(tiny_target_dir, tiny_chat_file, tiny_prompt_file, out, "train.max_steps=2",
                                     "eval.every=0", "tracking=jsonl", *[e.format(tmp=tmp_path) for e in extra])))
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(r["loss"]) and r["accept"] >= 1 for r in rows if "loss" in r)


def test_export_round_trip_gives_the_same_tau(tiny_target, tiny_target_dir, tiny_prompt_file, tmp_path, capsys):
    """draftlab push --to writes the DFlashDraftModel folder; `draftlab eval` on its config.json + weights alone
    (a foreign folder) scores the same tau as on the draftlab checkpoint."""
    from draftlab import hub
    from draftlab.cli import main
    from draftlab.foreign import find_foreign
    from test_hub import make_run
    from test_interop import native_copy

    model, tok = tiny_target                          # the model saved in tiny_target_dir
    drafter = _fitted(model, _ids(tok, "The quick brown fox jumps over the lazy dog")[None], 4, mask_token_id=9)
    run = make_run(tmp_path / "run", drafter, target_path=tiny_target_dir)
    export = tmp_path / "export"
    assert main(["push", str(run), "--to", str(export)]) == 0, capsys.readouterr().err
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    card = (export / "README.md").read_text()
    assert "--speculative-algorithm DFLASH" in card and "--spec-type draft-dflash" in card
    assert config["dflash_config"] == {"block_size": 4, "mask_token_id": 9, "target_layer_ids": [0, 0]}
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.1.mlp.down_proj.weight"} <= names and not any("embed" in n or "lm_head" in n for n in names)
    foreign = native_copy(export, tmp_path / "dflash", ("config.json", "model.safetensors"))
    assert find_foreign(str(foreign)).kind == "dflash"
    reports = {}
    for name, where in (("native", run), ("foreign", foreign)):
        out = tmp_path / f"{name}.json"
        code = main(["eval", "--checkpoint", str(where), "--target", tiny_target_dir, "--prompts", tiny_prompt_file,
                     "--out", str(out), "--num-prompts", "2", "--max-new-tokens", "12", "--draft-length", "3"])
        assert code == 0, capsys.readouterr().err
        reports[name] = json.loads(out.read_text())
    assert reports["foreign"]["lossless"] is True
    assert reports["foreign"]["acceptance_length"] == reports["native"]["acceptance_length"]
    assert reports["foreign"]["per_position_acceptance"] == reports["native"]["per_position_acceptance"]
