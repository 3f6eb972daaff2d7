"""Medusa heads and Medusa-2: heads start as the LM head, head k (1-based) learns token t+1+k, the static tree
from measured accuracies, Cartesian candidates, save -> load, lossless greedy speculation (chain, static,
dynamic) untrained and trained, and Medusa-2's adapters (KL reference, evaluation against the adapted target)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from draftlab.drafters.medusa import MedusaHeads, choices_from_accuracy, prior_accuracy
from draftlab.drafters.medusa2 import Medusa2Lora
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling
from draftlab.drafters import load_drafter


def _heads(model, **cfg) -> MedusaHeads:
    torch.manual_seed(0)
    return MedusaHeads.from_target(model, SimpleNamespace(**cfg))


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text)["input_ids"])


def _last_state(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states[-1]


def _batch(ids: torch.Tensor, loss_mask=None) -> dict:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids) if loss_mask is None else loss_mask}


@pytest.fixture(scope="module")
def dataset(tiny_target, tiny_chat_file):
    from draftlab.data import ChatDataset, read_conversations

    return ChatDataset(read_conversations(tiny_chat_file)[0], tiny_target[1], 160)


def test_heads_start_as_the_lm_head(tiny_target):
    model, tok = tiny_target
    heads = _heads(model, medusa_heads=3, medusa_layers=2)
    trainable = {n for n, p in heads.named_parameters() if p.requires_grad}
    assert trainable == set(heads.state_dict()) and all(n.startswith("heads.") for n in trainable)
    assert not model.get_output_embeddings().weight.requires_grad
    assert heads.heads[0][0] is not heads.heads[0][1]              # two ResBlocks, not one shared module
    h = _last_state(model, _ids(tok, "The quick brown fox")[None])[0]
    logits = heads.head_logits(h)
    assert logits.shape == (3, h.shape[0], model.config.vocab_size)
    for k in range(3):
        torch.testing.assert_close(logits[k], model.get_output_embeddings()(h))


def test_head_k_predicts_token_t_plus_1_plus_k(tiny_target):
    """On a toy sequence whose hidden state at t is one-hot(t), training makes head k (1-based) output x_{t+1+k}."""
    model, _ = tiny_target
    heads = _heads(model, medusa_heads=3, medusa_layers=1, medusa_weight=1.0)
    T, d = 16, model.config.hidden_size
    ids = (torch.arange(T) * 7 + 11)[None] % model.config.vocab_size       # distinct tokens
    hidden = torch.eye(T, d)[None] * 4
    opt = torch.optim.Adam(heads.parameters(), lr=0.05)
    for _ in range(60):
        loss, _ = heads.loss(_batch(ids), hidden)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        guesses = heads.head_logits(hidden[0]).argmax(-1)                  # [K, T]
    for k in range(1, 4):
        t = torch.arange(T - 1 - k)
        assert torch.equal(guesses[k - 1, t], ids[0, t + 1 + k]), k

    # The gradient reaches exactly the positions t = p-1-k when only x_p is a label.
    p = 10
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, p] = 1
    x = torch.randn(1, T, d, requires_grad=True)
    heads.loss(_batch(ids, loss_mask), x)[0].backward()
    touched = (x.grad[0].abs().sum(-1) > 0).nonzero().flatten().tolist()
    assert touched == sorted(p - 1 - k for k in range(1, 4))


def test_tree_choices_from_accuracies():
    acc = torch.tensor([[0.9, 0.05, 0.01], [0.5, 0.4, 0.01]])
    assert choices_from_accuracy(acc, 3) == [[0], [0, 0], [0, 1]]
    acc = prior_accuracy(4)
    choices = choices_from_accuracy(acc, 30)
    assert len(choices) == 30 and len({tuple(c) for c in choices}) == 30
    chosen = {tuple(c) for c in choices}
    assert all(c[:-1] in chosen for c in chosen if len(c) > 1)        # prefix-closed
    value = lambda p: float(torch.prod(torch.stack([acc[k, i] for k, i in enumerate(p)])))
    frontier = [c + (i,) for c in chosen | {()} if len(c) < 4 for i in range(10)]
    best_left = max(value(c) for c in frontier if c not in chosen)
    assert min(value(c) for c in chosen) >= best_left                   # the best prefix-closed set


@pytest.mark.parametrize("seed", range(5))
def test_tree_choices_have_no_rank_gaps(seed):
    """Measured accuracies need not fall with the rank; the tree still takes a parent's ranks in order."""
    from draftlab.trees import static_tree_layout

    acc = torch.rand(4, 10, generator=torch.Generator().manual_seed(seed))
    choices = choices_from_accuracy(acc, 24)
    assert len(choices) == 24
    chosen = {tuple(c) for c in choices}
    assert all(c[:-1] + (c[-1] - 1,) in chosen for c in chosen if c[-1] > 0)
    static_tree_layout(choices)                                          # and the layout accepts it


