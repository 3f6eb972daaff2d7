"""SmallLM drafter: building from the target's config / a pretrained folder / LoRA, vocabulary checks,
checkpoints, the cached chain proposer, lossless speculative decoding, and the transformers export."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from draftlab import checkpoint as ckpt
from draftlab.drafters.small_lm import SmallLM, VocabularyMismatchError
from draftlab.evaluator import evaluate, speculative_generate, target_generate
from draftlab.trees import TreeSpec
from draftlab.verify import Sampling
from draftlab.drafters import load_drafter


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    """Checkpoint loading looks kinds up in DRAFTERS; register small_lm there until the package does."""
    from draftlab.drafters import DRAFTERS

    monkeypatch.setitem(DRAFTERS, "small_lm", SmallLM)


def _cfg(**kw):
    return SimpleNamespace(**kw)


def _ids(tok, text: str) -> torch.Tensor:
    return torch.tensor(tok(text)["input_ids"])


def _prompts(tok, n: int = 3) -> list[torch.Tensor]:
    from draftlab.data import encode_prompt

    texts = ["The quick brown fox", "Write a short poem about the sea", "Numbers: 0 1 2 3"]
    return [encode_prompt(tok, [{"role": "user", "content": t}]) for t in texts[:n]]


def _other_tokenizer(size: int):
    """A byte-level BPE trained on other text, padded with dummy tokens to exactly `size` entries."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["zebra yak xylophone wombat vulture"] * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_tokens([f"<extra_{i}>" for i in range(size - len(fast))])
    return fast


def test_built_from_the_target_config(tiny_target):
    model, tok = tiny_target
    drafter = SmallLM.from_target(model, _cfg(num_layers=1), tok)
    assert drafter.kind == "small_lm" and drafter.feature_layers == () and drafter.teacher_topk == 0
    assert type(drafter.model) is type(model) and drafter.model.config.num_hidden_layers == 1
    assert drafter.vocab_size == model.config.vocab_size
    # shared embeddings: the target's values, frozen, not saved; the target itself is not a submodule
    emb = drafter.model.get_input_embeddings().weight
    assert torch.equal(emb, model.get_input_embeddings().weight) and not emb.requires_grad
    assert torch.equal(drafter.model.get_output_embeddings().weight, model.get_output_embeddings().weight)
    saved = ckpt.trainable_state_dict(drafter)
    assert saved and not any("embed" in k or "lm_head" in k for k in saved)
    assert not any(n.startswith("target") for n, _ in drafter.named_parameters())

    narrow = SmallLM.from_target(model, _cfg(num_layers=2, hidden_size=32, num_attention_heads=2,
                                             intermediate_size=48, share_embeddings=False), tok)
    c = narrow.model.config
    assert (c.hidden_size, c.num_attention_heads, c.intermediate_size, c.num_hidden_layers) == (32, 2, 48, 2)
    assert narrow.vocab_size == model.config.vocab_size
    assert narrow(_ids(tok, "hello")[None]).shape == (1, len(_ids(tok, "hello")), model.config.vocab_size)
    with pytest.raises(ValueError, match="share_embeddings"):
        SmallLM.from_target(model, _cfg(hidden_size=32, num_attention_heads=2), tok)
    with pytest.raises(ValueError, match="distill_mode"):
        SmallLM.from_target(model, _cfg(distill_mode="telepathy"), tok)


def test_vocabulary_mismatch_is_refused(tiny_target, tmp_path):
    from conftest import build_tiny_llama

    model, tok = tiny_target
    other = _other_tokenizer(len(tok))
    assert len(other) == len(tok)
    same_size = tmp_path / "other_tokenizer"
    build_tiny_llama(tok, layers=1).save_pretrained(same_size)   # vocabulary size matches the target's
    other.save_pretrained(same_size)
    with pytest.raises(VocabularyMismatchError, match="different tokenizer") as err:
        SmallLM.from_target(model, _cfg(init_from=str(same_size)), tok)
    assert str(same_size) in str(err.value) and "init_from" in str(err.value)

    bigger = tmp_path / "bigger_vocab"
    m = build_tiny_llama(tok, layers=1)
    m.resize_token_embeddings(len(tok) + 16)
    m.save_pretrained(bigger)
    with pytest.raises(VocabularyMismatchError, match=f"{len(tok) + 16} tokens but the target has"):
        SmallLM.from_target(model, _cfg(init_from=str(bigger)), tok)
    assert issubclass(VocabularyMismatchError, ValueError)


