"""Medusa-2: Medusa heads trained jointly with LoRA adapters on the target.

Paper: Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (ICML 2024);
method_specs.md 3.

What it optimises: the Medusa heads of medusa.py trained jointly with LoRA adapters on the target (peft, all linear
layers but the LM head) plus kl_weight * KL(p_original || p_adapted) on the target's next-token distribution
(the reference has the adapters disabled), which keeps the adapted model close to the original. The model
being served is then the ADAPTED target (the LoRA weights merge into it): its outputs are what Medusa-2
speculation reproduces exactly, and those differ slightly from the original target's. Evaluation is therefore
against the adapted target: `from_target` / `from_config` install the adapters into the target object they
are given, so the evaluator's verifier, its target-only baseline and the proposer's features all come from the
adapted model (lossless is relative to it), and the training metrics report how far it drifted (kl, agree).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from draftlab.drafters.medusa import MedusaConfig, MedusaHeads, MedusaProposer
from draftlab.drafters.options import LoraOptions
from draftlab.serving import add_legacy_keys, lora_targets, unwrap_lora


@dataclass
class Medusa2Config(LoraOptions, MedusaConfig):
    """drafter.* keys of drafter.kind=medusa2: Medusa heads trained jointly with LoRA adapters on the target."""
    kind: str = "medusa2"
    lora_r: int = 32
    """Rank of the LoRA adapters on the target (at least 1)."""
    kl_weight: float = 1.0
    """Weight of KL(original target || adapted target), which keeps the served model close to the original."""

    @staticmethod
    def run_problem(cfg) -> str | None:
        if cfg.drafter.lora_r < 1:
            return (f"config key 'drafter.lora_r' is {cfg.drafter.lora_r}: drafter.kind=medusa2 trains LoRA adapters "
                    "on the target, so it must be at least 1 (e.g. drafter.lora_r=32)")
        return None

    @staticmethod
    def packs(drafter_cfg) -> bool:
        return False     # it runs the adapted target on its own batches


class Medusa2Lora(MedusaHeads):
    """Medusa-2: MedusaHeads trained jointly with LoRA adapters installed IN PLACE in the target (see the module
    docstring: the adapted target is the model served and evaluated). It runs the target itself inside `loss`
    (feature_layers = ()); the proposer still reads the post-norm state that the evaluator's forward gives."""

    kind = "medusa2"
    card_name = "Medusa-2 heads (trained jointly with LoRA on the target)"
    card_note = ("Medusa-2 trains LoRA adapters on the target jointly with the heads: the model served is the adapted "
                 "target (merged here), whose outputs differ slightly from the original target's.")
    feature_layers = ()
    adapts_target = True          # the target's outputs change while training: target-only baselines go stale
    config_class = Medusa2Config

    def __init__(self, target, lora_r: int = Medusa2Config.lora_r, lora_alpha: int = Medusa2Config.lora_alpha,
                 lora_dropout: float = Medusa2Config.lora_dropout, kl_weight: float = Medusa2Config.kl_weight,
                 **medusa):
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        if any(isinstance(m, BaseTunerLayer) for m in target.modules()):
            raise ValueError("the target already carries LoRA adapters: load a fresh target for this medusa2 "
                             "drafter (one target can hold one set of Medusa-2 adapters)")
        if lora_r < 1:
            raise ValueError(f"drafter.lora_r={lora_r}: Medusa-2 needs LoRA adapters of rank >= 1 "
                             "(recipes/medusa2_lora.yaml uses 32)")
        super().__init__(target, **medusa)
        lora_alpha = lora_alpha or 2 * lora_r              # 0 = 2r, the convention small_lm uses too
        self.lora_r, self.lora_alpha, self.lora_dropout, self.kl_weight = lora_r, lora_alpha, lora_dropout, kl_weight
        config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=lora_targets(target),
                            bias="none")
        self.backbone = inject_adapter_in_model(config, target)   # registered: its LoRA weights train and save
        self.backbone.eval()

    def train(self, mode: bool = True) -> "Medusa2Lora":
        super().train(mode)
        self.backbone.eval()                 # the target never trains in dropout mode; only its adapters learn
        return self

    @contextmanager
    def original_target(self):
        """The target with its adapters switched off (the reference for the KL term)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.backbone.modules() if isinstance(m, BaseTunerLayer)]
        for m in layers:
            m.enable_adapters(False)
        try:
            yield self.backbone
        finally:
            for m in layers:
                m.enable_adapters(True)

    def loss(self, batch: dict, features: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """kl_weight * KL(p_original || p_adapted) on positions whose next token is an assistant token, plus the
        heads' loss on the adapted target's last state. features: ignored (None from the training loop)."""
        from draftlab.losses import forward_kl

        ids, attn = batch["input_ids"], batch["attention_mask"]
        out = self.backbone(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        with torch.no_grad(), self.original_target() as original:
            reference = original(input_ids=ids, attention_mask=attn).logits
        mask = batch["loss_mask"][:, 1:].bool() & attn[:, 1:].bool() & attn[:, :-1].bool()
        kl = forward_kl(out.logits[:, :-1], reference[:, :-1], mask)
        heads, metrics = self.heads_loss(batch, out.hidden_states[-1])
        agree = (out.logits[:, :-1].argmax(-1) == reference[:, :-1].argmax(-1)) & mask
        metrics.update(kl=kl.item(), agree=(agree.sum() / mask.sum().clamp(min=1)).item())
        return self.kl_weight * kl + heads, metrics

    def proposer(self, target=None, **opts) -> "MedusaProposer":
        if target is not None and target is not self.backbone:
            raise ValueError("a medusa2 drafter speculates for its adapted target: pass the target it was built on")
        return MedusaProposer(self)

    @torch.no_grad()
    def merge_adapters(self) -> None:
        """Fold the LoRA weights into the target's linear layers (for serving or export; stop training after)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for m in self.backbone.modules():
            if isinstance(m, BaseTunerLayer):
                m.merge()

    @staticmethod
    def export_base(src, out: Path, meta: dict) -> str:
        """The adapted target is the model served: the LoRA weights merged into a fresh copy of the target, saved
        in the export as a transformers folder, which base_model_name_or_path names (this repo; this folder's path
        for a local export)."""
        model, tokenizer = src.target(fresh=True)        # loading the drafter installs the adapters in place
        src.drafter(model).merge_adapters()
        unwrap_lora(model)
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        add_legacy_keys(out)
        return meta.get("repo_id") or str(Path(meta["export_dir"]).resolve())

