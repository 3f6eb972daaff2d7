"""EAGLE head: a feature-level autoregressive draft head (EAGLE-1 architecture, EAGLE-2 dynamic trees).

Papers: Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (ICML 2024) and
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (EMNLP 2024); method_specs.md 2.1-2.2.

What it optimises: from the target's last hidden state f_t (after the final norm, the LM-head input) and the
token x_{t+1}, one (or a few) Llama decoder layers predict the next hidden state f_{t+1}. The loss is
smooth-L1 regression on f_{t+1} plus a soft cross-entropy between the head's token distribution
lm_head(f^_{t+1}) and the target's own softmax(lm_head(f_{t+1})), both read through the target's frozen LM head.

Alignment (the same in `loss`, `forward` and the proposer):
    pair t = (f_t, x_{t+1}) sits at RoPE position t (counted over valid pairs, so left padding is harmless)
    and is causal over pairs 0..t; its output f^_{t+1} is regressed on f_{t+1}, and lm_head(f^_{t+1}) is
    matched to the target's distribution of x_{t+2}. Pair t is weighted by loss_mask[t+2]: the head is
    being taught to draft token x_{t+2}, so it counts when that token is an assistant token. The last pair
    (t = T-2) drafts a token outside the sample and gets weight 0.
Noise: uniform U(-std/2, std/2) on the input features only, in training only. We leave out the reference
code's extra factor 512/T: it makes the noise depend on the sample length (about +-0.8 at 64 tokens,
+-0.05 at 2048), while the paper describes a fixed U(-0.1, 0.1), which std = 0.2 gives here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from draftlab import drafting, packing, vocab
from draftlab.drafters.options import (DrafterConfig, DraftVocabOption, EagleHeadOptions, check_target_size,
                                       setting_names, settings)
from draftlab.errors import HubError
from draftlab.serving import copy_matching, decoder_layers, dense_config, embed_tokens, layer_config, report_init
from draftlab.trees import additive


@dataclass
class EagleConfig(EagleHeadOptions, DraftVocabOption, DrafterConfig):
    """drafter.* keys of drafter.kind=eagle (feature_noise, reg_weight, cls_weight, fc_bias: EagleHeadOptions)."""
    kind: str = "eagle"
    num_layers: int = 1
    """Decoder layers in the head."""
    init_from_target: bool = False
    """Start the head's decoder layer from the target's last decoder layer (data-efficient start)."""
    harmonized_steps: int = 1
    """HASS harmonized context alignment: forwards per batch, step j fed the head's own step j-1 features (as a
    draft node at depth j+1 sees them); 1 = plain EAGLE training (method_specs 2.4)."""
    topk_weight: float = 0.0
    """Weight of HASS's top-K distillation term (the soft CE on the target's 10 most likely tokens)."""

    @staticmethod
    def packs(drafter_cfg) -> bool:
        return True


def ttt_mask(valid: Tensor, step: int, docs: Tensor | None = None) -> Tensor:
    """Visibility of training-time-test step `step`'s queries, bool [B, n, (step+1) n]: block 0 = step-0 slots
    0..t that are valid (plus t itself at step 0, so no row is empty), then one identity block per step 1..step:
    slot t at step j sees the real context up to t and its own earlier steps, as a draft node at depth j+1 does.
    docs [B, n]: the slots' documents in a packed row (`draftlab.packing`); a slot sees its own document only."""
    n = valid.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=valid.device)
    first = causal & valid[:, None, :]
    if docs is not None:
        first = first & (docs[:, :, None] == docs[:, None, :])
    if step == 0:
        return first | eye
    return torch.cat([first] + [eye.expand_as(first)] * step, dim=-1)