def test_checkpoint_round_trip(tiny_target, tmp_path):
    model, tok = tiny_target
    torch.manual_seed(1)
    drafter = SmallLM.from_target(model, _cfg(num_layers=2, distill_mode="offline_whitebox", teacher_topk=8), tok)
    assert drafter.teacher_topk == 8
    ckpt.save_drafter(drafter, tmp_path / "step_1")
    config = json.loads((tmp_path / "step_1" / ckpt.CONFIG_NAME).read_text())
    assert config["kind"] == "small_lm" and config["num_layers"] == 2 and config["vocab_size"] == len(tok)
    back = load_drafter(tmp_path / "step_1", model)
    ids = _ids(tok, "Speculative decoding drafts tokens")[None]
    torch.testing.assert_close(back(ids), drafter(ids))
    assert back.teacher_topk == 8 and back.settings == drafter.settings


def test_lora_on_a_pretrained_folder(tiny_target, tiny_target_dir, tmp_path):
    model, tok = tiny_target
    drafter = SmallLM.from_target(model, _cfg(init_from=tiny_target_dir, lora_r=4), tok)
    trainable = [n for n, p in drafter.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = _ids(tok, "The quick brown fox")[None]
    torch.testing.assert_close(drafter(ids), model(ids).logits)   # LoRA B starts at zero: still the target
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ckpt.save_drafter(drafter, tmp_path / "step_1")
    back = load_drafter(tmp_path / "step_1", model)
    torch.testing.assert_close(back(ids), drafter(ids))
    assert not torch.allclose(back(ids), model(ids).logits)


def test_chain_proposer_matches_a_no_cache_reference(tiny_target):
    model, tok = tiny_target
    torch.manual_seed(0)
    drafter = SmallLM.from_target(model, _cfg(num_layers=1), tok).eval()
    prompt = _ids(tok, "Write a short poem about the sea")
    proposer = drafter.proposer(model)
    proposer.reset(prompt[:-1])
    proposer.commit(prompt[-1:], None)
    k = 4
    greedy = proposer.propose(TreeSpec(kind="chain", draft_length=k), Sampling(), None)
    seq = prompt.clone()
    with torch.no_grad():
        for i in range(k):
            nxt = drafter(seq[None])[0, -1].argmax()
            assert int(greedy.tokens[i]) == int(nxt)
            seq = torch.cat([seq, nxt.view(1)])
    assert greedy.q is None and greedy.proposal == "topk" and greedy.parents.tolist() == [-1, 0, 1, 2]

    # accept two drafts + a bonus token; the next proposal reuses the cache and must equal a fresh proposer's
    committed = torch.cat([greedy.tokens[:2], torch.tensor([7])])
    proposer.commit(committed, None)
    sampling = Sampling(temperature=0.8, top_k=50)
    again = proposer.propose(TreeSpec(kind="chain", draft_length=k), sampling, torch.Generator().manual_seed(3))
    fresh = drafter.proposer(model)
    fresh.reset(torch.cat([prompt, committed])[:-1])
    fresh.commit(committed[-1:], None)
    ref = fresh.propose(TreeSpec(kind="chain", draft_length=k), sampling, torch.Generator().manual_seed(3))
    assert torch.equal(again.tokens, ref.tokens) and again.proposal == "with_replacement"
    torch.testing.assert_close(again.q, ref.q)
    seq = torch.cat([prompt, committed])
    with torch.no_grad():
        for i in range(k):   # q[i] is the processed draft distribution at node i's parent
            torch.testing.assert_close(again.q[i], sampling.probs(drafter(seq[None])[0, -1]), atol=1e-5, rtol=1e-4)
            assert again.q[i, again.tokens[i]] > 0
            seq = torch.cat([seq, again.tokens[i:i + 1]])


def test_copy_of_the_target_is_accepted_every_time(tiny_target, tiny_target_dir):
    """A drafter that IS the target: every greedy chain draft is accepted, tau == k+1; a dynamic tree is lossless
    too (EAGLE-2 trees need not hold the greedy path: a less likely parent's confident child can outscore it)."""
    model, tok = tiny_target
    drafter = SmallLM.from_target(model, _cfg(init_from=tiny_target_dir), tok).eval()
    common = dict(sampling=Sampling(), max_new_tokens=20, eos_token_ids=[tok.eos_token_id], progress=False)
    prompts = _prompts(tok, 2)
    report = evaluate(model, drafter.proposer(model), prompts, spec=TreeSpec(kind="chain", draft_length=4), **common)
    assert report["lossless"] is True and report["acceptance_length"] == pytest.approx(5.0)
    spec = TreeSpec(kind="dynamic", depth=3, top_k=3, total_tokens=12)
    report = evaluate(model, drafter.proposer(model), prompts, spec=spec, **common)
    assert report["lossless"] is True and 1.0 <= report["acceptance_length"] <= 4.0
    assert report["mean_draft_nodes"] == pytest.approx(12)


def test_sampled_speculation_with_a_random_drafter_runs(tiny_target):
    model, tok = tiny_target
    torch.manual_seed(0)
    drafter = SmallLM.from_target(model, _cfg(num_layers=1), tok).eval()
    report = evaluate(model, drafter.proposer(model), _prompts(tok), spec=TreeSpec(kind="chain", draft_length=3),
                      sampling=Sampling(temperature=1.0), max_new_tokens=16, eos_token_ids=[tok.eos_token_id],
                      progress=False)
    assert 1.0 <= report["acceptance_length"] <= 4.0


@pytest.fixture(scope="module")
def exported(tiny_target, tmp_path_factory):
    model, tok = tiny_target
    torch.manual_seed(2)
    drafter = SmallLM.from_target(model, _cfg(num_layers=1), tok).eval()
    folder = drafter.export_pretrained(tmp_path_factory.mktemp("export") / "drafter", tok)
    return drafter, folder


def test_export_loads_with_auto_classes(exported, tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    drafter, folder = exported
    _, tok = tiny_target
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = _ids(tok, "The quick brown fox")[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, drafter(ids))
    assert AutoTokenizer.from_pretrained(str(folder)).get_vocab() == tok.get_vocab()


def test_exported_lora_drafter_is_merged(tiny_target, tiny_target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = tiny_target
    drafter = SmallLM.from_target(model, _cfg(init_from=tiny_target_dir, lora_r=2), tok).eval()
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    loaded = AutoModelForCausalLM.from_pretrained(str(drafter.export_pretrained(tmp_path / "x", tok))).eval()
    ids = _ids(tok, "Numbers: 0 1 2")[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, drafter(ids), atol=1e-5, rtol=1e-4)
    assert not any("lora" in n for n, _ in loaded.named_parameters())


def test_exported_drafter_as_assistant_model(exported, tiny_target):
    """transformers' assisted generation with our exported drafter == target-only greedy == our speculative
    decoding with the same drafter (same k, no early stop on draft confidence)."""
    from transformers import AutoModelForCausalLM

    drafter, folder = exported
    model, tok = tiny_target
    assistant = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    k, n = 4, 20
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        for prompt in _prompts(tok, 2):
            eos = [tok.eos_token_id]
            calls.clear()
            hf = model.generate(prompt[None], assistant_model=assistant, do_sample=False, max_new_tokens=n,
                                eos_token_id=eos, pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
            hf_forwards = len(calls)
            plain = model.generate(prompt[None], do_sample=False, max_new_tokens=n, eos_token_id=eos,
                                   pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
            ours = speculative_generate(model, drafter.proposer(model), prompt, TreeSpec(kind="chain", draft_length=k),
                                        Sampling(), n, eos)
            only = target_generate(model, prompt, n, eos)
            message = (f"transformers assisted: {hf_forwards} target forwards (prefill included); draftlab: "
                       f"{ours.rounds} rounds + 1 prefill; tokens hf={hf} ours={ours.tokens}")
            assert hf == plain == ours.tokens == only.tokens, message
            assert ours.rounds + 1 <= len(hf) and hf_forwards <= len(hf), message
    finally:
        hook.remove()


def test_target_layers_build_a_layer_skip_drafter(tiny_target):
    """drafter.target_layers: the target's own layers, final norm, embeddings and LM head. All of them in order
    is the target itself (same logits, every chain draft accepted); a subset keeps the chosen layers' weights and
    trains them, with the embeddings and head frozen; bad index lists are refused with one line."""
    model, tok = tiny_target
    whole = SmallLM.from_target(model, _cfg(target_layers=[0, -1]), tok).eval()
    ids = _ids(tok, "The quick brown fox")[None]
    assert whole.model.config.num_hidden_layers == 2
    assert torch.allclose(whole(ids), model(ids).logits, atol=1e-5)
    report = evaluate(model, whole.proposer(model), _prompts(tok, 2), spec=TreeSpec(kind="chain", draft_length=4),
                      sampling=Sampling(), max_new_tokens=16, eos_token_ids=[tok.eos_token_id], progress=False)
    assert report["lossless"] is True and report["acceptance_length"] == pytest.approx(5.0)

    last = SmallLM.from_target(model, _cfg(target_layers=[-1], num_layers=3), tok)
    assert last.model.config.num_hidden_layers == 1  # the list sets the depth
    mine, theirs = last.model.get_decoder(), model.get_decoder()
    for (name, p), q in zip(mine.layers[0].named_parameters(), theirs.layers[1].parameters()):
        assert torch.equal(p, q) and p.requires_grad, name
    assert torch.equal(mine.norm.weight, theirs.norm.weight) and mine.norm.weight.requires_grad
    saved = ckpt.trainable_state_dict(last)
    assert saved and not any("embed" in k or "lm_head" in k for k in saved)
    for bad, match in (([0, 0], "once"), ([1, 0], "order"), ([2], "outside"), ([-3], "outside")):
        with pytest.raises(ValueError, match=match):
            SmallLM.from_target(model, _cfg(target_layers=bad), tok)
    with pytest.raises(ValueError, match="target's shapes"):
        SmallLM.from_target(model, _cfg(target_layers=[0], hidden_size=32), tok)


def test_layer_skip_drafter_trains_saves_and_stays_lossless(tiny_target, tmp_path):
    model, tok = tiny_target
    drafter = SmallLM.from_target(model, _cfg(target_layers=[1]), tok).train()
    from draftlab.data import ChatDataset, collate

    rows = [[{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]
            for t in ("alpha beta gamma", "one two three four", "red green blue")]
    batch = collate([ChatDataset(rows, tok, 64)[i] for i in range(3)], tok.pad_token_id)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(10):
        loss, _ = drafter.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    ckpt.save_drafter(drafter, tmp_path / "step_1")
    loaded = load_drafter(tmp_path / "step_1", model).eval()
    ids = _ids(tok, "alpha beta")[None]
    assert torch.equal(loaded(ids), drafter.eval()(ids))
    report = evaluate(model, loaded.proposer(model), _prompts(tok, 2), spec=TreeSpec(kind="chain", draft_length=3),
                      sampling=Sampling(), max_new_tokens=12, eos_token_ids=[tok.eos_token_id], progress=False)
    assert report["lossless"] is True and 1.0 <= report["acceptance_length"] <= 4.0
