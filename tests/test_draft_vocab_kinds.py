"""Reduced draft vocabularies for small_lm, medusa / medusa2 and acceptance (EAGLE's are in test_draft_vocab.py):
drafting only inside the vocabulary without running the full LM head, greedy lossless for chains and trees,
save -> load keeps the vocabulary, training still lowers the loss, and the Medusa export widens the heads."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from draftlab import checkpoint as ckpt
from draftlab.data import ChatDataset, collate
from draftlab.drafters.acceptance import AcceptanceHead
from draftlab.drafters.medusa import MedusaHeads
from draftlab.drafters.medusa2 import Medusa2Lora
from draftlab.drafters.small_lm import SmallLM
from draftlab.evaluator import speculative_generate, target_generate
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling
from draftlab.drafters import load_drafter

SPECS = [TreeSpec(kind="chain", draft_length=4), TreeSpec(kind="dynamic", depth=3, top_k=3, total_tokens=10),
         TreeSpec(kind="static")]
SIZE = 32                    # draft vocabulary: 32 of the tiny tokenizer's ~320 tokens
TEXTS = ("The quick brown fox", "def add(a, b):")


@pytest.fixture(scope="module")
def dataset(tiny_target, tiny_chat_file):
    from draftlab.data import read_conversations

    conversations, _ = read_conversations(tiny_chat_file)
    return ChatDataset(conversations, tiny_target[1], 256)


@pytest.fixture(scope="module")
def references(tiny_target):
    """(prompt, greedy target-only output) pairs."""
    model, tok = tiny_target
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in TEXTS]
    return [(p, target_generate(model, p, 16).tokens) for p in prompts]


def _small_lm(model, dataset, **kw):
    torch.manual_seed(0)
    drafter = SmallLM.from_target(model, SimpleNamespace(num_layers=1, draft_vocab_size=SIZE, **kw))
    drafter.prepare(dataset)
    return drafter.eval()


def _no_full_head(monkeypatch, lm_head):
    """Any forward through the whole LM head (model(...).logits) fails the test."""
    def refuse(*_):
        raise AssertionError("the full LM head ran while drafting")
    monkeypatch.setattr(lm_head, "forward", refuse)


def _train(drafter, batch, steps: int) -> list[float]:
    """Adam steps on drafter.loss(*batch(step)) (batch -> (batch dict, features or None)); the losses."""
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    drafter.train()
    losses = []
    for step in range(steps):
        loss, _ = drafter.loss(*batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    drafter.eval()
    return losses


def _check_drafts(target, proposer, allowed: set[int], references, specs=SPECS):
    """Greedy speculation equals target-only decoding, and a tree proposed afterwards stays in `allowed`."""
    for spec in specs:
        for prompt, expected in references:
            assert speculative_generate(target, proposer, prompt, spec, Sampling(), 16).tokens == expected
        tree = proposer.propose(spec, Sampling(), None)
        assert len(tree) > 0 and set(tree.tokens.tolist()) <= allowed, spec.kind


def _check_sampled_chain(target, proposer, allowed: set[int], prompt):
    """A sampled chain draws inside the vocabulary from q [k, V] that is zero outside it and sums to 1."""
    speculative_generate(target, proposer, prompt, SPECS[0], Sampling(temperature=1.0), 1)    # prefill only
    tree = proposer.propose(SPECS[0], Sampling(temperature=1.0), torch.Generator().manual_seed(0))
    outside = torch.tensor([v not in allowed for v in range(tree.q.shape[1])])
    assert set(tree.tokens.tolist()) <= allowed and tree.q[:, outside].sum() == 0
    torch.testing.assert_close(tree.q.sum(-1), torch.ones(len(tree)))


# --- small_lm ------------------------------------------------------------------------------------------------

def test_small_lm_drafts_inside_its_vocabulary_without_the_full_head(tiny_target, dataset, references, monkeypatch):
    model, tok = tiny_target
    drafter = _small_lm(model, dataset)
    allowed = set(drafter.draft_head.draft_vocab.tolist())
    assert len(allowed) == SIZE
    _no_full_head(monkeypatch, drafter.model.get_output_embeddings())
    _check_drafts(model, drafter.proposer(model), allowed, references)
    _check_sampled_chain(model, drafter.proposer(model), allowed, references[0][0])


def test_small_lm_full_and_reduced_agree_where_the_argmax_is_draftable(tiny_target, dataset):
    """The draft rows are the model's own LM-head rows: restricted logits equal the full logits there."""
    model, tok = tiny_target
    drafter = _small_lm(model, dataset)
    ids = torch.tensor([tok("The quick brown fox jumps")["input_ids"]])
    with torch.no_grad():
        full = drafter(ids)[0]
        proposer = drafter.proposer(model)
        proposer.reset(ids[0])
        small = proposer.root()                              # draft logits after the last token
    torch.testing.assert_close(small, full[-1, drafter.draft_head.draft_vocab])


