"""EagleHead (EAGLE-1) and its proposer: shapes, frozen pieces, the (f_t, x_{t+1}) -> f_{t+1} shift, padding,
cached drafting against a no-cache reference, chain / dynamic / static trees, save -> load, end to end."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from draftlab.drafters.eagle import EagleHead, EagleProposer


@pytest.fixture
def head(tiny_target):
    torch.manual_seed(0)
    return EagleHead.from_target(tiny_target[0], None).eval()


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text)["input_ids"])


def _features(model, ids: torch.Tensor) -> torch.Tensor:
    """[B,T] -> [B,T,d]: the target's post-norm last hidden state."""
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states[-1]


def _reference(head, feats: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    """No-cache causal forward over pairs (feats[t], toks[t]) at positions 0..n-1 -> outputs [n,d]."""
    n = len(toks)
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        return head(feats[None], toks[None], torch.arange(n)[None], mask)[0]


def _batch(ids: torch.Tensor, loss_mask=None) -> dict:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids) if loss_mask is None else loss_mask}


def test_shapes_and_frozen_pieces(head, tiny_target):
    model, tok = tiny_target
    d, vocab = model.config.hidden_size, model.config.vocab_size
    trainable = [n for n, p in head.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith(("fc.", "layers.")) for n in trainable)
    assert not any("embed" in n or "lm_head" in n for n in head.state_dict())
    assert not model.get_input_embeddings().weight.requires_grad
    assert not model.get_output_embeddings().weight.requires_grad
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    assert head.fc.in_features == 2 * d and head.fc.bias is not None

    ids = _ids(tok, "The quick brown fox")[None]
    out = _reference(head, _features(model, ids)[0], ids[0])
    assert out.shape == (ids.shape[1], d) and head.logits(out).shape == (ids.shape[1], vocab)
    loss, metrics = head.loss(_batch(ids), _features(model, ids))
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert set(metrics) == {"loss_reg", "loss_cls", "acc"} and 0 <= metrics["acc"] <= 1

    two = EagleHead.from_target(model, SimpleNamespace(num_layers=2, feature_noise=0.0, reg_weight=1.0,
                                                       cls_weight=0.1, fc_bias=False))
    assert len(two.layers) == 2 and two.fc.bias is None
    assert not isinstance(two.layers[1].input_layernorm, torch.nn.Identity)


def test_loss_decreases_when_overfitting(tiny_target):
    model, tok = tiny_target
    torch.manual_seed(0)
    head = EagleHead.from_target(model, None).train()
    ids = torch.stack([_ids(tok, "Speculative decoding drafts tokens and the")[:8],
                       _ids(tok, "Numbers: 0 1 2 3 4 5 6 7 8 9 10")[:8]])
    batch, feats = _batch(ids), _features(model, ids)
    with torch.no_grad():
        before, start = head.eval().loss(batch, feats)
    head.train()
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(30):
        loss, _ = head.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after, end = head.eval().loss(batch, feats)
    # The soft CE is bounded below by the target's entropy, so the regression term shows the fit best.
    assert after < before and end["loss_cls"] < start["loss_cls"]
    assert end["loss_reg"] < start["loss_reg"] / 2 and end["acc"] > start["acc"]