def own_feature_steps(head: nn.Module, first: Tensor, input_ids: Tensor, valid: Tensor, steps: int,
                      detach: bool = False, docs: Tensor | None = None) -> list[Tensor]:
    """Training-time test (EAGLE-3) / harmonized context alignment (HASS): the head's outputs o^{(j)} [B,n,d] for
    steps j = 0..min(steps, n)-1. Step 0 reads `first` [B,n,F] (target features of slots t = 0..n-1) with token
    x_{t+1}; step j reads the head's own step j-1 output at slot t with token x_{t+1+j}, at position t+j, over a
    KV cache of the earlier steps (`ttt_mask`). input_ids [B,n+1] (x_0..x_n); valid [B,n] bool (slot t is a real
    pair). detach: feed the own outputs back without gradient (HASS) or with it (EAGLE-3). docs [B,n]: the slots'
    documents in a packed row (positions restart and attention stays inside each; None = one per row)."""
    n = valid.shape[1]
    dtype = first.dtype
    if docs is None:
        docs = torch.ones_like(valid, dtype=torch.long)
    positions = packing.positions(valid, docs)                       # left padding is harmless
    hidden, cache, outputs = first, DynamicCache(), []
    for j in range(min(steps, n)):
        tokens = torch.zeros_like(input_ids[:, 1:])
        tokens[:, : n - j] = input_ids[:, 1 + j:]                     # x_{t+1+j}; past the row: ignored
        mask = additive(ttt_mask(valid, j, docs)[:, None], dtype)
        hidden = head(hidden.detach() if detach and j > 0 else hidden, tokens, positions + j, mask, cache)
        outputs.append(hidden)
    return outputs


def ahead(features: Tensor, wanted: Tensor, docs: Tensor, valid: Tensor, offset: int) -> tuple[Tensor, Tensor]:
    """What slot t is scored on when it drafts `offset` tokens past the next one: the target feature
    f_{t+1+offset} [B,n,d] (zeros past the row) and its weight [B,n] (float), 1 where slot t is a real pair
    (valid [B,n]) and x_{t+2+offset} is an assistant token (wanted [B,T]) of the same conversation (docs [B,T]).
    features [B,T,d] = f_0..f_{T-1}, n = T-1."""
    n = valid.shape[1]
    target = features.new_zeros(features.shape[0], n, features.shape[-1])
    target[:, : max(n - offset, 0)] = features[:, 1 + offset:]
    weight = torch.zeros_like(valid, dtype=features.dtype)
    if n - 1 - offset > 0:
        weight[:, : n - 1 - offset] = (wanted[:, 2 + offset:] & packing.same_doc(docs, 2 + offset)).to(features.dtype)
    return target, weight * valid


def with_feature_noise(x: Tensor, width: float, training: bool) -> Tensor:
    """Training-time noise on fed-back target features: uniform in [-width/2, width/2] (none in eval or at 0)."""
    return x + (torch.rand_like(x) - 0.5) * width if training and width > 0 else x


