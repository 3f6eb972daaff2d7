"""Reduced draft vocabularies (draftlab/vocab.py): the chosen tokens, the maps, drafting only inside the vocabulary,
and losslessness at the evaluator level, greedy and sampled (the emitted distribution is the target's)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftlab import vocab
from draftlab.data import ChatDataset
from draftlab.drafters.eagle import EagleHead
from draftlab.evaluator import speculative_generate, target_generate
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling

SPECS = [TreeSpec(kind="chain", draft_length=4), TreeSpec(kind="dynamic", depth=3, top_k=3, total_tokens=10),
         TreeSpec(kind="static")]


def _cfg(**kw):
    return SimpleNamespace(**{"draft_vocab_size": 0, **kw})


@pytest.fixture
def dataset(tiny_target, tiny_chat_file):
    from draftlab.data import read_conversations

    conversations, _ = read_conversations(tiny_chat_file)
    return ChatDataset(conversations, tiny_target[1], 256)


def test_choose_ranks_by_frequency_then_id():
    from collections import Counter

    counts = Counter({7: 5, 3: 5, 9: 1, 4: 9})
    assert vocab.choose(counts, 3, 20) == [3, 4, 7]            # 4 (9), then 3 and 7 (5 each, by id); ascending
    assert vocab.choose(counts, -1, 20) == [3, 4, 7, 9]        # auto: every distinct token when fewer than 32k
    assert vocab.choose(counts, 20, 20) == list(range(20))     # the whole vocabulary: no reduction
    with pytest.raises(ValueError, match="only 4 distinct"):
        vocab.choose(counts, 5, 20)
    with pytest.raises(ValueError, match="draft_vocab_size=-2"):
        vocab.check_size(-2)


def test_maps_and_expanded_logits():
    ids = torch.tensor([2, 5, 6])
    d2t, t2d = vocab.vocab_maps(ids, 8)
    assert torch.equal(torch.arange(3) + d2t, ids) and t2d.tolist() == [i in (2, 5, 6) for i in range(8)]
    full = vocab.expand_logits(torch.tensor([[1.0, 2.0, 3.0]]), ids, 8)
    assert full[0, 5] == 2.0 and torch.isinf(full[0, [0, 1, 3, 4, 7]]).all()


def test_eagle_drafts_only_inside_its_vocabulary(tiny_target, dataset):
    model, tok = tiny_target
    torch.manual_seed(0)
    head = EagleHead.from_target(model, _cfg(draft_vocab_size=40)).eval()
    head.prepare(dataset)
    allowed = set(head.draft_head.draft_vocab.tolist())
    assert len(allowed) == 40
    prompt = torch.tensor(tok("The quick brown fox")["input_ids"])
    for spec in SPECS:
        proposer = head.proposer(model)
        result = speculative_generate(model, proposer, prompt, spec, Sampling(), 12)
        assert result.rounds > 0
        tree = proposer.propose(spec, Sampling(), None)
        assert set(tree.tokens.tolist()) <= allowed
    hidden = torch.randn(3, model.config.hidden_size)
    small, full = head.draft_logits(hidden), head.logits(hidden)
    assert small.shape == (3, 40) and full.shape == (3, model.config.vocab_size)
    assert torch.equal(full[:, head.draft_head.draft_vocab], small) and torch.isinf(full).sum() == 3 * (full.shape[1] - 40)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_reduced_vocabulary_stays_lossless_under_greedy(tiny_target, dataset, spec):
    model, tok = tiny_target
    torch.manual_seed(1)
    head = EagleHead.from_target(model, _cfg(draft_vocab_size=24)).eval()
    head.prepare(dataset)
    for text in ("The quick brown fox", "def add(a, b):"):
        prompt = torch.tensor(tok(text)["input_ids"])
        expected = target_generate(model, prompt, 20).tokens
        assert speculative_generate(model, head.proposer(model), prompt, spec, Sampling(), 20).tokens == expected


def test_checkpoint_keeps_the_vocabulary(tiny_target, dataset, tmp_path):
    from draftlab.checkpoint import save_drafter
    from draftlab.drafters import load_drafter
    from safetensors.torch import load_file

    model, _ = tiny_target
    head = EagleHead.from_target(model, _cfg(draft_vocab_size=32))
    head.prepare(dataset)
    folder = save_drafter(head, tmp_path / "step_1")
    loaded = load_drafter(folder, model)
    assert torch.equal(loaded.draft_head.draft_vocab, head.draft_head.draft_vocab)
    maps = load_file(str(folder / "d2t_t2d.safetensors"))
    assert torch.equal(maps["d2t"] + torch.arange(32), head.draft_head.draft_vocab)


def test_reduced_vocabulary_training_lowers_the_loss(tiny_target, dataset):
    model, tok = tiny_target
    torch.manual_seed(0)
    head = EagleHead.from_target(model, _cfg(draft_vocab_size=48))
    head.prepare(dataset)
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog.")["input_ids"]] * 2)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    with torch.no_grad():
        feats = model(ids, output_hidden_states=True).hidden_states[-1]
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(25):
        loss, _ = head.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# --- sampling: the evaluator's emitted distribution equals the target's ------------------------------------

V = 6            # a vocabulary small enough to tabulate the joint distribution of two emitted tokens


@pytest.fixture(scope="module")
def six_token_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():     # a sharper, uneven target so that excluded tokens carry real probability
        model.lm_head.weight.mul_(8.0)
    return model


def _exact_joint(model, prompt, sampling) -> torch.Tensor:
    """P(second, third emitted token) [V, V], marginalised over the first (drawn from the prefill)."""
    joint = torch.zeros(V, V)
    with torch.no_grad():
        p0 = sampling.probs(model(prompt[None]).logits[0, -1])
        for a in range(V):
            p1 = sampling.probs(model(torch.cat([prompt, torch.tensor([a])])[None]).logits[0, -1])
            for b in range(V):
                p2 = sampling.probs(model(torch.cat([prompt, torch.tensor([a, b])])[None]).logits[0, -1])
                joint[b] += p0[a] * p1[b] * p2
    return joint


@pytest.mark.parametrize("kind", ["eagle", "small_lm"])
def test_sampled_reduced_vocabulary_emits_the_target_distribution(six_token_target, kind):
    """Half the vocabulary is never drafted, yet every token comes out as often as the target says."""
    from draftlab.drafters.small_lm import SmallLM

    model, draft_vocab = six_token_target, [0, 2, 3]
    torch.manual_seed(0)
    head = (EagleHead if kind == "eagle" else SmallLM).from_target(model, _cfg(num_layers=1)).eval()
    head.draft_head.set_vocab(draft_vocab)
    sampling, spec = Sampling(temperature=1.0), TreeSpec(kind="chain", draft_length=2)
    prompt = torch.tensor([1, 4, 2])
    expected = _exact_joint(model, prompt, sampling).flatten()
    proposer = head.proposer(model)
    speculative_generate(model, proposer, prompt, spec, sampling, 1)       # prefill: the proposer has a root
    drafted = proposer.propose(spec, sampling, torch.Generator().manual_seed(0))
    assert set(drafted.tokens.tolist()) <= set(draft_vocab) and drafted.q[:, [1, 4, 5]].sum() == 0
    n = 2500
    counts = torch.zeros(V * V)
    for i in range(n):
        out = speculative_generate(model, head.proposer(model), prompt, spec, sampling, 3,
                                   generator=torch.Generator().manual_seed(i))
        counts[out.tokens[1] * V + out.tokens[2]] += 1
    tvd = 0.5 * (counts / n - expected).abs().sum().item()
    bound = 1.5 * (expected * (1 - expected) / n).sqrt().sum().item()
    assert tvd < bound, f"TVD {tvd:.4f} >= {bound:.4f}"