def test_loss_uses_ft_and_next_token_to_predict_next_feature(head, tiny_target):
    """Explicit per-position computation: pair t = (f_t, x_{t+1}) -> f_{t+1}, weighted by loss_mask[t+2]."""
    model, _ = tiny_target
    torch.manual_seed(1)
    B, T, d = 2, 9, model.config.hidden_size
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    feats = torch.randn(B, T, d)
    loss_mask = (torch.rand(B, T) < 0.7).long()
    loss, metrics = head.loss(_batch(ids, loss_mask), feats)

    reg = cls = agree = weight = 0.0
    for b in range(B):
        pred = _reference(head, feats[b, :-1], ids[b, 1:])          # pred[t] = f^_{t+1}
        for t in range(T - 2):                                       # the last pair drafts x_T: weight 0
            w = float(loss_mask[b, t + 2])
            target = feats[b, t + 1]
            logits, target_logits = head.logits(pred[t]), head.logits(target)
            reg += w * F.smooth_l1_loss(pred[t], target).item()
            cls += -w * (target_logits.softmax(-1) * logits.log_softmax(-1)).sum().item()
            agree += w * float(logits.argmax() == target_logits.argmax())
            weight += w
    assert metrics["loss_reg"] == pytest.approx(reg / weight, rel=1e-4)
    assert metrics["loss_cls"] == pytest.approx(cls / weight, rel=1e-4)
    assert metrics["acc"] == pytest.approx(agree / weight)
    assert loss.item() == pytest.approx(head.reg_weight * reg / weight + head.cls_weight * cls / weight, rel=1e-4)

    # x_0 is never an input; f_{T-1} is only the target of the last pair, which has weight 0.
    ids2 = ids.clone()
    ids2[:, 0] = (ids[:, 0] + 1) % model.config.vocab_size
    assert head.loss(_batch(ids2, loss_mask), feats)[0].item() == pytest.approx(loss.item(), rel=1e-6)
    feats2 = feats.clone()
    feats2[:, -1] += 1.0
    assert head.loss(_batch(ids, loss_mask), feats2)[0].item() == pytest.approx(loss.item(), rel=1e-6)
    # f_{T-2} is the target of pair T-3, weighted by loss_mask[T-1].
    loss_mask[:, -1] = 1
    base = head.loss(_batch(ids, loss_mask), feats)[1]
    feats2 = feats.clone()
    feats2[:, -2] += 1.0
    assert head.loss(_batch(ids, loss_mask), feats2)[1]["loss_reg"] != pytest.approx(base["loss_reg"])


def test_padding_does_not_change_the_loss(head, tiny_target):
    model, tok = tiny_target
    ids = _ids(tok, "def add(a, b):\n    return a + b\n")[None]
    feats = _features(model, ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :3] = 0
    reference, ref_metrics = head.loss(_batch(ids, loss_mask), feats)

    pad, T = 4, ids.shape[1]
    garbage_ids = torch.randint(0, model.config.vocab_size, (1, pad))
    garbage_feats = 5 * torch.randn(1, pad, feats.shape[-1])
    for side in ("right", "left"):
        cat = (lambda a, g: torch.cat([a, g], 1)) if side == "right" else (lambda a, g: torch.cat([g, a], 1))
        batch = {"input_ids": cat(ids, garbage_ids),
                 "attention_mask": cat(torch.ones(1, T, dtype=torch.long), torch.zeros(1, pad, dtype=torch.long)),
                 "loss_mask": cat(loss_mask, torch.ones(1, pad, dtype=torch.long))}
        loss, metrics = head.loss(batch, cat(feats, garbage_feats))
        assert loss.item() == pytest.approx(reference.item(), rel=1e-5), side
        assert metrics["acc"] == pytest.approx(ref_metrics["acc"]), side


def _start(head, model, prompt: torch.Tensor) -> EagleProposer:
    """A proposer after prefill: prompt [P] committed with its features and the target's greedy next token."""
    proposer = head.proposer(model)
    proposer.reset(prompt)
    with torch.no_grad():
        out = model(prompt[None], output_hidden_states=True)
    proposer.commit(out.logits[0, -1].argmax().view(1), out.hidden_states[-1][0])
    return proposer


def test_cached_drafting_matches_no_cache_reference(head, tiny_target):
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = tiny_target
    prompt = _ids(tok, "The quick brown fox jumps")
    proposer = _start(head, model, prompt)
    seq = torch.cat([prompt, proposer.tokens[-1:]])                 # x_0 .. x_N
    feats = _features(model, seq[None])[0]                          # target features f_0 .. f_N

    k, sampling = 4, Sampling(temperature=1.0)
    tree = proposer.propose(TreeSpec(kind="chain", draft_length=k), sampling, torch.Generator().manual_seed(0))
    assert tree.proposal == "with_replacement" and tree.q.shape == (k, model.config.vocab_size)
    assert tree.parents.tolist() == list(range(-1, k - 1))
    # Reference: feed the head's own output feature and the drafted token back in, without a cache.
    pair_feats, pair_toks = feats[:-1], seq[1:]
    for i in range(k):
        out = _reference(head, pair_feats, pair_toks)
        assert torch.allclose(tree.q[i], sampling.probs(head.logits(out[-1])), atol=1e-5)
        pair_feats = torch.cat([pair_feats, out[-1:]])
        pair_toks = torch.cat([pair_toks, tree.tokens[i:i + 1]])

    greedy = proposer.propose(TreeSpec(kind="chain", draft_length=k), Sampling(), None)
    assert greedy.q is None and greedy.proposal == "topk"

    # A round accepts two drafts plus a bonus: the draft entries go, the real pairs come in.
    new = torch.cat([greedy.tokens[:2], torch.tensor([7])])
    seq2 = torch.cat([seq, new])
    feats2 = _features(model, seq2[None])[0]
    proposer.commit(new, feats2[len(seq) - 1:len(seq2) - 1])
    out = _reference(head, feats2[:-1], seq2[1:])
    assert torch.allclose(proposer.root_logits, head.logits(out[-1]), atol=1e-4)
    again = proposer.propose(TreeSpec(kind="chain", draft_length=k), Sampling(), None)
    assert again.tokens[0] == head.logits(out[-1]).argmax()