def _train(heads, model, tok, dataset, steps: int):
    from draftlab.data import collate

    opt = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=3e-3)
    heads.train()
    metrics = {}
    for step in range(steps):
        batch = collate(dataset.rows[4 * step: 4 * step + 4], tok.pad_token_id)
        features = None if isinstance(heads, Medusa2Lora) else _last_state(model, batch["input_ids"])
        loss, metrics = heads.loss(batch, features)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval(), metrics


def _proposer_after_prefill(heads, model, prompt):
    proposer = heads.proposer(model)
    proposer.reset(prompt)
    with torch.no_grad():
        out = model(prompt[None], output_hidden_states=True)
    proposer.commit(out.logits[0, -1].argmax().view(1), out.hidden_states[-1][0])
    return proposer, out.hidden_states[-1][0, -1]


def test_measured_tree_and_cartesian_candidates(tiny_target, dataset, tmp_path, monkeypatch):
    from draftlab import checkpoint
    from draftlab.drafters import DRAFTERS
    from draftlab.trees import EAGLE_DEFAULT_CHOICES, static_tree_layout

    model, tok = tiny_target
    untrained = _heads(model, medusa_tree_nodes=12).drafter_config()
    assert untrained["accuracy_measured"] is False and len(untrained["tree_choices"]) == 12
    heads, metrics = _train(_heads(model, medusa_heads=3, medusa_tree_nodes=12), model, tok, dataset, 4)
    assert {"loss_0", "acc_0", "loss_2", "acc_2"} <= set(metrics)
    config = json.loads(json.dumps(heads.drafter_config()))
    acc = torch.tensor(config["head_accuracy"])
    assert config["accuracy_measured"] and acc.shape == (3, 10) and (acc >= 0).all() and (acc.sum(-1) <= 1 + 1e-6).all()
    assert config["tree_choices"] == choices_from_accuracy(acc, 12)

    prompt = _ids(tok, "<|im_start|>user\nNumbers: 0 1 2<|im_end|>\n<|im_start|>assistant\n")
    proposer, h = _proposer_after_prefill(heads, model, prompt)
    ranked = heads.head_logits(h).argsort(-1, descending=True)              # [K, V]
    tree = proposer.propose(TreeSpec(kind="static"), Sampling(), None)       # TreeSpec's default: own tree
    parents, ranks = static_tree_layout(config["tree_choices"])
    assert torch.equal(tree.parents, parents) and tree.proposal == "topk"
    for node in range(len(tree)):                                           # head d's rank-r token, any parent
        assert tree.tokens[node] == ranked[int(tree.depths[node]) - 1, int(ranks[node])]
    explicit = proposer.propose(TreeSpec(kind="static", choices=[[0], [1], [0, 0], [1, 0]]), Sampling(), None)
    assert explicit.tokens.tolist() == [ranked[0, 0], ranked[0, 1], ranked[1, 0], ranked[1, 0]]
    deep = proposer.propose(TreeSpec(kind="static", choices=EAGLE_DEFAULT_CHOICES[:20] + [[0, 0, 0, 0]]),
                            Sampling(), None)
    assert deep.max_depth <= 3                                               # paths deeper than K are dropped
    chain = proposer.propose(TreeSpec(kind="chain", draft_length=5), Sampling(), None)
    assert chain.tokens.tolist() == ranked[:, 0].tolist()                    # K = 3 tokens at most

    monkeypatch.setitem(DRAFTERS, "medusa", MedusaHeads)
    checkpoint.save_drafter(heads, tmp_path / "step_4")
    loaded = load_drafter(tmp_path / "step_4", model).eval()
    assert loaded.tree_choices() == config["tree_choices"]
    again = _proposer_after_prefill(loaded, model, prompt)[0].propose(TreeSpec(kind="static"), Sampling(), None)
    assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)


def _plain(model, tok, prompt, n):
    with torch.no_grad():
        return model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()


SPECS = [TreeSpec(kind="chain", draft_length=4), TreeSpec(kind="static"),
         TreeSpec(kind="dynamic", depth=4, top_k=3, total_tokens=12)]


@pytest.mark.parametrize("steps", [0, 3])
def test_greedy_speculation_is_lossless(tiny_target, dataset, steps):
    from draftlab.evaluator import speculative_generate

    model, tok = tiny_target
    heads, _ = _train(_heads(model, medusa_tree_nodes=20), model, tok, dataset, steps)
    prompt = _ids(tok, "<|im_start|>user\nRepeat: Write a short poem<|im_end|>\n<|im_start|>assistant\n")
    plain = _plain(model, tok, prompt, 16)
    for spec in SPECS:
        result = speculative_generate(model, heads.proposer(model), prompt, spec, Sampling(), 16)
        assert result.tokens == plain, spec.kind
        assert 1 <= result.new_tokens / result.rounds <= min(spec.max_depth, 4) + 1


