"""DFlash block drafter: a few non-causal layers that write a whole block of draft tokens in one forward.

Paper: Chen, Liang and Liu, "DFlash: Block Diffusion for Flash Speculative Decoding" (arXiv 2602.06036, 2026). The
layout follows the released checkpoints (z-lab/dflash `DFlashDraftModel`, the Qwen3 layer with per-head q/k
norms) and the training follows the paper as SpecForge (specforge/core/dflash.py) implements it; no code is taken.

What it optimises. The target's hidden states after the decoder layers `target_layers` (0-based; by default one
layer, the middle one, or several spread evenly over layers 1..L-3) are concatenated, fused and normed:
c_s = hidden_norm(fc([h^{l1}_s; ...; h^{lm}_s])) [d]. A block starts at an anchor a (the newest committed token)
and holds B tokens at positions a..a+B-1: the anchor's embedding, then B-1 embeddings of a mask token. In every
layer the block's queries attend, without a causal mask, to the keys/values of the context c_s (s < a, projected by
that layer's k/v projections, never normed by its input norm) and of the whole block; the block's output at
position a+k, through the final norm and the target's frozen LM head, predicts token x_{a+k} (k = 1..B-1). One
forward drafts B-1 tokens: chains are its per-position argmax (or draws), trees each position's top-k.

Training (block-parallel, as the paper's recipe): per row, up to `num_anchors` anchors are drawn uniformly among
the assistant tokens whose next token is in the same conversation; all their blocks run in one forward. Block n's
queries see the context strictly before its anchor in its own conversation and its own block only
(`block_mask`): other blocks, the rest of the context and padding are invisible, so each block computes exactly
what the drafter computes at inference after committing x_0..x_a. The context is never a query (its features are
the target's, fixed). The loss is `losses.block_cross_entropy`: cross-entropy on x_{a+k} (an assistant token of
the anchor's conversation) weighted exp(-(k-1)/gamma), gamma = `loss_decay` (the paper's 7 / 5 / 4 for blocks of
16 / 10 / 8), averaged over the valid predictions.

The token embedding and LM head are the target's (frozen, never saved); the mask token is a target token id that
the training data never holds (the highest such id unless `mask_token_id` names one). There is no reduced draft
vocabulary: the DFlash format that SGLang, vLLM and llama.cpp load for `DFlashDraftModel` drafts with the target's
full LM head (llama.cpp reads a d2t map only for its DSpark variants).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from draftlab import drafting, packing
from draftlab.drafters.options import DrafterConfig, check_target_size, settings
from draftlab.serving import dense_config, embed_tokens, layer_config
from draftlab.trees import additive

PAPER_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}      # gamma per block size (the paper's training recipe)
SHAPE_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "attention_bias",
              "rms_norm_eps")


@dataclass
class DFlashConfig(DrafterConfig):
    """drafter.* keys of drafter.kind=dflash."""
    kind: str = "dflash"
    num_layers: int = 5
    """Non-causal decoder layers of the drafter (the released DFlash drafters use 5; fewer draft faster)."""
    block_size: int = 16
    """Tokens per block: the anchor then block_size - 1 mask tokens, so one forward drafts up to block_size - 1
    tokens (eval.draft_length may be anything up to that)."""
    target_layers: list[int] = field(default_factory=list)
    """0-based target decoder layers whose outputs are fused into the context ([] = DFlash's rule: the middle layer
    for a 1-layer drafter, else num_layers ids spread evenly over 1..L-3)."""
    mask_token_id: int = -1
    """Target token id whose embedding fills the block after the anchor (-1 = the highest id data.train never holds)."""
    num_anchors: int = 512
    """Blocks trained per row (anchors drawn among its assistant tokens; fewer when the row has fewer)."""
    loss_decay: float = 0.0
    """gamma of the loss weight exp(-(k-1)/gamma) of block position k (0 = the paper's value for the block size:
    7 for 16, 5 for 10, 4 for 8, else block_size / 2; negative = no decay)."""

    @staticmethod
    def packs(drafter_cfg) -> bool:
        return True

    @staticmethod
    def run_problem(cfg) -> str | None:
        from draftlab.drafters.options import layer_ids, whole_numbers_problem

        problem = whole_numbers_problem("target_layers", layer_ids(cfg.drafter, "target_layers"))
        if problem:
            return problem
        drafts = int(cfg.drafter.block_size) - 1
        if cfg.eval.tree == "chain" and int(cfg.eval.draft_length) > drafts:
            return (f"eval.draft_length={cfg.eval.draft_length} exceeds the {drafts} tokens a DFlash block of "
                    f"drafter.block_size={cfg.drafter.block_size} drafts: lower it or raise the block size")
        if cfg.eval.tree == "dynamic" and int(cfg.eval.depth) > drafts:
            return (f"eval.depth={cfg.eval.depth} exceeds the {drafts} tokens a DFlash block of "
                    f"drafter.block_size={cfg.drafter.block_size} drafts: lower it or raise the block size")
        return None

    @staticmethod
    def target_problem(drafter_cfg, text) -> str | None:
        from draftlab.drafters.options import layer_ids

        layers, ids, vocab = text.num_hidden_layers, layer_ids(drafter_cfg, "target_layers"), text.vocab_size
        if ids and not all(0 <= i < layers - 1 for i in ids) and not (layers == 1 and ids == [0]):
            return (f"drafter.target_layers={ids}: the target has {layers} decoder layers, so give layer ids in "
                    f"0..{layers - 2} (the last layer's output is the final-norm state, not the residual stream "
                    "engines read)")
        mask = int(drafter_cfg.mask_token_id)
        if mask >= vocab:
            return (f"drafter.mask_token_id={mask} is not a token of the target (its vocabulary has {vocab} ids, "
                    f"0..{vocab - 1}): name a rarely used special token, or -1 (the highest id data.train never holds)")
        return DrafterConfig.target_problem(drafter_cfg, text)


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default context layers (0-based decoder layer ids), kept inside 0..L-2 for very small targets."""
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        ids = [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return [min(max(i, 0), max(num_target_layers - 2, 0)) for i in ids]


def paper_decay(block_size: int, loss_decay: float) -> float:
    """The gamma the loss uses: loss_decay when positive, none (0) when negative, else the paper's for the block."""
    if loss_decay != 0:
        return max(loss_decay, 0.0)
    return PAPER_DECAY.get(block_size, block_size / 2)


def sample_anchors(candidates: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """Up to `count` distinct anchors per row, uniformly among candidates [B,T] (bool), in ascending order.
    Returns anchors [B,N] (long; 0 where unused) and keep [B,N] (bool), N = min(count, most candidates in a row)."""
    B, T = candidates.shape
    n = max(1, min(count, int(candidates.sum(1).max())))
    scores = torch.rand(B, T, device=candidates.device).masked_fill(~candidates, 2.0)
    chosen = scores.argsort(dim=1)[:, :n]
    keep = torch.arange(n, device=candidates.device)[None] < candidates.sum(1, keepdim=True).clamp(max=n)
    anchors = torch.where(keep, chosen, torch.full_like(chosen, T)).sort(dim=1).values
    return anchors.masked_fill(~keep, 0), keep


def block_mask(anchors: Tensor, keep: Tensor, docs: Tensor, block_size: int) -> Tensor:
    """Visibility of the block queries in training, bool [B, N*bs, T + N*bs]: keys are the T context positions then
    the N blocks. A query of block n (anchor a_n) sees context s < a_n of a_n's conversation (docs [B,T], 0 = padding)
    and the bs entries of block n (bidirectional); nothing of any other block. An unused block (keep false) sees
    only itself, so no attention row is empty. anchors, keep [B,N]."""
    B, N = anchors.shape
    T, Q = docs.shape[1], N * block_size
    a = anchors.repeat_interleave(block_size, dim=1)                                   # [B,Q] each query's anchor
    used = keep.repeat_interleave(block_size, dim=1)
    anchor_doc = docs.gather(1, a)
    s = torch.arange(T, device=docs.device)
    context = (s[None, None] < a[:, :, None]) & (docs[:, None, :] == anchor_doc[:, :, None]) & used[:, :, None]
    blocks = torch.arange(Q, device=docs.device) // block_size
    own = (blocks[:, None] == blocks[None, :]).expand(B, Q, Q)
    return torch.cat([context, own], dim=-1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half layout, as transformers' Llama / Qwen3): x [B,H,S,hd], cos/sin [B,S,hd]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class BlockAttention(nn.Module):
    """Queries from the block, keys/values from [context; block], per-head RMSNorm on q and k (the Qwen3 layout of
    DFlash checkpoints and of llama.cpp's DFLASH architecture)."""

    def __init__(self, config, norm_cls):
        super().__init__()
        d = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or d // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=bias)
        self.q_norm = norm_cls(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = norm_cls(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [B,S,d] -> keys (normed, rotated) and values, each [B,Hkv,S,hd]."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor | None) -> Tensor:
        """x [B,Q,d] normed block states; ctx_k/ctx_v [B,Hkv,C,hd]; mask additive [B,1,Q,C+Q] (None = all visible)."""
        B, Q, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.head_dim)).transpose(1, 2), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([ctx_k.to(k.dtype), k], dim=2), torch.cat([ctx_v.to(v.dtype), v], dim=2)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.dtype))
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer over the block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, config, norm_cls, mlp_cls):
        super().__init__()
        self.input_layernorm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = BlockAttention(config, norm_cls)
        self.post_attention_layernorm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = mlp_cls(config)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor | None) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """fc + hidden_norm over the fused target states, `num_layers` DFlashLayers over the block, final norm; tokens
    through the target's frozen LM head."""

    kind = "dflash"
    config_class = DFlashConfig
    card_name = "DFlash block drafter (block diffusion: one forward drafts a whole block)"
    card_note = ("Serving: SGLang `--speculative-algorithm DFLASH`, vLLM `\"method\": \"dflash\"`, llama.cpp after "
                 "`convert_hf_to_gguf.py DRAFT --target-model-dir TARGET` with `--spec-type draft-dflash`.")
    export_format = "dflash"

    def __init__(self, target, num_layers: int = DFlashConfig.num_layers, block_size: int = DFlashConfig.block_size,
                 target_layers: list[int] | None = None, mask_token_id: int = DFlashConfig.mask_token_id,
                 num_anchors: int = DFlashConfig.num_anchors, loss_decay: float = DFlashConfig.loss_decay,
                 layer_shape: dict | None = None):
        super().__init__()
        L = target.config.get_text_config(decoder=True).num_hidden_layers
        # dense Qwen3-style layers sized from the target, whatever its own layers are (serving.dense_config; the
        # q/k norms are BlockAttention's own): what the engines' DFlash loaders build
        config = dense_config(target.config.get_text_config(decoder=True), num_layers)
        for key, value in (layer_shape or {}).items():      # a foreign drafter's own widths (foreign.py)
            setattr(config, key, value)
        layers = list(target_layers) if target_layers else default_target_layers(L, num_layers)
        if num_layers < 1 or block_size < 2 or num_anchors < 1:
            raise ValueError(f"drafter.num_layers={num_layers}, block_size={block_size}, num_anchors={num_anchors}: "
                             "a DFlash drafter needs at least 1 layer, blocks of 2 tokens and 1 anchor per row")
        if not all(0 <= i < L - 1 for i in layers) and not (L == 1 and layers == [0]):
            raise ValueError(f"drafter.target_layers={layers}: decoder layer ids in 0..{L - 2} (the last layer's "
                             "output is the final-norm state in transformers, not the residual stream engines read)")
        self.num_layers, self.block_size, self.target_layers = num_layers, block_size, layers
        self.num_anchors, self.loss_decay, self.layer_shape = num_anchors, loss_decay, dict(layer_shape or {})
        self.feature_layers = tuple(i + 1 for i in layers)
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.auto_mask = mask_token_id < 0
        self.mask_token_id = config.vocab_size - 1 if self.auto_mask else int(mask_token_id)
        if not 0 <= self.mask_token_id < config.vocab_size:
            raise ValueError(f"drafter.mask_token_id={mask_token_id}: a token id below {config.vocab_size} (or -1)")
        from draftlab.target import target_fingerprint
        self.target_fingerprint = target_fingerprint(target)

        d, norm_cls, mlp_cls = config.hidden_size, LlamaRMSNorm, LlamaMLP
        self.fc = nn.Linear(len(layers) * d, d, bias=False)
        self.hidden_norm = norm_cls(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config, norm_cls, mlp_cls) for _ in range(num_layers))
        self.norm = norm_cls(d, eps=config.rms_norm_eps)
        std = getattr(config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        for module in (embed, lm_head):
            module.requires_grad_(False)
        self._borrowed = SimpleNamespace(embed=embed, lm_head=lm_head)
        self.rotary = LlamaRotaryEmbedding(config)      # the target's full-attention rope (no saved weights)
        self.to(device=embed.weight.device)

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, cfg=None) -> "DFlashDrafter":
        own = settings(DFlashConfig, cfg)
        return cls(target, **{**own, "target_layers": own["target_layers"] or None})

    def drafter_config(self) -> dict:
        return {"kind": self.kind, "feature_layers": list(self.feature_layers), "num_layers": self.num_layers,
                "block_size": self.block_size, "target_layers": self.target_layers,
                "mask_token_id": self.mask_token_id, "num_anchors": self.num_anchors, "loss_decay": self.loss_decay,
                "layer_shape": self.layer_shape, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "target": dict(self.target_fingerprint)}

    @classmethod
    def from_config(cls, config: dict, target) -> "DFlashDrafter":
        check_target_size(cls.kind, config, target)
        return cls(target, **settings(DFlashConfig, config), layer_shape=config.get("layer_shape"))

    def prepare(self, dataset) -> None:
        """With mask_token_id=-1: the highest token id no training row holds (deterministic in the data)."""
        if not self.auto_mask:
            return
        seen = torch.zeros(self.vocab_size, dtype=torch.bool)
        for i in range(len(dataset)):
            seen[torch.as_tensor(dataset[i]["input_ids"], dtype=torch.long)] = True
        unused = (~seen).nonzero().flatten()
        if len(unused) == 0:
            raise ValueError("drafter.mask_token_id=-1: data.train holds every token id of the target, so none is "
                             "free for the mask: set drafter.mask_token_id to a rarely used special token")
        self.mask_token_id = int(unused[-1])

    # --- the network ---------------------------------------------------------------------------------------
    def context(self, features: Tensor) -> Tensor:
        """Target features [B,C,m*d] (the target_layers' states, concatenated) -> fused context c [B,C,d]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's keys and values of the context c [B,C,d] at positions [B,C]: [(k, v)], each [B,Hkv,C,hd]."""
        cos, sin = self.rotary(ctx, positions)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def block_states(self, block_ids: Tensor, positions: Tensor, ctx_kv: list[tuple[Tensor, Tensor]],
                     mask: Tensor | None) -> Tensor:
        """block_ids, positions [B,Q]; ctx_kv from `context_kv`; mask additive [B,1,Q,C+Q] (None: every key
        visible, as at inference). Returns the final-normed block states [B,Q,d]."""
        h = embed_tokens(self._borrowed.embed, block_ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(h, positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask)
        return self.norm(h)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] -> logits [..., V] through the target's frozen LM head."""
        return self._borrowed.lm_head(hidden.to(self._borrowed.lm_head.weight.dtype))

    def loss(self, batch: dict, features: Tensor) -> tuple[Tensor, dict[str, float]]:
        """batch: input_ids, attention_mask, loss_mask [B,T] (packed rows: doc_ids, position_ids too); features
        [B,T,m*d]. Returns the decayed block cross-entropy and metrics: acc_k (position k's top-1 agreement with the
        data), acc, and accept (1 + the leading agreed positions of a block, the greedy tau the data would give)."""
        from draftlab.losses import block_cross_entropy

        ids, docs = batch["input_ids"], packing.doc_ids(batch)
        B, T = ids.shape
        bs, dev = self.block_size, ids.device
        positions = packing.positions(docs > 0, docs)
        wanted = batch["loss_mask"].bool() & (docs > 0)
        candidates = torch.zeros_like(wanted)
        candidates[:, :-1] = wanted[:, :-1] & packing.same_doc(docs, 1)
        if not candidates.any():   # no assistant token with a successor: a zero that keeps the graph
            return sum(p.sum() * 0 for p in self.parameters() if p.requires_grad), {"acc": 0.0, "accept": 1.0}
        anchors, keep = sample_anchors(candidates, self.num_anchors)
        N, offsets = anchors.shape[1], torch.arange(bs, device=dev)
        where = anchors[..., None] + offsets                                                  # [B,N,bs]
        inside, flat = where < T, where.clamp(max=T - 1).view(B, -1)
        block_ids = torch.full((B, N, bs), self.mask_token_id, dtype=torch.long, device=dev)
        block_ids[..., 0] = ids.gather(1, anchors)
        block_pos = positions.gather(1, anchors)[..., None] + offsets
        ctx_kv = self.context_kv(self.context(features), positions)
        mask = additive(block_mask(anchors, keep, docs, bs)[:, None], self.fc.weight.dtype)
        hidden = self.block_states(block_ids.view(B, -1), block_pos.view(B, -1), ctx_kv, mask).view(B, N, bs, -1)
        labels = ids.gather(1, flat).view(B, N, bs)
        valid = (keep[..., None] & inside & (offsets > 0) & wanted.gather(1, flat).view(B, N, bs)
                 & (docs.gather(1, flat).view(B, N, bs) == docs.gather(1, anchors)[..., None]))
        rows = valid.nonzero(as_tuple=True)
        logits = self.logits(hidden[rows])                                                   # [M, V], M valid
        rank = offsets.expand(B, N, bs)[rows]
        loss = block_cross_entropy(logits, labels[rows], torch.ones_like(rank), rank,
                                   paper_decay(bs, self.loss_decay))
        with torch.no_grad():
            right = torch.zeros_like(valid)
            right[rows] = logits.argmax(-1) == labels[rows]
            metrics = {"acc": right[rows].float().mean().item() if len(rank) else 0.0}
            for k in range(1, min(bs, 5)):
                counted = valid[..., k]
                metrics[f"acc_{k}"] = right[..., k][counted].float().mean().item() if counted.any() else 0.0
            lead = (right & valid)[..., 1:].long().cumprod(-1)         # leading positions agreed with the data
            metrics["accept"] = (1 + lead.sum(-1)[keep].float()).mean().item()
        return loss, metrics

    def proposer(self, target=None, **opts) -> "DFlashProposer":
        return DFlashProposer(self)

    # --- export --------------------------------------------------------------------------------------------
    @staticmethod
    def export(src, out: Path, meta: dict) -> dict:
        """The DFlash format SGLang, vLLM and llama.cpp load: z-lab/dflash's `DFlashDraftModel` (a Qwen3 config with
        `dflash_config` {block_size, mask_token_id, target_layer_ids}; weights fc, hidden_norm, layers.{i}.* with
        self_attn.{q,k}_norm, norm; no embedding or LM head: engines take the target's). Checked against llama.cpp's
        convert_hf_to_gguf.py (conversion/qwen.py `DFlashModel`: dflash_config read as above, target_layer_ids + 1
        written as the extract layers, the tokenizer and mask id from --target-model-dir) and src/models/dflash.cpp
        (fc, hidden_norm as the encoder norm, q/k norms required, output head optional)."""
        config, text = src.config, src.target_config()
        weights = {k: v.contiguous() for k, v in src.weights.items()}
        dtype = weights["fc.weight"].dtype
        layers = int(config["num_layers"])
        shape = config.get("layer_shape") or {}
        out_config = {"architectures": ["DFlashDraftModel"], **layer_config(text, layers), "model_type": "qwen3"}
        out_config.update({k: v for k, v in shape.items()})
        out_config.setdefault("head_dim", text.hidden_size // out_config["num_attention_heads"])
        out_config.update(block_size=int(config["block_size"]), num_target_layers=text.num_hidden_layers,
                          layer_types=["full_attention"] * layers, use_sliding_window=False, sliding_window=None,
                          max_window_layers=layers, attention_bias=bool(shape.get("attention_bias", False)),
                          dflash_config={"block_size": int(config["block_size"]),
                                         "mask_token_id": int(config["mask_token_id"]),
                                         "target_layer_ids": [int(i) for i in config["target_layers"]]},
                          torch_dtype=str(dtype).removeprefix("torch."), dtype=str(dtype).removeprefix("torch."))
        save_file(weights, str(out / "model.safetensors"), {"format": "pt"})
        (out / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
        return {"block_size": int(config["block_size"]), "target_layers": list(config["target_layers"]),
                "mask_token_id": int(config["mask_token_id"])}


class DFlashProposer:
    """Drafts with a DFlashDrafter over its own cache of context keys/values.

    After each commit the cache holds every layer's keys/values of the fused target states at positions 0..N-1 of the
    committed x_0..x_N (their features are known: the target has processed them). `root()` runs the block
    [x_N, mask, ..., mask] at positions N..N+bs-1 once, with no mask, and keeps its logits [bs-1, V]; a node at
    depth d (any token) has the block's position d+1 logits for its children, so chains, static and dynamic trees
    come from `drafting` with max_depth = bs - 1 and no further drafter forward.
    """

    max_depth = None

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.feature_layers = drafter.feature_layers
        self.max_depth = drafter.block_size - 1
        self.reset(torch.zeros(0, dtype=torch.long))

    def reset(self, prompt_ids: Tensor) -> None:
        device = self.drafter.fc.weight.device
        self.tokens = prompt_ids.reshape(-1).to(device)
        self.cache: list[tuple[Tensor, Tensor]] | None = None
        self.num_ctx = 0
        self.logits = None

    @torch.no_grad()
    def commit(self, tokens: Tensor, features: Tensor | None) -> None:
        self.tokens = torch.cat([self.tokens, tokens.reshape(-1).to(self.tokens.device)])
        if features is None or len(features) == 0:
            return
        C = len(features)
        positions = torch.arange(self.num_ctx, self.num_ctx + C, device=self.tokens.device)[None]
        new = self.drafter.context_kv(self.drafter.context(features[None]), positions)
        self.cache = new if self.cache is None else [
            (torch.cat([k0, k], 2), torch.cat([v0, v], 2)) for (k0, v0), (k, v) in zip(self.cache, new)]
        self.num_ctx += C

    @torch.no_grad()
    def root(self) -> Tensor:
        N = len(self.tokens) - 1
        if self.cache is None or self.num_ctx != N:
            raise RuntimeError("DFlashProposer.propose needs commit() with the features of every position before "
                               "the newest token")
        bs = self.drafter.block_size
        block = torch.full((1, bs), self.drafter.mask_token_id, dtype=torch.long, device=self.tokens.device)
        block[0, 0] = self.tokens[-1]
        positions = torch.arange(N, N + bs, device=self.tokens.device)[None]
        hidden = self.drafter.block_states(block, positions, self.cache, None)[0]
        self.logits = self.drafter.logits(hidden[1:]).float()                   # [bs-1, V]: depth d+1 at row d
        return self.logits[0]

    def step(self, nodes: list[int], tree) -> Tensor:
        return self.logits[[tree.depths[i] for i in nodes]]

    def to_target(self, index: Tensor) -> Tensor:
        return index

    def expand(self, logits: Tensor) -> Tensor:
        return logits

    @torch.no_grad()
    def propose(self, spec, sampling, generator: torch.Generator | None = None):
        return drafting.propose(self, spec, sampling, generator)