def _path_logits(head, feats, seq, tree, node: int) -> torch.Tensor:
    """Reference draft logits at `node` (-1 = root): real pairs, then the node's path fed autoregressively."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    pair_feats, pair_toks = feats[:-1], seq[1:]
    out = _reference(head, pair_feats, pair_toks)
    for n in reversed(path):
        pair_feats = torch.cat([pair_feats, out[-1:]])
        pair_toks = torch.cat([pair_toks, tree.tokens[n:n + 1]])
        out = _reference(head, pair_feats, pair_toks)
    return head.logits(out[-1])


def test_dynamic_tree_follows_the_head(head, tiny_target):
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = tiny_target
    prompt = _ids(tok, "Write a short poem about")
    proposer = _start(head, model, prompt)
    seq = torch.cat([prompt, proposer.tokens[-1:]])
    feats = _features(model, seq[None])[0]

    k, depth = 3, 3
    every = k + (depth - 1) * k * k
    tree = proposer.propose(TreeSpec(kind="dynamic", depth=depth, top_k=k, total_tokens=every), Sampling(), None)
    assert len(tree) == every and tree.q is None and tree.proposal == "topk"
    assert tree.max_depth == depth
    parents = tree.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))
    scores = {}
    for node in [-1] + list(range(len(tree))):
        children = [i for i, p in enumerate(parents) if p == node]
        logp = _path_logits(head, feats, seq, tree, node).log_softmax(-1)
        if node >= 0:
            scores[node] = scores.get(parents[node], 0.0) + \
                float(_path_logits(head, feats, seq, tree, parents[node]).log_softmax(-1)[tree.tokens[node]])
        if children:   # an expanded node's children are exactly its top-k draft tokens
            assert set(tree.tokens[children].tolist()) == set(logp.topk(k).indices.tolist())
    # Expanded nodes at each level are the best-scored ones of that level.
    for level in range(1, depth):
        at_level = [i for i in range(len(tree)) if tree.depths[i] == level]
        expanded = {p for p in parents if p >= 0 and tree.depths[p] == level}
        best = sorted(at_level, key=lambda i: -scores[i])[:k]
        assert expanded == set(best)

    # Reranked to fewer nodes: still a tree, the best-scored nodes kept.
    small = proposer.propose(TreeSpec(kind="dynamic", depth=depth, top_k=k, total_tokens=5), Sampling(), None)
    assert len(small) == 5 and all(p < i for i, p in enumerate(small.parents.tolist()))
    best = sorted(scores, key=lambda i: -scores[i])[:5]
    assert {_path(small, i) for i in range(5)} == {_path(tree, i) for i in best}


def _path(tree, node: int) -> tuple[int, ...]:
    """The tokens from the root's child down to `node`."""
    out = []
    while node >= 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return tuple(reversed(out))