class EagleHead(nn.Module):
    """FC([emb(x_{t+1}); f_t]) -> Llama decoder layer(s) -> f^_{t+1}; tokens via the target's frozen LM head.

    The embedding, LM head and rotary embedding are the target's own modules, held outside this module's
    tree: they are never trained, never saved, and `.to()` on the head cannot alter the target.
    """

    kind = "eagle"
    config_class = EagleConfig
    card_name = "EAGLE-1/2 head (feature-level autoregressive draft head)"
    export_format = "eagle"         # the official EAGLE-1/2 layout
    feature_layers = (-1,)

    def __init__(self, target, num_layers: int = EagleConfig.num_layers,
                 feature_noise: float = EagleConfig.feature_noise, reg_weight: float = EagleConfig.reg_weight,
                 cls_weight: float = EagleConfig.cls_weight, fc_bias: bool = EagleConfig.fc_bias,
                 draft_vocab_size: int = EagleConfig.draft_vocab_size,
                 init_from_target: bool = EagleConfig.init_from_target,
                 harmonized_steps: int = EagleConfig.harmonized_steps, topk_weight: float = EagleConfig.topk_weight,
                 draft_vocab: list[int] | None = None):
        super().__init__()
        # a dense Llama-style stack sized from the target, whatever the target's own layers are (serving.dense_config)
        config = dense_config(target.config.get_text_config(decoder=True), num_layers)
        self.num_layers, self.feature_noise = num_layers, feature_noise
        self.reg_weight, self.cls_weight, self.fc_bias = reg_weight, cls_weight, fc_bias
        vocab.check_size(draft_vocab_size)
        self.draft_vocab_size, self.init_from_target = draft_vocab_size, init_from_target
        if harmonized_steps < 1:
            raise ValueError(f"drafter.harmonized_steps={harmonized_steps}: at least 1 (1 = plain EAGLE training)")
        self.harmonized_steps, self.topk_weight = harmonized_steps, topk_weight
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        from draftlab.target import target_fingerprint
        self.target_fingerprint = target_fingerprint(target)

        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, layer_idx=i) for i in range(num_layers))
        # EAGLE-1: the fused input is not normalised before the first attention.
        self.layers[0].input_layernorm = nn.Identity()

        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        for module in (embed, lm_head):
            module.requires_grad_(False)
        self._borrowed = SimpleNamespace(embed=embed, lm_head=lm_head)
        self.rotary = LlamaRotaryEmbedding(config)      # the target's full-attention rope (no saved weights)
        self.draft_head = vocab.DraftHead(lm_head, self.vocab_size)
        if init_from_target:
            self._copy_target_layers(target)
        self.to(device=embed.weight.device)
        if draft_vocab is not None:
            self.draft_head.set_vocab(draft_vocab)

    def _copy_target_layers(self, target) -> None:
        """Data-efficient start: the head's decoder layers begin as the target's last ones (which already map a
        late hidden state to the next one); the fusion FC starts as [0 | I], passing f_t through unchanged."""
        skipped = set()
        stack, name = decoder_layers(target)
        for mine, theirs in zip(self.layers, getattr(stack, name)[-len(self.layers):]):
            skipped.update(copy_matching(mine, theirs)[1])
        report_init(self.kind, skipped)
        with torch.no_grad():
            d = self.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, d:] = torch.eye(d)
            if self.fc.bias is not None:
                self.fc.bias.zero_()

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, cfg=None) -> "EagleHead":
        """cfg: a config_class node or any object with its fields (missing ones and None = the defaults)."""
        return cls(target, **settings(cls.config_class, cfg))

    def drafter_config(self) -> dict:
        """JSON-able: kind, hyper-parameters, and the fingerprint of the target it was built on."""
        return {"kind": self.kind, "feature_layers": list(self.feature_layers),
                **{k: getattr(self, k) for k in setting_names(self.config_class)}, "target": dict(self.target_fingerprint),
                "draft_vocab": self.draft_head.draft_vocab.tolist() if self.draft_head.reduced else None}

    @classmethod
    def from_config(cls, config: dict, target) -> "EagleHead":
        """Rebuild (untrained weights) from `drafter_config()` output; load the state dict afterwards."""
        check_target_size(cls.kind, config.get("target") or {}, target)
        own = {k: v for k, v in settings(cls.config_class, config).items() if k != "init_from_target"}
        return cls(target, **own, draft_vocab=config.get("draft_vocab"))

    def prepare(self, dataset) -> None:
        """Choose the draft vocabulary (drafter.draft_vocab_size) from the training rows' assistant tokens."""
        if self.draft_vocab_size:
            self.draft_head.set_vocab(vocab.choose(vocab.assistant_token_counts(dataset), self.draft_vocab_size,
                                             self.vocab_size, who=self.kind))

    def checkpoint_tensors(self) -> dict[str, dict[str, Tensor]]:
        return self.draft_head.maps()

    # --- the network ---------------------------------------------------------------------------------------
    def forward(self, features: Tensor, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None,
                cache: DynamicCache | None = None) -> Tensor:
        """features [B,S,d] (f_t), input_ids [B,S] (x_{t+1}), position_ids [B,S], attention_mask: additive
        [B,1,S,K] with K = cached pairs + S (None: attend to everything), cache: the head's KV cache, extended
        in place. Returns the predicted next features f^_{t+1}, [B,S,d]."""
        hidden = self.fuse(features, input_ids)
        position_embeddings = self.rotary(hidden, position_ids)
        if attention_mask is not None:
            attention_mask = attention_mask.to(hidden.dtype)
        for layer in self.layers:
            out = layer(hidden, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                        use_cache=cache is not None, position_embeddings=position_embeddings)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def fuse(self, features: Tensor, input_ids: Tensor) -> Tensor:
        """FC([emb(x_{t+1}); f_t]): features [..., d], input_ids [...] -> the decoder's input [..., d]."""
        dtype = self.fc.weight.dtype
        emb = embed_tokens(self._borrowed.embed, input_ids).to(dtype)
        return self.fc(torch.cat([emb, features.to(dtype)], dim=-1))

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] -> logits [..., V] through the target's frozen LM head (-inf outside a draft vocabulary)."""
        return self.draft_head.full(hidden)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] -> logits over the draft vocabulary [..., Vd] (V rows without one); see `to_target`."""
        return self.draft_head.small(hidden)

    def to_target(self, index: Tensor) -> Tensor:
        """Indices into `draft_logits`' last dimension -> target token ids."""
        return self.draft_head.to_target(index)

    def logits_from_draft(self, small: Tensor) -> Tensor:
        """Draft logits [..., Vd] -> logits over the target vocabulary [..., V], -inf outside the draft vocabulary."""
        return self.draft_head.expand(small)

    def loss_inputs(self, batch: dict, features: Tensor) -> tuple[Tensor, ...]:
        """What an EAGLE-style loss starts from: (ids [B,T], document ids [B,T], features in the head's dtype,
        valid [B,T-1] (f_t and x_{t+1} real, in one conversation), wanted [B,T] (loss tokens of real documents), the
        fed inputs f_{<T} [B,T-1,d] with training-time feature noise)."""
        ids, docs = batch["input_ids"], packing.doc_ids(batch)
        features = features.to(self.fc.weight.dtype)
        valid = packing.same_doc(docs, 1)
        wanted = batch["loss_mask"].bool() & (docs > 0)
        inputs = with_feature_noise(features[:, :-1], self.feature_noise, self.training)
        return ids, docs, features, valid, wanted, inputs

    def loss(self, batch: dict, features: Tensor) -> tuple[Tensor, dict[str, float]]:
        """batch: input_ids, attention_mask, loss_mask [B,T]; features [B,T,d] = target features f_t.
        Returns the sum over harmonized steps j of reg_weight * L_reg + cls_weight * L_cls (+ topk_weight * L_topk),
        see the module docstring for the alignment; one step is plain EAGLE training."""
        from draftlab.losses import topk_cross_entropy

        ids, docs, features, valid, wanted, inputs = self.loss_inputs(batch, features)
        outputs = own_feature_steps(self, inputs, ids, valid, self.harmonized_steps, detach=True, docs=docs[:, :-1])
        total, metrics = features.new_zeros(()), {}
        for j, pred in enumerate(outputs):
            # step j, slot t: o^{(j)}_t predicts f_{t+1+j} and drafts x_{t+2+j}, which must be an assistant token
            target, weight = ahead(features, wanted, docs, valid, j)
            terms = self.feature_terms(pred, target, weight)
            loss_reg, loss_cls, acc = terms.reg, terms.cls, terms.acc
            step_loss = self.reg_weight * loss_reg + self.cls_weight * loss_cls
            if self.topk_weight > 0:     # HASS: extra weight on the target's top-10 tokens
                step_loss = step_loss + self.topk_weight * topk_cross_entropy(terms.logits, terms.target_logits,
                                                                              terms.weight, 10)
            total = total + step_loss
            suffix = "" if j == 0 else f"_{j}"
            metrics.update({f"loss_reg{suffix}": loss_reg.item(), f"loss_cls{suffix}": loss_cls.item(),
                            f"acc{suffix}": acc.item()})
        return total, metrics

    def feature_terms(self, pred: Tensor, target: Tensor, weight: Tensor) -> SimpleNamespace:
        """The two EAGLE terms of predicted features pred [B,n,d] against target features [B,n,d], weighted by
        weight [B,n] (0 = not counted): reg (SmoothL1), cls (soft CE of lm_head(pred) against softmax(lm_head(
        target))), acc (argmax agreement), and the selected logits / target_logits [1,N,Vd] and weight [1,N]."""
        from draftlab.losses import masked_smooth_l1, soft_cross_entropy

        loss_reg = masked_smooth_l1(pred.float(), target.float(), weight)
        # The vocabulary projection dominates the step: run it only where the loss looks ([N, V], N = pairs).
        keep = weight > 0
        # Over a draft vocabulary both sides use its rows only: the target's distribution renormalised on it.
        logits = self.draft_head.small(pred[keep])[None]
        with torch.no_grad():
            target_logits = self.draft_head.small(target[keep])[None]
        sel_weight = weight[keep][None]
        loss_cls = soft_cross_entropy(logits, target_logits, sel_weight)
        agree = (logits.argmax(-1) == target_logits.argmax(-1)).to(weight.dtype)
        acc = (agree * sel_weight).sum() / sel_weight.sum().clamp(min=1)
        return SimpleNamespace(reg=loss_reg, cls=loss_cls, acc=acc, logits=logits, target_logits=target_logits,
                               weight=sel_weight)

    def proposer(self, target=None, **opts) -> "EagleProposer":
        return EagleProposer(self, **opts)

    # --- export --------------------------------------------------------------------------------------------
    @staticmethod
    def export(src, out: Path, meta: dict) -> dict:
        """EAGLE-1/2 in the layout of the official EAGLE code: SafeAILab/EAGLE eagle/model/cnets1.py `Model`
        (loaded by eagle/model/ea_model.py `EaModel.from_pretrained`, which reads config.json and pytorch_model.bin
        in eagle-llm 1.2.1, model.safetensors in the current repository with `use_eagle3=False`: both are written).
        Its names are ours (fc.*, layers.{i}.*, no input_layernorm in layer 0) plus embed_tokens.weight, the target's
        embedding, which the older strict loaders require. config.json's `bias` is the head's FC bias: the official
        code builds its FC from it, and vLLM (llama.py) reads the same key as an attention bias, so a head trained with
        `fc_bias=false` says false and carries no fc.bias (with `true`, vLLM builds an o_proj bias it never loads
        and accepts nothing)."""
        text = src.target_config()
        weights = dict(src.weights)
        layers, dtype = src.config.get("num_layers", 1), weights["fc.weight"].dtype
        fc_bias = "fc.bias" in weights
        weights["embed_tokens.weight"] = src.target()[0].get_input_embeddings().weight.detach().to("cpu", dtype)
        qkv_bias = "layers.0.self_attn.q_proj.bias" in weights
        linear = [f"self_attn.{n}_proj" for n in "qkvo"] + [f"mlp.{n}_proj" for n in ("gate", "up", "down")]
        names = [f"{n}.weight" for n in linear] + ["post_attention_layernorm.weight"]
        names += [f"self_attn.{n}_proj.bias" for n in "qkv" if qkv_bias]
        expected = {"fc.weight", "embed_tokens.weight", *["fc.bias"] * fc_bias} | {
            f"layers.{i}.{n}" for i in range(layers) for n in names + ["input_layernorm.weight"] * (i > 0)}
        if set(weights) != expected:
            odd = sorted(set(weights) ^ expected)[:3]
            raise HubError(f"this eagle head has weights the official EAGLE code does not know ({odd}): it was trained "
                           f"before draftlab built dense Llama draft layers for {text.model_type} targets; retrain it, "
                           "or export with --format draftlab")
        weights = {k: v.contiguous() for k, v in weights.items()}
        save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
        torch.save(weights, out / "pytorch_model.bin")       # what eagle-llm 1.2.1's EaModel.from_pretrained reads
        config = {"architectures": ["LlamaForCausalLM"], **layer_config(text, layers),
                  "bias": fc_bias, "qkv_bias": qkv_bias, "torch_dtype": str(dtype).removeprefix("torch.")}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return {"fc_bias": fc_bias, "num_layers": layers}