def test_medusa2_adapts_the_target_and_is_lossless_against_it(tiny_tokenizer, dataset, tmp_path, monkeypatch):
    from conftest import build_tiny_llama

    from draftlab import checkpoint
    from draftlab.data import collate
    from draftlab.drafters import DRAFTERS
    from draftlab.evaluator import speculative_generate, target_generate

    tok = tiny_tokenizer
    model = build_tiny_llama(tok).requires_grad_(False)                       # its own copy: it gets adapted
    original = build_tiny_llama(tok).requires_grad_(False)
    torch.manual_seed(0)
    drafter = Medusa2Lora.from_target(model, SimpleNamespace(lora_r=4, lora_alpha=8, medusa_heads=3,
                                                             medusa_tree_nodes=16, kl_weight=1.0))
    assert drafter.kind == "medusa2" and drafter.feature_layers == ()
    trainable = [n for n, p in drafter.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any(n.startswith("heads.") for n in trainable)
    assert all("lora_" in n or n.startswith("heads.") for n in trainable)
    ids = _ids(tok, "Speculative decoding drafts tokens")[None]
    _, metrics = drafter.loss(_batch(ids))
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6) and metrics["agree"] == 1.0     # LoRA B starts at 0

    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=2e-2)
    drafter.train()
    assert not drafter.backbone.training                                    # the target itself stays in eval mode
    for step in range(4):
        batch = collate(dataset.rows[4 * step: 4 * step + 4], tok.pad_token_id)
        loss, metrics = drafter.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    with torch.no_grad():
        adapted, reference = model(ids).logits, original(ids).logits
        with drafter.original_target() as off:
            torch.testing.assert_close(off(ids).logits, reference)
    assert not torch.allclose(adapted, reference, atol=1e-4)                 # the served model changed
    assert drafter.loss(_batch(ids))[1]["kl"] > 0

    # Speculation reproduces the ADAPTED target's own greedy decoding exactly.
    prompt = _ids(tok, "<|im_start|>user\nThe quick brown fox<|im_end|>\n<|im_start|>assistant\n")
    served = target_generate(model, prompt, 20).tokens
    for spec in SPECS:
        assert speculative_generate(model, drafter.proposer(model), prompt, spec, Sampling(), 20).tokens == served
    with pytest.raises(ValueError, match="adapted target"):
        drafter.proposer(original)
    with pytest.raises(ValueError, match="already carries LoRA"):
        Medusa2Lora.from_target(model, None)

    # Save -> load onto a fresh copy of the original target: the same adapted model and heads.
    monkeypatch.setitem(DRAFTERS, "medusa2", Medusa2Lora)
    checkpoint.save_drafter(drafter, tmp_path / "step_4")
    fresh = build_tiny_llama(tok).requires_grad_(False)
    loaded = load_drafter(tmp_path / "step_4", fresh).eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, adapted)
        h = fresh(ids, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(loaded.head_logits(h), drafter.head_logits(h))
    assert speculative_generate(fresh, loaded.proposer(fresh), prompt, SPECS[1], Sampling(), 20).tokens == served


@pytest.mark.parametrize("recipe", ["medusa_heads", "medusa2_lora"])
def test_recipes_train_with_lossless_in_loop_evaluation(recipe, tiny_target_dir, tiny_chat_file, tiny_prompt_file,
                                                        tmp_path):
    """Each recipe composes, trains and evaluates in the loop. Two evaluations:
    for medusa2 the second runs after the target's adapters changed, so its baseline must follow them."""
    from draftlab.config import load_config
    from draftlab.train import main

    out = tmp_path / "run"
    main(load_config([f"recipe={recipe}", f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}",
                      f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}", "eval.num_prompts=2",
                      "eval.max_new_tokens=16", "eval.every=1", "train.max_steps=2", "train.batch_size=4",
                      "train.grad_accum=1", "train.warmup_steps=0", "train.lr=1e-2", "data.max_length=160",
                      "tracking=none", "drafter.medusa_tree_nodes=16",
                      *(["drafter.lora_r=4"] if recipe == "medusa2_lora" else [])]))
    for step in (1, 2):
        report = json.loads((out / f"step_{step}" / "eval.json").read_text())
        assert report["lossless"] is True and 1 <= report["acceptance_length"] <= 4 + 1, step
    config = json.loads((out / "step_2" / "drafter_config.json").read_text())
    assert config["accuracy_measured"] and len(config["tree_choices"]) == 16