def test_static_tree_is_autoregressive_per_branch(head, tiny_target):
    from draftlab.trees import EAGLE_DEFAULT_CHOICES, TreeSpec
    from draftlab.verify import Sampling

    model, tok = tiny_target
    prompt = _ids(tok, "Numbers: 0 1 2 3")
    proposer = _start(head, model, prompt)
    seq = torch.cat([prompt, proposer.tokens[-1:]])
    feats = _features(model, seq[None])[0]

    tree = proposer.propose(TreeSpec(kind="static"), Sampling(), None)
    paths = sorted((tuple(c) for c in EAGLE_DEFAULT_CHOICES), key=lambda p: (len(p), p))
    assert len(tree) == len(paths) and tree.q is None and tree.proposal == "topk"
    for node, path in enumerate(paths):
        ranked = _path_logits(head, feats, seq, tree, int(tree.parents[node])).argsort(descending=True)
        assert tree.tokens[node] == ranked[path[-1]]
    # sampling: a rank-r child is the r-th draw without replacement from its parent's distribution
    sampling = Sampling(temperature=0.7)
    tree = proposer.propose(TreeSpec(kind="static"), sampling, torch.Generator().manual_seed(0))
    assert len(tree) == len(paths) and tree.proposal == "without_replacement"
    for node in range(len(tree)):
        q = sampling.probs(_path_logits(head, feats, seq, tree, int(tree.parents[node])))
        torch.testing.assert_close(tree.q[node], q, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="no parent"):
        proposer.propose(TreeSpec(kind="static", choices=[[0], [1, 0]]), Sampling(), None)


def test_config_round_trip(tiny_target):
    model, tok = tiny_target
    torch.manual_seed(3)
    head = EagleHead.from_target(model, SimpleNamespace(num_layers=2, feature_noise=0.1, reg_weight=1.0,
                                                        cls_weight=0.2, fc_bias=True)).eval()
    config = json.loads(json.dumps(head.drafter_config()))
    assert config["kind"] == "eagle" and config["num_layers"] == 2 and config["cls_weight"] == 0.2
    assert config["target"]["hidden_size"] == model.config.hidden_size
    torch.manual_seed(4)
    rebuilt = EagleHead.from_config(config, model).eval()
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    rebuilt.load_state_dict({n: t for n, t in head.state_dict().items() if n in trainable}, strict=True)
    ids = _ids(tok, "Speculative decoding drafts")
    feats = _features(model, ids[None])[0]
    assert torch.equal(_reference(head, feats[:-1], ids[1:]), _reference(rebuilt, feats[:-1], ids[1:]))
    with pytest.raises(ValueError, match="hidden_size"):
        EagleHead.from_config({**config, "target": {**config["target"], "hidden_size": 32}}, model)


@pytest.mark.parametrize("spec", [dict(kind="chain", draft_length=4),
                                  dict(kind="dynamic", depth=4, top_k=3, total_tokens=12),
                                  dict(kind="static")])
def test_greedy_speculation_is_lossless(tiny_target, spec):
    from draftlab import evaluator
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = tiny_target
    torch.manual_seed(0)
    head = EagleHead.from_target(model, None).eval()
    prompt = _ids(tok, "<|im_start|>user\nThe quick brown fox<|im_end|>\n<|im_start|>assistant\n")
    new_tokens = 24
    with torch.no_grad():
        plain = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.pad_token_id)[0, len(prompt):]
    tree_spec = TreeSpec(**spec)
    result = evaluator.speculative_generate(model, head.proposer(model), prompt, tree_spec, Sampling(),
                                            new_tokens)
    assert result.tokens == plain.tolist()
    rounds = len(result.accepted)
    tau = sum(a + 1 for a in result.accepted) / rounds
    assert 1 <= tau <= tree_spec.max_depth + 1


@pytest.mark.parametrize("kind", ["chain", "dynamic", "static"])
def test_sampled_speculation_runs(tiny_target, kind):
    from draftlab import evaluator
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = tiny_target
    torch.manual_seed(0)
    head = EagleHead.from_target(model, None).eval()
    spec = TreeSpec(kind=kind, draft_length=3, depth=3, top_k=3, total_tokens=8)
    result = evaluator.speculative_generate(model, head.proposer(model), _ids(tok, "Write a short poem"), spec,
                                            Sampling(temperature=1.0, top_p=0.9), 16, None,
                                            torch.Generator().manual_seed(0))
    assert len(result.tokens) == 16 and all(0 <= t < model.config.vocab_size for t in result.tokens)
    assert all(0 <= a <= spec.max_depth for a in result.accepted)