class EagleProposer:
    """Drafts chains and trees (`drafting`) with an EagleHead over its own KV cache of real pairs (f_t, x_{t+1}).

    After each commit the cache holds exactly the pairs 0..N-1 of the committed sequence x_0..x_N, and the
    head's output at pair N-1, f^_N, gives the draft distribution of x_{N+1}. Drafting appends draft-only
    entries (a draft node at depth j is the pair (f^ of its parent, node token) at position N+j-1); the next
    round drops them.
    """

    feature_layers = (-1,)
    max_depth = None

    def __init__(self, head: EagleHead):
        self.head = head
        self.reset(torch.zeros(0, dtype=torch.long))

    def reset(self, prompt_ids: Tensor) -> None:
        device = self.head.fc.weight.device
        self.tokens = prompt_ids.reshape(-1).to(device)           # the committed sequence x_0..x_N
        self.pending = None                                       # features whose next token is not known yet
        self.cache = DynamicCache()
        self.num_real = 0                                         # real pairs in the cache
        self.root_hidden = self.root_logits = None                # f^_N [d] and its draft logits [Vd]

    @torch.no_grad()
    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        """tokens [n] newly committed; features [m, d] target features at the positions processed since the
        last commit (pair t needs the token after it, which the protocol always provides)."""
        self._drop_drafts()
        self.tokens = torch.cat([self.tokens, tokens.reshape(-1).to(self.tokens.device)])
        if features is not None:
            self.pending = features if self.pending is None else torch.cat([self.pending, features])
        if self.pending is None:
            return
        n = min(len(self.pending), len(self.tokens) - 1 - self.num_real)
        if n <= 0:
            return
        start = self.num_real
        positions = torch.arange(start, start + n, device=self.tokens.device)
        visible = torch.ones(n, start + n, dtype=torch.bool, device=self.tokens.device).tril(start)
        out = self.head(self.pending[:n][None], self.tokens[start + 1:start + 1 + n][None], positions[None],
                        additive(visible, self.head.fc.weight.dtype), self.cache)
        self.pending = self.pending[n:] if n < len(self.pending) else None
        self.num_real += n
        self.root_hidden = out[0, -1]
        self.root_logits = self.head.draft_logits(self.root_hidden).float()

    def _drop_drafts(self) -> None:
        extra = self.cache.get_seq_length() - self.num_real
        if extra > 0:
            self.cache.crop(-extra)

    def root(self) -> Tensor:
        if self.root_hidden is None or self.num_real != len(self.tokens) - 1:
            raise RuntimeError("EagleProposer.propose needs commit() with the features of every position "
                               "before the newest token")
        self._drop_drafts()
        self.fed: list[int] = []                                  # this round's draft entries, in cache order
        self.outputs: dict[int, Tensor] = {}                      # draft node -> the head's output f^ after it
        return self.root_logits

    def step(self, nodes: list[int], tree) -> Tensor:
        """One batched head forward over draft nodes: each reads (f^ of its parent, its token) at position
        N + depth - 1 and sees the real pairs, its fed ancestors and itself."""
        device = self.tokens.device
        tokens = torch.tensor([tree.tokens[i] for i in nodes], device=device)
        depth = torch.tensor([tree.depths[i] for i in nodes], device=device)
        hidden = torch.stack([self.outputs.get(tree.parents[i], self.root_hidden) for i in nodes])
        visible = tree.visibility(nodes, self.num_real, self.fed, device)
        out = self.head(hidden[None], tokens[None], (self.num_real + depth - 1)[None],
                        additive(visible, self.head.fc.weight.dtype), self.cache)[0]
        self.outputs.update(zip(nodes, out))
        self.fed += nodes
        return self.head.draft_logits(out).float()

    def to_target(self, index: Tensor) -> Tensor:
        return self.head.to_target(index)

    def expand(self, logits: Tensor) -> Tensor:
        return self.head.logits_from_draft(logits)

    @torch.no_grad()
    def propose(self, spec, sampling, generator: torch.Generator | None = None):
        return drafting.propose(self, spec, sampling, generator)