def test_small_lm_with_lora_drafts_through_the_peft_decoder(tiny_target, tiny_target_dir, dataset, references,
                                                            monkeypatch):
    model, _ = tiny_target
    drafter = _small_lm(model, dataset, init_from=tiny_target_dir, lora_r=4)
    assert hasattr(drafter.model, "peft_config")
    allowed = set(drafter.draft_head.draft_vocab.tolist())
    _no_full_head(monkeypatch, drafter.model.get_output_embeddings())
    _check_drafts(model, drafter.proposer(model), allowed, references, SPECS[:2])


def test_small_lm_checkpoint_keeps_the_vocabulary(tiny_target, dataset, tmp_path):
    from safetensors.torch import load_file

    model, tok = tiny_target
    drafter = _small_lm(model, dataset)
    folder = ckpt.save_drafter(drafter, tmp_path / "step_1")
    loaded = load_drafter(folder, model).eval()
    assert torch.equal(loaded.draft_head.draft_vocab, drafter.draft_head.draft_vocab)
    maps = load_file(str(folder / "d2t_t2d.safetensors"))
    assert torch.equal(maps["d2t"] + torch.arange(SIZE), drafter.draft_head.draft_vocab)
    prompt = torch.tensor(tok(TEXTS[0])["input_ids"])
    a = speculative_generate(model, drafter.proposer(model), prompt, SPECS[0], Sampling(), 12)
    b = speculative_generate(model, loaded.proposer(model), prompt, SPECS[0], Sampling(), 12)
    assert a.tokens == b.tokens and a.accepted == b.accepted


def test_small_lm_training_still_lowers_the_loss(tiny_target, dataset):
    model, tok = tiny_target
    batch = collate(dataset.rows[:4], tok.pad_token_id)
    losses = _train(_small_lm(model, dataset), lambda step: (batch, None), 15)
    assert losses[-1] < 0.7 * losses[0]


# --- medusa, medusa2 -----------------------------------------------------------------------------------------

def _medusa(model, dataset, cls=MedusaHeads, **kw):
    torch.manual_seed(0)
    heads = cls.from_target(model, SimpleNamespace(medusa_heads=3, medusa_tree_nodes=16, draft_vocab_size=SIZE, **kw))
    heads.prepare(dataset)
    return heads


def _train_medusa(heads, model, tok, dataset, steps: int) -> list[float]:
    def batch(step):
        rows = collate(dataset.rows[4 * (step % 4): 4 * (step % 4) + 4], tok.pad_token_id)
        with torch.no_grad():
            features = None if isinstance(heads, Medusa2Lora) else model(
                rows["input_ids"], output_hidden_states=True).hidden_states[-1]
        return rows, features
    return _train(heads, batch, steps)