def test_checkpoint_save_load_gives_identical_drafts(tiny_target, tmp_path):
    from draftlab.checkpoint import save_drafter
    from draftlab.drafters import load_drafter
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = tiny_target
    torch.manual_seed(5)
    head = EagleHead.from_target(model, None).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    loaded = load_drafter(save_drafter(head, tmp_path / "step_1"), model).eval()
    prompt = _ids(tok, "The quick brown fox")
    spec = TreeSpec(kind="dynamic", depth=3, top_k=4, total_tokens=10)
    a = _start(head, model, prompt).propose(spec, Sampling(), None)
    b = _start(loaded, model, prompt).propose(spec, Sampling(), None)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_fitting_the_targets_own_text_raises_tau(tiny_target):
    """The shift end to end: a head fitted on the target's greedy text drafts that text back."""
    from draftlab import evaluator
    from conftest import CORPUS
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = tiny_target
    prompts = [_ids(tok, text)[:6] for text in CORPUS[:3]]
    with torch.no_grad():
        ids = torch.stack([model.generate(p[None], attention_mask=torch.ones(1, 6, dtype=torch.long),
                                          max_new_tokens=30, do_sample=False, eos_token_id=None,
                                          pad_token_id=tok.pad_token_id)[0] for p in prompts])
    batch, feats = _batch(ids), _features(model, ids)
    spec = TreeSpec(kind="chain", draft_length=4)

    def tau(head):
        accepted = [a for p in prompts for a in evaluator.speculative_generate(
            model, head.eval().proposer(model), p, spec, Sampling(), 30).accepted]
        return sum(a + 1 for a in accepted) / len(accepted)

    torch.manual_seed(0)
    head = EagleHead.from_target(model, None)
    before = tau(head)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    head.train()
    for _ in range(40):
        loss, _ = head.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert tau(head) > before + 0.5


def _fit(head, batch, feats, steps=30, lr=3e-3) -> list[float]:
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    head.train()
    losses = []
    for _ in range(steps):
        loss, _ = head.loss(batch, feats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_init_from_target_starts_from_the_last_layer_and_trains(tiny_target):
    from draftlab.evaluator import speculative_generate, target_generate
    from draftlab.trees import TreeSpec
    from draftlab.verify import Sampling

    model, tok = tiny_target
    head = EagleHead.from_target(model, SimpleNamespace(init_from_target=True))
    last = model.model.layers[-1].state_dict()
    for key, value in head.layers[0].state_dict().items():
        assert torch.equal(value, last[key]), key
    d = model.config.hidden_size
    assert torch.equal(head.fc.weight[:, d:], torch.eye(d)) and not head.fc.weight[:, :d].any()
    ids = _ids(tok, "The quick brown fox jumps over the lazy dog.")[None].repeat(2, 1)
    losses = _fit(head, _batch(ids), _features(model, ids), steps=40)
    assert losses[-1] < 0.7 * losses[0]
    prompt = _ids(tok, "The quick brown fox")
    assert speculative_generate(model, head.eval().proposer(model), prompt, TreeSpec(draft_length=3), Sampling(),
                                16).tokens == target_generate(model, prompt, 16).tokens


def test_harmonized_steps_feed_the_heads_own_features(tiny_target):
    """HASS: step j trains slot t on the head's own step j-1 output; one step is plain EAGLE training."""
    model, tok = tiny_target
    ids = _ids(tok, "Speculative decoding drafts tokens and the target verifies them.")[None].repeat(2, 1)
    batch, feats = _batch(ids), _features(model, ids)
    torch.manual_seed(0)
    plain = EagleHead.from_target(model, None).eval()
    torch.manual_seed(0)
    harmonized = EagleHead.from_target(model, SimpleNamespace(harmonized_steps=3, topk_weight=1.0)).eval()
    loss1, m1 = plain.loss(batch, feats)
    loss3, m3 = harmonized.loss(batch, feats)
    assert set(m1) == {"loss_reg", "loss_cls", "acc"} and {"acc_1", "acc_2", "loss_reg_2"} <= set(m3)
    assert m3["loss_reg"] == pytest.approx(m1["loss_reg"]) and loss3 > loss1   # same step 0, more terms
    losses = _fit(harmonized, batch, feats, steps=40)
    assert losses[-1] < 0.75 * losses[0]
    with pytest.raises(ValueError, match="harmonized_steps=0"):
        EagleHead.from_target(model, SimpleNamespace(harmonized_steps=0))
