"""EAGLE-3 head: multi-layer feature fusion, training-time test (TTT) and a reduced draft vocabulary.

Paper: Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test"
(NeurIPS 2025); method_specs.md 2.3. Drafting uses EAGLE-2 dynamic trees (and chains / static trees) through
the EAGLE-1 proposer, which this head plugs into unchanged.

What it optimises: the target's residual streams entering three decoder layers (low, middle, high; by default
`output_hidden_states` indices [2, L//2, L-3]) are concatenated and fused, g_t (3d) -> FC -> a_t (d). One
decoder layer reads [norm(emb(x_{t+1})); norm(s)] (2d) with the un-normed s as its residual and outputs o;
draft logits = own_lm_head(norm(o)) over a draft vocabulary of the most frequent assistant tokens. No feature
regression: the loss is the soft cross-entropy against the target's next-token distribution (from the
post-norm last state through the target's frozen LM head), restricted to the draft vocabulary and
renormalised, summed over TTT steps j = 0..S-1 with weights decay^j.

Training-time test (alignment, with n = T-1 pair slots, slot t at RoPE position t over valid pairs):
    step 0, slot t: hidden a_t, token x_{t+1}, position t; sees step-0 slots 0..t (causal).
    step j, slot t: hidden o^{(j-1)}_t (the head's own previous output, not detached), token x_{t+1+j},
        position t+j; sees step-0 slots 0..t and the step-1..j entries of slot t only (the diagonal).
    Its output predicts x_{t+2+j}: target = the target's distribution at position t+1+j; weight =
    loss_mask[t+2+j] (as in eagle.py: it counts when the drafted token is an assistant token). Unlike the
    reference we keep positions whose target argmax lies outside the draft vocabulary (as speculators does):
    the renormalised target still says which draftable token is best there, and knowing where the argmax lies
    would need the full 49k-row LM head at every position, which cost more than the rest of the step on a CPU.
    The target logits are computed for the draft-vocabulary rows only. Each step's loss is a mean over its valid
    slots (the reference divides by B*T instead; ours follows losses.py).
This is exactly the attention a draft node at depth j+1 has at inference: the real context up to t and its own
ancestors. Keys of earlier steps live in a KV cache (after RoPE), so step j runs one attention call over
(j+1) n keys with a block mask [causal | eye | ... | eye].

Options beside the paper's layout (each off by default, measured one at a time in bench/peer_ablation.py):
speculators' three norms (`norm_before_fc`, `norm_before_residual`, `norm_output`), a frozen draft LM head
(`train_lm_head=false`), speculators' loss rule (`loss_position=input`: the mask of the token read, x_{t+1+j}),
the loss on every real token of the conversation (`loss_tokens=all`) and noise on the fused states
(`feature_noise`). Packed batches (train.pack_tokens) keep every rule above inside one conversation.

Draft vocabulary: `prepare(dataset)` counts assistant tokens (loss_mask) and keeps the draft_vocab_size most
frequent (ties by id; -1 = auto: min(32000, distinct tokens), an explicit N above the distinct count is an error), sorted ascending as `draft_vocab`; d2t[i] = draft_vocab[i] - i (target id = i + d2t[i])
and t2d[v] = v in the draft vocabulary. The list is saved in drafter_config.json, so it survives save/load.
The proposer sees logits over the target vocabulary with -inf outside the draft vocabulary.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from draftlab import packing, vocab
from draftlab.drafters.eagle import EagleProposer, own_feature_steps, ttt_mask, with_feature_noise
from draftlab.drafters.options import DrafterConfig, DraftVocabOption, check_target_size, settings
from draftlab.serving import (copy_matching, decoder_layers, dense_config, embed_tokens, final_norm, layer_config,
                              report_init)
from draftlab.vocab import AUTO_DRAFT_VOCAB, expand_logits, vocab_maps



SPECULATORS_VERSION = "0.9.0"    # the speculators release whose config classes the export was checked with


@dataclass
class Eagle3Config(DraftVocabOption, DrafterConfig):
    """drafter.* keys of drafter.kind=eagle3."""
    kind: str = "eagle3"
    aux_layers: list[int] = field(default_factory=list)
    """Target hidden-state indices the head fuses ([] = [2, L//2, L-3] for an L-layer target)."""
    ttt_steps: int = 7
    """Training-time-test steps (the head is fed its own outputs this many times per position)."""
    ttt_decay: float = 0.8
    """Loss weight decay^j of training-time-test step j."""
    init_from_target: bool = False
    """Start the head's decoder layer from the target's last decoder layer (data-efficient start)."""
    norm_before_fc: bool = False
    """An RMSNorm over the concatenated aux states before the fusion FC (speculators' default layout)."""
    norm_before_residual: bool = False
    """The decoder layer's residual is the normed fused state instead of the raw one (speculators' default)."""
    norm_output: bool = False
    """Each TTT step's output is normed before it is fed back and before the draft LM head (speculators' default)."""
    train_lm_head: bool = True
    """Train the draft LM head (it starts as the target's rows of the draft vocabulary); false keeps it frozen at
    those rows, as speculators does (fewer trainable parameters; the rows are then not saved)."""
    loss_position: str = "drafted"
    """Which loss-mask entry weights TTT step j's prediction at slot t: `drafted` = that of the token it drafts
    (x_{t+2+j}), `input` = that of the token it reads (x_{t+1+j}, speculators' rule)."""
    loss_tokens: str = "assistant"
    """Which drafted tokens the loss counts: `assistant` (the loss mask) or `all` real tokens of the conversation
    (the target's distribution is known at prompt positions too: more training signal per conversation)."""
    feature_noise: float = 0.0
    """Width of the uniform noise U(-w/2, w/2) added to the fused target states in training (EAGLE-1's robustness
    to feature errors; 0 = off)."""

    @staticmethod
    def run_problem(cfg) -> str | None:
        from draftlab.drafters.options import layer_ids, whole_numbers_problem

        aux = layer_ids(cfg.drafter, "aux_layers")
        problem = whole_numbers_problem("aux_layers", aux)
        if problem:
            return problem
        if aux and (len(aux) < 2 or len(set(aux)) != len(aux)):
            return (f"config key 'drafter.aux_layers' is {aux}: EAGLE-3 fuses at least 2 different residual states "
                    "(or [] = [2, L//2, L-3] of an L-layer target)")
        return None

    @staticmethod
    def target_problem(drafter_cfg, text) -> str | None:
        from draftlab.drafters.options import layer_ids

        aux, layers = layer_ids(drafter_cfg, "aux_layers"), text.num_hidden_layers
        bad = [i for i in aux if not 0 <= i < layers]
        if bad:
            return (f"drafter.aux_layers={aux}: {bad} outside the target's {layers} decoder layers: EAGLE-3 fuses "
                    f"residual states 0..{layers - 1} (the post-norm state {layers} is not one)")
        return DrafterConfig.target_problem(drafter_cfg, text)

    @staticmethod
    def packs(drafter_cfg) -> bool:
        return True


LOSS_POSITIONS = ("drafted", "input")
LOSS_TOKENS = ("assistant", "all")


def default_aux_layers(num_layers: int) -> list[int]:
    """[2, L//2, L-3] (method_specs 2.3), clamped into 1..L-1 and sorted so small targets get valid indices;
    where that repeats a layer (L < 8), three distinct layers spread over 1..L-1 when there are three."""
    aux = sorted(min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))
    if len(set(aux)) < 3 and num_layers - 1 >= 3:
        aux = [1, num_layers // 2, num_layers - 1]
    return aux


class EagleHead3(nn.Module):
    """FC(g_t) -> one two-norm decoder layer -> o; logits = lm_head(norm(o)) over the draft vocabulary.

    The token embedding and the target's LM head (used only for the training target) are borrowed, frozen and
    never saved, as in EagleHead. `forward`/`logits` follow EagleHead's interface so EagleProposer drives it.
    """

    kind = "eagle3"
    config_class = Eagle3Config
    card_name = "EAGLE-3 head (multi-layer feature fusion, training-time test)"
    export_format = "speculators"   # vllm-project/speculators, which vLLM serves

    def __init__(self, target, aux_layers: list[int] | None = None, ttt_steps: int = Eagle3Config.ttt_steps,
                 ttt_decay: float = Eagle3Config.ttt_decay, draft_vocab_size: int = Eagle3Config.draft_vocab_size,
                 draft_vocab: list[int] | None = None, init_from_target: bool = Eagle3Config.init_from_target,
                 norm_before_fc: bool = Eagle3Config.norm_before_fc,
                 norm_before_residual: bool = Eagle3Config.norm_before_residual,
                 norm_output: bool = Eagle3Config.norm_output, train_lm_head: bool = Eagle3Config.train_lm_head,
                 loss_position: str = Eagle3Config.loss_position, loss_tokens: str = Eagle3Config.loss_tokens,
                 feature_noise: float = Eagle3Config.feature_noise):
        super().__init__()
        text = target.config.get_text_config(decoder=True)
        num_target_layers = text.num_hidden_layers
        # one dense Llama-style layer sized from the target, whatever its own layers are: what the engines build for
        # EAGLE-3 (serving.dense_config)
        config = dense_config(text, 1)
        aux = list(aux_layers) if aux_layers else default_aux_layers(num_target_layers)
        if len(aux) < 2 or not all(0 <= i < num_target_layers for i in aux):
            raise ValueError(f"drafter.aux_layers={aux}: EAGLE-3 fuses at least 2 residual states with indices in "
                             f"0..{num_target_layers - 1} (the post-norm state {num_target_layers} is not one)")
        if ttt_steps < 1:
            raise ValueError(f"drafter.ttt_steps={ttt_steps}: at least 1 training-time-test step is needed")
        if loss_position not in LOSS_POSITIONS:
            raise ValueError(f"drafter.loss_position={loss_position!r}: one of {', '.join(LOSS_POSITIONS)}")
        if loss_tokens not in LOSS_TOKENS:
            raise ValueError(f"drafter.loss_tokens={loss_tokens!r}: one of {', '.join(LOSS_TOKENS)}")
        self.train_lm_head, self.loss_position = train_lm_head, loss_position
        self.loss_tokens, self.feature_noise = loss_tokens, feature_noise
        self.aux_layers, self.ttt_steps, self.ttt_decay = aux, ttt_steps, ttt_decay
        self.init_from_target = init_from_target
        self.feature_layers = tuple(aux) + (-1,)       # the last state gives the training target distribution
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        vocab.check_size(draft_vocab_size)
        # -1 (auto): up to AUTO_DRAFT_VOCAB tokens, fewer when the data holds fewer distinct ones (set in prepare)
        self.auto_vocab = draft_vocab_size == -1 and draft_vocab is None
        if draft_vocab_size == -1:
            draft_vocab_size = len(set(draft_vocab)) if draft_vocab is not None else AUTO_DRAFT_VOCAB
        self.draft_vocab_size = draft_vocab_size if 0 < draft_vocab_size < config.vocab_size else 0

        d = config.hidden_size
        self.norm_before_fc, self.norm_before_residual = norm_before_fc, norm_before_residual
        self.norm_output = norm_output
        self.fc = nn.Linear(len(aux) * d, d, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        if norm_before_fc:
            self.input_norm = LlamaRMSNorm(len(aux) * d, eps=config.rms_norm_eps)
        self.emb_norm = copy.deepcopy(self.layer.input_layernorm)     # input_layernorm normalises the hidden s
        attn = self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):                    # attention reads [emb; hidden]: 2d wide
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * d, old.out_features, bias=old.bias is not None))
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, self.draft_vocab_size or config.vocab_size, bias=False)
        self.lm_head.requires_grad_(train_lm_head)   # frozen: not saved, rebuilt from the target's rows on load

        embed, target_head = target.get_input_embeddings(), target.get_output_embeddings()
        for module in (embed, target_head):
            module.requires_grad_(False)
        self._borrowed = SimpleNamespace(embed=embed, lm_head=target_head)
        self.rotary = LlamaRotaryEmbedding(config)      # the target's full-attention rope (no saved weights)
        if init_from_target:
            stack, name = decoder_layers(target)
            self._copy_target_layer(getattr(stack, name)[-1], final_norm(target))
        self.to(device=embed.weight.device)
        self.register_buffer("draft_vocab", torch.arange(self.lm_head.out_features, device=embed.weight.device),
                             persistent=False)
        self.vocab_ready = self.draft_vocab_size == 0
        if draft_vocab is not None:
            self.set_draft_vocab(draft_vocab)
        else:
            self._init_lm_head()

    def _copy_target_layer(self, last, final_norm) -> None:
        """Data-efficient start: the decoder layer begins as the target's last one where they compute the same
        thing (`serving.copy_matching`). Its q/k/v read the hidden half of [emb; hidden] with the target's weights
        (the embedding half starts at zero), both input norms start as the target's, the output norm as its final
        norm, and the fusion FC passes the highest fused layer through unchanged."""
        d = self.hidden_size
        skipped = set(copy_matching(self.layer, last, widen=d)[1])
        skipped.update(f"emb_norm <- {n or 'input_layernorm'}" for n in copy_matching(
            self.emb_norm, getattr(last, "input_layernorm", nn.Identity()))[1])
        skipped.update(f"norm <- final norm{n and '.' + n}" for n in copy_matching(self.norm, final_norm)[1])
        report_init(self.kind, skipped)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, -d:] = torch.eye(d)

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, cfg=None) -> "EagleHead3":
        """cfg: an Eagle3Config node or any object with its fields (missing ones and None = the defaults)."""
        own = settings(Eagle3Config, cfg)
        return cls(target, aux_layers=own.pop("aux_layers") or None, **own)

    def drafter_config(self) -> dict:
        if not self.vocab_ready:
            raise RuntimeError("the EAGLE-3 draft vocabulary was never built: call prepare(dataset) before saving")
        return {"kind": self.kind, "feature_layers": list(self.feature_layers), "aux_layers": self.aux_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "ttt_steps": self.ttt_steps, "ttt_decay": self.ttt_decay, "draft_vocab_size": self.draft_vocab_size,
                "init_from_target": self.init_from_target, "train_lm_head": self.train_lm_head,
                "loss_position": self.loss_position, "loss_tokens": self.loss_tokens,
                "feature_noise": self.feature_noise, "norm_before_fc": self.norm_before_fc,
                "norm_before_residual": self.norm_before_residual, "norm_output": self.norm_output,
                "draft_vocab": self.draft_vocab.tolist() if self.draft_vocab_size else None}

    @classmethod
    def from_config(cls, config: dict, target) -> "EagleHead3":
        check_target_size(cls.kind, config, target)
        own = {k: v for k, v in settings(Eagle3Config, config).items() if k not in ("aux_layers", "init_from_target")}
        return cls(target, aux_layers=config["aux_layers"], draft_vocab=config.get("draft_vocab"), **own)

    def prepare(self, dataset) -> None:
        """Build the draft vocabulary from the assistant-token frequencies of the training rows
        (dataset[i] = {input_ids, loss_mask}); a no-op for the full vocabulary."""
        if not self.draft_vocab_size:
            return
        counts = vocab.assistant_token_counts(dataset)
        size = -1 if self.auto_vocab else self.draft_vocab_size
        ids = vocab.choose(counts, size, self.vocab_size, who="eagle3")
        if len(ids) != self.lm_head.out_features:   # auto on small data: every distinct token it holds
            self.draft_vocab_size = len(ids)
            old = self.lm_head
            self.lm_head = nn.Linear(old.in_features, len(ids), bias=False).to(old.weight.device, old.weight.dtype)
            self.lm_head.requires_grad_(self.train_lm_head)
        self.set_draft_vocab(ids)

    def set_draft_vocab(self, token_ids: list[int]) -> None:
        """Install a draft vocabulary (any order; stored ascending) and initialise the LM head rows from it."""
        ids = vocab.as_tensor(token_ids, self.vocab_size, self.draft_vocab.device)
        if self.draft_vocab_size and len(ids) != self.draft_vocab_size:
            raise ValueError(f"a draft vocabulary of {len(ids)} distinct tokens for draft_vocab_size="
                             f"{self.draft_vocab_size}")
        self.draft_vocab = ids
        self.vocab_ready = True
        self._init_lm_head()

    def _init_lm_head(self) -> None:
        """Start from the target's LM-head rows of the draft tokens (the reference starts from random: ours
        makes short runs converge sooner and is overwritten by loaded weights)."""
        with torch.no_grad():
            self.lm_head.weight.copy_(self._borrowed.lm_head.weight[self.draft_vocab])

    def checkpoint_tensors(self) -> dict[str, dict[str, Tensor]]:
        """Saved beside the weights (checkpoint.save_drafter): the draft-vocabulary maps, as EAGLE-3 names them.
        Loading rebuilds them from drafter_config.json's draft_vocab; this file is for other tools."""
        if not self.draft_vocab_size:
            return {}
        d2t, t2d = vocab_maps(self.draft_vocab, self.vocab_size)
        return {"d2t_t2d.safetensors": {"d2t": d2t, "t2d": t2d}}

    @property
    def d2t(self) -> Tensor:
        return vocab_maps(self.draft_vocab, self.vocab_size)[0]

    @property
    def t2d(self) -> Tensor:
        return vocab_maps(self.draft_vocab, self.vocab_size)[1]

    # --- the network ---------------------------------------------------------------------------------------
    def forward(self, features: Tensor, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None,
                cache: DynamicCache | None = None) -> Tensor:
        """features [B,S,A*d] fused target states g_t, or [B,S,d] the head's own earlier outputs (fed raw, as at
        inference); input_ids [B,S]; position_ids [B,S]; attention_mask additive [B,1,S,K] (K = cached + S);
        cache: the head's KV cache, extended in place. Returns o [B,S,d] (un-normed; normed with norm_output)."""
        dtype = self.fc.weight.dtype
        s = features.to(dtype)
        if s.shape[-1] != self.hidden_size:
            s = self.fc(self.input_norm(s) if self.norm_before_fc else s)
        emb = embed_tokens(self._borrowed.embed, input_ids).to(dtype)
        normed = self.layer.input_layernorm(s)
        u = torch.cat([self.emb_norm(emb), normed], dim=-1)
        position_embeddings = self.rotary(s, position_ids)
        if attention_mask is not None:
            attention_mask = attention_mask.to(s.dtype)
        attn = self.layer.self_attn(hidden_states=u, position_embeddings=position_embeddings,
                                    attention_mask=attention_mask, past_key_values=cache)[0]
        h = (normed if self.norm_before_residual else s) + attn
        o = h + self.layer.mlp(self.layer.post_attention_layernorm(h))
        return self.norm(o) if self.norm_output else o

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] -> logits over the draft vocabulary [..., Vd]."""
        hidden = hidden.to(self.lm_head.weight.dtype)
        return self.lm_head(hidden if self.norm_output else self.norm(hidden))

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] -> logits over the target vocabulary [..., V], -inf outside the draft vocabulary."""
        return self.logits_from_draft(self.draft_logits(hidden))

    def logits_from_draft(self, small: Tensor) -> Tensor:
        """Draft logits [..., Vd] -> logits over the target vocabulary [..., V], -inf outside the draft vocabulary."""
        return expand_logits(small, self.draft_vocab, self.vocab_size) if self.draft_vocab_size else small

    def to_target(self, index: Tensor) -> Tensor:
        """Indices into `draft_logits`' last dimension -> target token ids."""
        return self.draft_vocab[index] if self.draft_vocab_size else index

    ttt_mask = staticmethod(ttt_mask)

    def ttt_outputs(self, aux: Tensor, input_ids: Tensor, valid: Tensor, docs: Tensor | None = None) -> list[Tensor]:
        """The head's outputs o^{(j)} [B,n,d] for steps j = 0..min(S, n)-1. aux [B,n,A*d]: fused states g_t of
        slots t = 0..n-1; input_ids [B,n+1] (x_0..x_n); valid [B,n] bool: slot t is a real pair; docs [B,n]: the
        slots' conversations in a packed row (None: one per row)."""
        return own_feature_steps(self, aux.to(self.fc.weight.dtype), input_ids, valid, self.ttt_steps, docs=docs)

    def loss(self, batch: dict, features: Tensor) -> tuple[Tensor, dict[str, float]]:
        """batch: input_ids, attention_mask, loss_mask [B,T]; features [B,T,(A+1)d] = aux states then the
        post-norm last state. Returns sum_j decay^j * CE_j (see the module docstring for the alignment)."""
        from draftlab.losses import soft_cross_entropy

        if not self.vocab_ready:
            raise RuntimeError("the EAGLE-3 draft vocabulary was never built: call prepare(dataset) first")
        ids, docs = batch["input_ids"], packing.doc_ids(batch)
        d, T = self.hidden_size, ids.shape[1]
        n = T - 1
        with torch.no_grad():   # the target's logits on the draft vocabulary only: the full head is never needed
            last = features[..., -d:].to(self._borrowed.lm_head.weight.dtype)
            rows = self._borrowed.lm_head.weight[self.draft_vocab] if self.draft_vocab_size else None
            target_logits = F.linear(last, rows) if rows is not None else self._borrowed.lm_head(last)  # [B,T,Vd]
        wanted = (batch["loss_mask"].bool() if self.loss_tokens == "assistant" else torch.ones_like(docs, dtype=torch.bool))
        wanted &= docs > 0

        valid = packing.same_doc(docs, 1)               # slot t: g_t and x_{t+1} real, in one conversation
        total = torch.zeros((), device=ids.device)
        metrics: dict[str, float] = {}
        aux = with_feature_noise(features[:, :-1, :-d], self.feature_noise, self.training)
        for j, hidden in enumerate(self.ttt_outputs(aux, ids, valid, docs[:, :-1])):
            weight = torch.zeros_like(valid)
            if n - 1 - j > 0:                        # drafted token x_{t+2+j} inside slot t's conversation
                counts = wanted[:, 2 + j:] if self.loss_position == "drafted" else wanted[:, 1 + j: T - 1]
                weight[:, : n - 1 - j] = counts & packing.same_doc(docs, 2 + j)
            weight &= valid
            # The draft LM head and the softmax run only on the slots the loss counts ([1, N, Vd], N = weighted
            # slots): on assistant-only losses that is well under the [B, n, Vd] of every slot.
            rows, cols = weight.nonzero(as_tuple=True)
            logits = self.draft_logits(hidden[rows, cols])[None]
            target = target_logits[rows, cols + 1 + j][None]                 # the target's distribution at t+1+j
            counted = torch.ones(logits.shape[:2], device=logits.device)
            step_loss = soft_cross_entropy(logits, target, counted)
            total = total + self.ttt_decay ** j * step_loss
            agree = logits.argmax(-1) == target.argmax(-1)
            metrics[f"acc_{j}"] = agree.float().mean().item() if agree.numel() else 0.0
            metrics[f"loss_{j}"] = step_loss.item()
        return total, metrics

    def proposer(self, target=None, **opts) -> "EagleProposer3":
        return EagleProposer3(self)

    # --- export --------------------------------------------------------------------------------------------
    @staticmethod
    def export(src, out: Path, meta: dict) -> dict:
        """EAGLE-3 in the speculators format that vLLM serves. Config: vllm-project/speculators
        src/speculators/config.py (`SpeculatorModelConfig`, `SpeculatorsConfig`, `VerifierConfig`),
        src/speculators/models/eagle3/config.py (`Eagle3SpeculatorConfig`), proposals/greedy.py; the full template is
        NVIDIA/TensorRT-Model-Optimizer examples/speculative_decoding/scripts/convert_to_vllm_ckpt.py. Weights:
        speculators/models/eagle3/core.py + model_definitions.py: fc, layers.0.* whose input_layernorm normalises the
        token embedding and hidden_norm the fused state (our emb_norm and layer.input_layernorm), norm, lm_head, and
        d2t (int64 [Vd], target id = draft id + d2t) / t2d (bool [V]) when the draft vocabulary is reduced."""
        renamed = {"emb_norm.weight": "layers.0.input_layernorm.weight",
                   "layer.input_layernorm.weight": "layers.0.hidden_norm.weight"}
        weights = {renamed.get(k, k.replace("layer.", "layers.0.", 1) if k.startswith("layer.") else k): v.contiguous()
                   for k, v in src.weights.items()}
        text = src.target_config()
        vocab_size = text.vocab_size
        # the draft's (frozen) token embedding is the target's: carried, so speculators' loader need not refill it from
        # the verifier (the issue saw it left at zero without it)
        target = src.target()[0]
        dtype = weights["fc.weight"].dtype
        weights["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to("cpu", dtype).contiguous()
        draft_vocab = src.config.get("draft_vocab")
        if "lm_head.weight" not in weights:   # a frozen draft LM head is not saved: the target's rows it kept
            rows = target.get_output_embeddings().weight.detach()
            rows = rows[torch.tensor(sorted(draft_vocab), device=rows.device)] if draft_vocab else rows
            weights["lm_head.weight"] = rows.to("cpu", dtype).clone()   # its own storage: a tied target's rows are the embedding
        if draft_vocab:
            ids = torch.tensor(sorted(draft_vocab), dtype=torch.long)
            weights["d2t"] = ids - torch.arange(len(ids))
            weights["t2d"] = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
        k = int(meta.get("draft_length") or 5)
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                      "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": src.verifier, "architectures": src.architectures()},
            },
            "transformer_layer_config": layer_config(text, 1),
            "draft_vocab_size": len(draft_vocab) if draft_vocab else vocab_size,
            # draftlab's own heads keep the un-normalised fused state as the first layer's residual (vLLM's default is
            # True) and use neither extra norm; heads imported from speculators keep their settings
            "norm_before_residual": bool(src.config.get("norm_before_residual", False)),
            "norm_before_fc": bool(src.config.get("norm_before_fc", False)),
            "norm_output": bool(src.config.get("norm_output", False)),
            "target_hidden_size": text.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(src.config["aux_layers"]),
            "torch_dtype": str(weights["fc.weight"].dtype).removeprefix("torch."),
        }
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        aux = list(src.config["aux_layers"])
        return {"aux_layers": aux, "draft_vocab_size": config["draft_vocab_size"],
                "repeated_aux": len(set(aux)) < len(aux)}


class EagleProposer3(EagleProposer):
    """EagleProposer over an EagleHead3: the same cache of real pairs and draft entries, chains, EAGLE-2
    dynamic trees and static trees. Only the features differ: the fused aux states (no post-norm state)."""

    def __init__(self, head: EagleHead3):
        self.feature_layers = tuple(head.aux_layers)
        super().__init__(head)
