"""Gumiho heads: a serial EAGLE-style head drafts the first s tokens, parallel MLP heads draft the rest at once.

Paper: Li, Xu, Huang, Yin, Li, Ngai, Barsoum, "Gumiho: A Hybrid Architecture to Prioritize Early Tokens in
Speculative Decoding" (ICML 2025, arXiv 2503.10135); public code AMD-AIG-AIMA/Gumiho. It sits between EAGLE
(method_specs 2.1: every draft token from an autoregressive head) and Medusa (method_specs 3: every draft token
from a parallel head). The paper shows that the early tokens of a draft decide most of the accepted length, so
it spends a transformer on them and cheap MLPs on the later ones.

**Inputs.** For every position t: the target's feature f_t (the LM-head input, `output_hidden_states[-1]`) and the
tokens of the conversation, as EAGLE-1 reads them.

**Architecture.**
* Serial head = an EAGLE-1 head (eagle.py `EagleHead`): h = FC([emb(x_{t+1}); f_t]), `serial_layers` Llama
  decoder layers (paper: 2; no input norm in the first), output f^_{t+1}, tokens through the target's frozen LM
  head. It drafts depths 1..s (`serial_tokens`, paper s = 2) autoregressively over its own KV cache: depth 1 from
  the committed context, depth j+1 from the pair (f^ of the depth-j node's parent, the depth-j token).
* Parallel heads: K MLP heads (`mlp_heads`, paper 5). Their input is the s fused pairs of the serial path,
  u = [FC([emb(d_1); f^_0]); ...; FC([emb(d_s); f^_{s-1}])] (s*d; f^_0 = the root state, f^_{j} = the serial
  output after d_j; the FC is the serial head's own). MLP head i = Linear(s*d, d) + SiLU (weight zero-initialised)
  then `mlp_layers` residual blocks x + SiLU(W x + b) (paper 5, zero-initialised, medusa.py `ResBlock`); its output
  is a predicted feature read by the same frozen LM head, and drafts depth s+1+i. All K come from one forward.
* Training alignment (teacher forced, as the reference trains it): slot t's serial output f^_{t+1} (from f_t and
  x_{t+1}) drafts x_{t+2}; the MLP input at slot t is the fused pairs of slots t..t+s-1,
  [FC([emb(x_{t+2}); f^_{t+1}]); ...; FC([emb(x_{t+1+s}); f^_{t+s}])], and MLP head i predicts f_{t+1+s+i} and
  drafts x_{t+2+s+i}. The MLP loss back-propagates into the FC and the serial layers: both parts train jointly.

**Loss.** Each term is EAGLE-1's pair at its position (eagle.py `feature_terms`): SmoothL1 between the predicted
feature and the target's, plus the soft cross-entropy of lm_head(predicted) against softmax(lm_head(target)),
each normalised by its valid slots; a slot counts when the token it drafts is an assistant token of the same
conversation.
    L = reg_weight * L_reg^serial + cls_weight * L_cls^serial
        + sum_{i=0..K-1} mlp_weight * mlp_decay^(i+1) * (reg_weight * L_reg^(i) + cls_weight * L_cls^(i))
Defaults follow the reference (`main_deepspeed.py`): reg 1.0, cls 0.1 for both parts, MLP terms decayed by 0.8
per head and divided by 9 (mlp_weight = 1/9): early tokens weigh most. (The reference also switches the MLPs'
cross-entropy off for its first two epochs; we keep it on throughout.) Noise U(-std/2, std/2) on the input
features in training only, as eagle.py.

**Proposing** (`GumihoProposer`, one `drafting.propose` path: chains, static and dynamic trees): the EAGLE-1
proposer's cache and commits; a node at depth < s is fed to the serial head, which returns its children's
logits; a node at depth >= s reads MLP head (depth - s) at its depth-s ancestor, whose K outputs are computed once
per ancestor and per round (so a chain of k = s + K costs s - 1 serial steps and one MLP call after the root).
Drafting goes at most s + K deep. The paper's "full tree attention" (complete_mask in the reference: a short
candidate path is padded with tokens of longer ones, since the MLP tokens past a serial node do not depend on the
path below it) is not built: the verifier here accepts trees only, and a padded path is a node with two parents.

Draft vocabulary (draft_vocab_size): as EAGLE-1, every head reads only the LM-head rows of the most frequent
assistant tokens. Export: the official Gumiho layout (format "gumiho": config.json with the serial layers'
Llama config, `serial_head_num`, `mlp_num`; pytorch_model.bin and model.safetensors with fc.*, layers.*,
mlp.mlp.{i}.*, embed_tokens), which the reference code loads when s = 2 and mlp_layers = 5 (the shape it builds).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from draftlab.drafters.eagle import EagleHead, EagleProposer, ahead, own_feature_steps
from draftlab.drafters.medusa import ResBlock
from draftlab.drafters.options import DrafterConfig, DraftVocabOption, EagleHeadOptions
from draftlab.serving import layer_config

REFERENCE_SHAPE = {"serial_tokens": 2, "mlp_layers": 5}     # what the reference code's MLP heads are


@dataclass
class GumihoConfig(EagleHeadOptions, DraftVocabOption, DrafterConfig):
    """drafter.* keys of drafter.kind=gumiho (its serial head's feature_noise, reg_weight, cls_weight, fc_bias:
    EagleHeadOptions, as eagle's)."""
    kind: str = "gumiho"
    serial_tokens: int = 2
    """s: draft depths 1..s come from the serial (transformer) head, the deeper ones from the MLP heads."""
    serial_layers: int = 2
    """Decoder layers in the serial head."""
    mlp_heads: int = 5
    """K parallel MLP heads: head i drafts depth s+1+i."""
    mlp_layers: int = 5
    """Residual blocks per MLP head after its input projection."""
    mlp_weight: float = 1 / 9
    """Scale of every MLP head's terms against the serial head's (the reference divides them by 9)."""
    mlp_decay: float = 0.8
    """MLP head i's terms are multiplied by mlp_decay^(i+1) (i = 0..K-1)."""

    @staticmethod
    def packs(drafter_cfg) -> bool:
        return True


def shifted(x: Tensor, offset: int) -> Tensor:
    """x [B,n,...] moved `offset` slots earlier (slot t holds x[t+offset]), zeros past the row."""
    out = torch.zeros_like(x)
    if offset < x.shape[1]:
        out[:, : x.shape[1] - offset] = x[:, offset:]
    return out


class GumihoHeads(EagleHead):
    """An EAGLE-1 serial head (its fc, decoder layers and frozen target pieces) plus K parallel MLP heads.
    Construction, saving and loading are EagleHead's, over GumihoConfig's keys."""

    kind = "gumiho"
    config_class = GumihoConfig
    card_name = "Gumiho heads (serial transformer head + parallel MLP heads)"
    export_format = "gumiho"        # the official Gumiho layout (AMD-AIG-AIMA/Gumiho)
    feature_layers = (-1,)

    def __init__(self, target, serial_tokens: int = GumihoConfig.serial_tokens,
                 serial_layers: int = GumihoConfig.serial_layers, mlp_heads: int = GumihoConfig.mlp_heads,
                 mlp_layers: int = GumihoConfig.mlp_layers, feature_noise: float = GumihoConfig.feature_noise,
                 reg_weight: float = GumihoConfig.reg_weight, cls_weight: float = GumihoConfig.cls_weight,
                 mlp_weight: float = GumihoConfig.mlp_weight, mlp_decay: float = GumihoConfig.mlp_decay,
                 fc_bias: bool = GumihoConfig.fc_bias, draft_vocab_size: int = GumihoConfig.draft_vocab_size,
                 draft_vocab: list[int] | None = None):
        if serial_tokens < 1 or serial_layers < 1 or mlp_heads < 1 or mlp_layers < 0:
            raise ValueError(f"drafter.serial_tokens={serial_tokens}, serial_layers={serial_layers} and "
                             f"mlp_heads={mlp_heads} must be >= 1, mlp_layers={mlp_layers} >= 0")
        super().__init__(target, num_layers=serial_layers, feature_noise=feature_noise, reg_weight=reg_weight,
                         cls_weight=cls_weight, fc_bias=fc_bias, draft_vocab_size=draft_vocab_size,
                         draft_vocab=draft_vocab)
        self.serial_tokens, self.serial_layers = serial_tokens, serial_layers
        self.mlp_heads, self.mlp_layers, self.mlp_weight, self.mlp_decay = mlp_heads, mlp_layers, mlp_weight, mlp_decay
        d = self.hidden_size
        self.mlps = nn.ModuleList(self._mlp(serial_tokens * d, d, mlp_layers) for _ in range(mlp_heads))
        self.to(device=self.fc.weight.device)

    @staticmethod
    def _mlp(width: int, d: int, blocks: int) -> nn.Sequential:
        """Linear(width, d) + SiLU (weight zero: every head starts as a constant), then `blocks` identity ResBlocks."""
        first = nn.Linear(width, d)
        nn.init.zeros_(first.weight)
        return nn.Sequential(first, nn.SiLU(), *[ResBlock(d) for _ in range(blocks)])

    # --- the parallel heads and the loss ------------------------------------------------------------------
    def parallel(self, pairs: Tensor) -> Tensor:
        """pairs [..., s*d] (the serial path's s fused pairs, concatenated) -> predicted features [K, ..., d]."""
        pairs = pairs.to(self.fc.weight.dtype)
        return torch.stack([mlp(pairs) for mlp in self.mlps])

    def position_terms(self, batch: dict, features: Tensor) -> list[tuple[float, object]]:
        """batch: input_ids, attention_mask, loss_mask [B,T]; features [B,T,d] = target features f_t.
        [(scale, terms)] per draft position: the serial head's (scale 1, offset 0: slot t drafts x_{t+2}), then MLP
        head i's (scale mlp_weight * mlp_decay^(i+1), offset s+i: slot t drafts x_{t+2+s+i}); terms as
        EagleHead.feature_terms (reg, cls, acc, ...)."""
        ids, docs, features, valid, wanted, inputs = self.loss_inputs(batch, features)
        serial = own_feature_steps(self, inputs, ids, valid, 1, docs=docs[:, :-1])[0]     # slot t: f^_{t+1}
        out = [(1.0, self.feature_terms(serial, *ahead(features, wanted, docs, valid, 0)))]
        # slot t's pair for the token its output drafts: FC([emb(x_{t+2}); f^_{t+1}]); the MLPs read s in a row
        fused = self.fuse(serial, shifted(ids[:, 1:], 1))
        pairs = torch.cat([shifted(fused, j) for j in range(self.serial_tokens)], dim=-1)
        for i, pred in enumerate(self.parallel(pairs)):
            terms = self.feature_terms(pred, *ahead(features, wanted, docs, valid, self.serial_tokens + i))
            out.append((self.mlp_weight * self.mlp_decay ** (i + 1), terms))
        return out

    def loss(self, batch: dict, features: Tensor) -> tuple[Tensor, dict[str, float]]:
        """sum over draft positions of scale * (reg_weight * L_reg + cls_weight * L_cls) (`position_terms`);
        metrics loss_reg / loss_cls / acc for the serial head, the same with suffix _mlp{i} for MLP head i."""
        total, metrics = features.new_zeros((), dtype=self.fc.weight.dtype), {}
        for i, (scale, terms) in enumerate(self.position_terms(batch, features)):
            total = total + scale * (self.reg_weight * terms.reg + self.cls_weight * terms.cls)
            suffix = "" if i == 0 else f"_mlp{i - 1}"
            metrics.update({f"loss_reg{suffix}": terms.reg.item(), f"loss_cls{suffix}": terms.cls.item(),
                            f"acc{suffix}": terms.acc.item()})
        return total, metrics

    def proposer(self, target=None, **opts) -> "GumihoProposer":
        return GumihoProposer(self)

    # --- export --------------------------------------------------------------------------------------------
    @staticmethod
    def export(src, out: Path, meta: dict) -> dict:
        """The official Gumiho layout (AMD-AIG-AIMA/Gumiho gumiho/model/cnets.py `Model`, loaded strictly from
        pytorch_model.bin by gumiho_model.py): our fc.* and layers.* names (EAGLE-1's), each MLP head as
        mlp.mlp.{i}.0.linear.* (the input projection) and mlp.mlp.{i}.{1+j}.linear.* (its residual blocks), and
        embed_tokens.weight (the target's). model.safetensors holds the same. config.json: the serial layers' Llama
        config, `bias`, and the reference's command-line settings serial_head_num / mlp_num for the reader. The
        reference builds MLP heads of input 2d and 5 blocks and an fc with bias: other shapes are written the same
        way but do not load there (details say which); a head without an FC bias gets a zero one (same function)."""
        cfg = src.config
        text = src.target_config()
        weights = dict(src.weights)
        dtype = weights["fc.weight"].dtype
        weights.setdefault("fc.bias", torch.zeros(text.hidden_size, dtype=dtype))
        renamed = {}
        for name, value in weights.items():
            if name.startswith("mlps."):
                head, index, rest = name.removeprefix("mlps.").split(".", 2)
                # ours: 0 = the input Linear, 1 = its SiLU, 2.. = ResBlocks (.linear.*); theirs: 0, 1.. (.linear.*)
                name = f"mlp.mlp.{head}.0.linear.{rest}" if index == "0" else f"mlp.mlp.{head}.{int(index) - 1}.{rest}"
            renamed[name] = value.contiguous()
        renamed["embed_tokens.weight"] = src.target()[0].get_input_embeddings().weight.detach().to("cpu", dtype)
        save_file(renamed, str(out / "model.safetensors"), {"format": "pt"})
        torch.save(renamed, out / "pytorch_model.bin")
        layers = cfg.get("serial_layers", GumihoConfig.serial_layers)
        shape = {k: cfg.get(k, getattr(GumihoConfig, k)) for k in REFERENCE_SHAPE}
        config = {"architectures": ["LlamaForCausalLM"], **layer_config(text, layers),
                  "bias": True, "serial_head_num": shape["serial_tokens"],
                  "mlp_num": cfg.get("mlp_heads", GumihoConfig.mlp_heads), "mlp_layers": shape["mlp_layers"],
                  "torch_dtype": str(dtype).removeprefix("torch.")}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return {"serial_tokens": shape["serial_tokens"], "serial_layers": layers, "mlp_heads": config["mlp_num"],
                "mlp_layers": shape["mlp_layers"], "reference_shape": shape == REFERENCE_SHAPE,
                "draft_vocab": len(cfg.get("draft_vocab") or [])}


class GumihoProposer(EagleProposer):
    """The EAGLE-1 proposer (cache of real pairs, commits, the serial steps) with the MLP heads past depth s.

    A node at depth j < s is fed to the serial head (EagleProposer.step); a node at depth j >= s gets the logits
    of MLP head j - s at its depth-s ancestor. That ancestor's K heads run once per round, on the fused pairs of
    its path: pair of the depth-i node = FC([emb(its token); f^ of its parent]).
    """

    def __init__(self, heads: GumihoHeads):
        super().__init__(heads)
        self.serial_tokens = heads.serial_tokens
        self.max_depth = heads.serial_tokens + heads.mlp_heads

    def root(self) -> Tensor:
        logits = super().root()
        self.parallel_logits: dict[int, Tensor] = {}              # depth-s node -> [K, Vd] of its MLP heads
        return logits

    def step(self, nodes: list[int], tree) -> Tensor:
        s = self.serial_tokens
        serial = [n for n in nodes if tree.depths[n] < s]
        out = dict(zip(serial, super().step(serial, tree))) if serial else {}
        anchors = {n: tree.path(n)[s - 1] for n in nodes if tree.depths[n] >= s}
        self._run_parallel(sorted(set(anchors.values()) - set(self.parallel_logits)), tree)
        for n, anchor in anchors.items():
            out[n] = self.parallel_logits[anchor][tree.depths[n] - s]
        return torch.stack([out[n] for n in nodes])

    def _run_parallel(self, anchors: list[int], tree) -> None:
        """One batched MLP forward for depth-s nodes: [A, s*d] fused pairs -> [K, A, Vd] draft logits."""
        if not anchors:
            return
        device = self.tokens.device
        paths = [tree.path(a) for a in anchors]                   # depths 1..s
        tokens = torch.tensor([[tree.tokens[n] for n in path] for path in paths], device=device)
        parent_states = torch.stack([torch.stack([self.outputs.get(tree.parents[n], self.root_hidden)
                                                  for n in path]) for path in paths])        # [A, s, d]
        pairs = self.head.fuse(parent_states, tokens).flatten(1)                              # [A, s*d]
        logits = self.head.draft_logits(self.head.parallel(pairs)).float()                   # [K, A, Vd]
        self.parallel_logits.update((a, logits[:, i]) for i, a in enumerate(anchors))