def test_medusa_heads_start_as_the_target_rows_and_draft_inside(tiny_target, dataset, references):
    model, tok = tiny_target
    heads = _medusa(model, dataset).eval()
    rows = heads.draft_vocab
    assert len(rows) == SIZE and all(h[-1].weight.shape == (SIZE, model.config.hidden_size) for h in heads.heads)
    with torch.no_grad():
        h = model(references[0][0][None], output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(heads.head_logits(h)[0], model.get_output_embeddings()(h)[:, rows])
    allowed = set(rows.tolist())
    _check_drafts(model, heads.proposer(model), allowed, references)
    _check_sampled_chain(model, heads.proposer(model), allowed, references[0][0])


def test_medusa_training_masks_labels_outside_and_stays_lossless(tiny_target, dataset, references, tmp_path):
    from safetensors.torch import load_file

    model, tok = tiny_target
    heads = _medusa(model, dataset)
    losses = _train_medusa(heads, model, tok, dataset, 12)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    # a batch whose labels all lie outside the vocabulary gives no CE term, and counts as misses
    outside = [v for v in range(model.config.vocab_size) if v not in set(heads.draft_vocab.tolist())][:12]
    ids = torch.tensor([outside])
    seen_before = heads.seen.clone()
    with torch.no_grad():
        loss, metrics = heads.loss(collate([{"input_ids": outside, "loss_mask": [1] * 12}], 0),
                                   model(ids, output_hidden_states=True).hidden_states[-1])
    assert loss.item() == 0.0 and metrics["acc_0"] == 0.0 and bool((heads.seen > seen_before * 0.99).all())
    _check_drafts(model, heads.proposer(model), set(heads.draft_vocab.tolist()), references)

    folder = ckpt.save_drafter(heads, tmp_path / "step_12")
    assert load_file(str(folder / ckpt.WEIGHTS_NAME))["heads.0.1.weight"].shape[0] == SIZE
    loaded = load_drafter(folder, model).eval()
    assert torch.equal(loaded.draft_vocab, heads.draft_vocab)
    assert json.loads((folder / ckpt.CONFIG_NAME).read_text())["draft_vocab"] == heads.draft_vocab.tolist()
    with torch.no_grad():
        h = model(references[1][0][None], output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(loaded.head_logits(h), heads.head_logits(h))
    assert loaded.tree_choices() == heads.tree_choices()


def test_medusa_export_widens_the_heads_to_the_full_vocabulary(tiny_target, dataset, tmp_path):
    from safetensors.torch import load_file

    from draftlab import hub

    model, tok = tiny_target
    heads = _medusa(model, dataset)
    _train_medusa(heads, model, tok, dataset, 2)
    ckpt.save_drafter(heads, tmp_path / "run" / "step_2")
    (tmp_path / "run" / "best").write_text("step_2\n")
    out = hub.export_checkpoint(tmp_path / "run", tmp_path / "export", target=model, tokenizer=tok,
                                target_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    weights = load_file(str(out / "medusa_lm_head.safetensors"))
    rows, lm_head = heads.draft_vocab, model.get_output_embeddings().weight
    for k in range(3):
        full = weights[f"{k}.1.weight"]
        assert full.shape == lm_head.shape
        torch.testing.assert_close(full[rows], heads.heads[k][-1].weight.detach())
        others = torch.ones(len(full), dtype=torch.bool)
        others[rows] = False
        torch.testing.assert_close(full[others], lm_head[others])


def test_medusa2_reduced_vocabulary_is_lossless_against_the_adapted_target(tiny_tokenizer, dataset, tmp_path):
    from conftest import build_tiny_llama

    tok = tiny_tokenizer
    model = build_tiny_llama(tok).requires_grad_(False)                # its own copy: it gets adapted
    drafter = _medusa(model, dataset, Medusa2Lora, lora_r=4, lora_alpha=8)
    losses = _train_medusa(drafter, model, tok, dataset, 4)
    assert losses[-1] < losses[0]
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in TEXTS]
    served = [(p, target_generate(model, p, 16).tokens) for p in prompts]
    _check_drafts(model, drafter.proposer(model), set(drafter.draft_vocab.tolist()), served)
    ckpt.save_drafter(drafter, tmp_path / "step_4")
    fresh = build_tiny_llama(tok).requires_grad_(False)
    loaded = load_drafter(tmp_path / "step_4", fresh).eval()
    assert torch.equal(loaded.draft_vocab, drafter.draft_vocab)
    _check_drafts(fresh, loaded.proposer(fresh), set(drafter.draft_vocab.tolist()), served, SPECS[1:2])


# --- acceptance ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reduced_base(tiny_target, dataset, tmp_path_factory):
    """A small_lm checkpoint with a draft vocabulary."""
    drafter = _small_lm(tiny_target[0], dataset)
    return ckpt.save_drafter(drafter, tmp_path_factory.mktemp("base") / "step_1"), drafter.draft_head.draft_vocab


def test_acceptance_drafts_with_its_base_vocabulary(tiny_target, reduced_base, references, tmp_path, monkeypatch):
    model, _ = tiny_target
    folder, rows = reduced_base
    torch.manual_seed(1)
    head = AcceptanceHead.from_target(model, SimpleNamespace(base=str(folder))).eval()
    assert torch.equal(head.base.draft_head.draft_vocab, rows)
    allowed = set(rows.tolist())
    _no_full_head(monkeypatch, head.base.model.get_output_embeddings())
    for threshold in (0.3, 1.0):
        _check_drafts(model, head.proposer(model, adaptive_threshold=threshold), allowed, references)
    ckpt.save_drafter(head, tmp_path / "step_1")
    loaded = load_drafter(tmp_path / "step_1", model)
    assert torch.equal(loaded.base.draft_head.draft_vocab, rows)


def test_acceptance_labels_the_drafts_its_base_can_make_and_learns(tiny_target, tiny_chat_file, reduced_base):
    model, tok = tiny_target
    folder, rows = reduced_base
    torch.manual_seed(2)
    head = AcceptanceHead.from_target(model, SimpleNamespace(base=str(folder), acceptance_layers=2))
    b = torch.randn(64, model.config.hidden_size)
    drafted, labels = head._draft_and_label(b, torch.randn(64, model.config.hidden_size))
    assert set(drafted.tolist()) <= set(rows.tolist()) and ((labels >= 0) & (labels <= 1)).all()
    from draftlab.data import read_conversations

    data = ChatDataset(read_conversations(tiny_chat_file)[0][:8], tok, 128)
    batch = collate([data[i] for i in range(8)], tok.pad_token_id)

    def fixed_loss():
        torch.manual_seed(123)                                     # same drafts, labels and mixing each time
        with torch.no_grad():
            return head.loss(batch)[0]

    before = fixed_loss()
    _train(head, lambda step: (batch, None), 15)
    assert fixed_loss() < before


# --- the training loop ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["eagle_head", "distill_offline_blackbox", "medusa_heads"])
def test_recipes_train_evaluate_and_resume_with_a_draft_vocabulary(recipe, tiny_target_dir, tiny_chat_file,
                                                                   tiny_prompt_file, tmp_path):
    """train.main chooses the vocabulary (prepare), evaluates before training (the drafter's rows are first read
    under inference_mode, then trained through), saves it, and a resumed run keeps the same vocabulary."""
    from draftlab.config import load_config
    from draftlab.train import main

    out = tmp_path / "run"
    args = [f"recipe={recipe}", f"target.path={tiny_target_dir}", f"data.train={tiny_chat_file}",
            f"data.eval_prompts={tiny_prompt_file}", f"out_dir={out}", "data.regenerate_from=''",
            "eval.num_prompts=2", "eval.max_new_tokens=12", "eval.every=2", "eval.at_start=true",
            "train.batch_size=4", "train.grad_accum=1", "train.warmup_steps=0", "data.max_length=160",
            "tracking=none", f"drafter.draft_vocab_size={SIZE}",
            "drafter.medusa_tree_nodes=16" if recipe == "medusa_heads" else "drafter.num_layers=1"]
    main(load_config(args + ["train.max_steps=2"]))
    main(load_config(args + ["train.max_steps=3", "train.resume=auto"]))
    vocabularies = [json.loads((out / f"step_{s}" / ckpt.CONFIG_NAME).read_text())["draft_vocab"] for s in (0, 2, 3)]
    assert len(vocabularies[0]) == SIZE and vocabularies[0] == vocabularies[1] == vocabularies[2]
    for step in (0, 2):
        report = json.loads((out / f"step_{step}" / "eval.json").read_text())
        assert report["lossless"] is True, step
