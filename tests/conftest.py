"""Shared fixtures: a tiny random Llama target with a small byte-level BPE tokenizer and a ChatML template.

Everything is built locally from `transformers`/`tokenizers` configs: no network, no hub, a few seconds.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and the target verifies them in one forward pass.",
    "def add(a, b):\n    return a + b\n",
    "Write a short poem about the sea, the wind and the stars.",
    "You are a tiny test assistant. Answer briefly and politely.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
] * 20


def build_tokenizer():
    """A byte-level BPE with ChatML special tokens (vocabulary of about 300)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def build_tiny_llama(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    # Sharpen the random model a little so greedy decoding is not a coin toss between near-equal logits.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def bench_script():
    """load(name): the module of bench/NAME.py (the benchmark scripts are files, not a package)."""
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tiny_tokenizer):
    """(model, tokenizer): a frozen 2-layer, hidden-64 random Llama. Do not modify it in a test."""
    model = build_tiny_llama(tiny_tokenizer)
    model.requires_grad_(False)
    return model, tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_target_4_layers(tiny_tokenizer):
    """(model, tokenizer): a frozen 4-layer tiny Llama, so EAGLE-3's three aux layers are not all the same."""
    model = build_tiny_llama(tiny_tokenizer, layers=4)
    model.requires_grad_(False)
    return model, tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_target, tmp_path_factory):
    """The tiny target saved as an HF folder (config, safetensors, tokenizer)."""
    model, tok = tiny_target
    path = tmp_path_factory.mktemp("tiny_target")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_chat_file(tmp_path_factory):
    """64 chat conversations (JSONL with `messages`)."""
    import json

    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    with open(path, "w") as f:
        for i in range(64):
            q = CORPUS[i % 6]
            msgs = [{"role": "user", "content": f"Repeat: {q}"}, {"role": "assistant", "content": q}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def tiny_prompt_file(tmp_path_factory):
    """8 evaluation prompts (JSONL with `messages`, one user turn)."""
    import json

    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(8):
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": CORPUS[i % 6]}]}) + "\n")
    return str(path)


def chat_prompt(tok, text: str):
    """One user turn, chat-templated with the assistant header: LongTensor [P]."""
    return torch.tensor(tok.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True)["input_ids"])


def greedy_answers(model, tok, texts, max_new_tokens: int = 48) -> list:
    """The model's greedy continuation of each text as a one-turn chat prompt, past EOS (`max_new_tokens` each):
    prompt + answer ids [P + max_new_tokens], the data the serving tests fit drafters on."""
    answers = []
    for text in texts:
        ids = chat_prompt(tok, text)
        answers.append(model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=tok.pad_token_id)[0])
    return answers


@pytest.fixture(scope="session")
def tiny_chat_prompts(tiny_target):
    """Three chat prompts for the tiny target (tensors [P])."""
    _, tok = tiny_target
    return [chat_prompt(tok, t) for t in ["The quick brown fox", "def add(a, b):", "Numbers: 0 1 2 3 4"]]


@pytest.fixture(scope="session")
def noisy_copy(tiny_target):
    """A drafter model that is the tiny target plus a little noise: it agrees with the target often, not always
    (tau about 2.6 with chains of 6)."""
    model, tok = tiny_target
    draft = build_tiny_llama(tok)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.006 * torch.randn(p.shape, generator=g))
    return draft.requires_grad_(False)
