"""Acceptance-prediction head on a frozen drafter, and the adaptive draft length it drives.

Paper: Huang, Guo, Wang, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate Lengths" (COLM 2025);
method_specs.md section 5.

What it optimises: a small residual network reads the frozen base drafter's last hidden state (after the final
norm) at a draft token's position, i.e. after the drafter has consumed that token, and predicts the probability
that the target accepts the token. Training data follow SpecDec++: along target-written conversations the base
drafter, teacher-forced on the target's text X, samples Y_t ~ q(.|X_<t) at every assistant position; the soft
label is p_acc,t = min(1, p(Y_t)/q(Y_t)) (the chance that rejection sampling accepts Y_t). The head's input
sequence Z mixes both: Z_t = X_t with probability `mix_ratio`, else Y_t; positions holding Y_t carry the label,
positions holding X_t are ignored. Loss: class-weighted soft-label BCE (`losses.acceptance_bce`, reject-class
weight `reject_weight`). `acceptance_label=greedy` instead drafts Y_t = argmax q and labels 1[argmax p == Y_t],
which is what greedy verification accepts.

Decoding (SpecDec++ stopping rule): after each draft token the head gives p_hat; drafting stops once the chance
that some token of the chain is rejected, 1 - prod(p_hat), exceeds `adaptive_threshold`, with at least
`min_draft` and at most `TreeSpec.draft_length` tokens. A threshold of 1 never stops early (fixed-k drafting).
Only the head is saved; the base drafter is reloaded from the folder named in the config (`base`), with its draft
vocabulary (small_lm's `draft_vocab_size`): the head's proposer drafts inside it, and training drafts Y_t from
the same q the proposer uses (the base's distribution renormalised on its draft vocabulary), so the labels
describe the drafts that decoding will really make.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from draftlab import drafting
from draftlab.checkpoint import CONFIG_NAME, STATE_NAME
from draftlab.drafters.medusa import ResBlock
from draftlab.drafters.options import DrafterConfig, settings
from draftlab.errors import ConfigError
from draftlab.proposers import CausalLMProposer
from draftlab.serving import add_legacy_keys, text_decoder

LABELS = ("sampled", "greedy")


@dataclass
class AcceptanceConfig(DrafterConfig):
    """drafter.* keys of drafter.kind=acceptance (the head drafts with its base's draft vocabulary)."""
    kind: str = "acceptance"
    base: str = ""
    """The frozen small_lm drafter the head judges (run folder = its best step, or a step_N folder)."""
    acceptance_layers: int = 3
    """Residual blocks before the Linear(d -> 1) acceptance logit (SpecDec++: 3)."""
    mix_ratio: float = 0.15
    """Share of target tokens (unlabelled) mixed into the head's draft-token input sequence."""
    reject_weight: float = 6.0
    """BCE weight of the rejected class (SpecDec++: 6, to balance the rarer rejections)."""
    adaptive_threshold: float = 0.3
    """Stop drafting when 1 - prod(predicted acceptance) exceeds this (1 = never: fixed-k)."""
    min_draft: int = 1
    """Fewest draft tokens per round before adaptive stopping may stop (at least 1)."""
    acceptance_label: str = "sampled"
    """sampled (Y ~ q, label min(1, p/q), for sampled verification) | greedy (Y = argmax q, label 1[argmax p = Y])."""

    @staticmethod
    def run_problem(cfg) -> str | None:
        if not cfg.drafter.base:
            return "drafter.kind=acceptance needs drafter.base=RUN_OR_STEP_FOLDER (a trained small_lm drafter)"
        return None


def draft_and_label(q_logits: Tensor, p_logits: Tensor, mode: str = "sampled",
                    generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Draft one token per position and label its acceptance.

    q_logits, p_logits [N, V]: the drafter's and the target's logits at the same N positions (temperature 1).
    mode "sampled": Y ~ softmax(q), label min(1, p(Y)/q(Y)); "greedy": Y = argmax q, label 1[argmax p == Y].
    Returns drafted tokens Y [N] and labels [N] in [0, 1] (float32).
    """
    from draftlab.losses import acceptance_labels

    if mode == "greedy":
        drafted = q_logits.argmax(-1)
        return drafted, (p_logits.argmax(-1) == drafted).float()
    q = q_logits.float().softmax(-1)
    if q.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=q.device), torch.zeros(0, device=q.device)
    drafted = torch.multinomial(q, 1, generator=generator)[:, 0]
    return drafted, acceptance_labels(p_logits.float().softmax(-1), q, drafted)


class AcceptanceHead(nn.Module):
    """`acceptance_layers` ResBlocks then Linear(d -> 1): the logit of "accepted" from a base hidden state [.., d].

    The base drafter (a small_lm checkpoint) is frozen and held outside this module's tree, like the target:
    it is never trained or saved here, and `.to()` / `.train()` on the head leave it alone.
    """

    kind = "acceptance"
    config_class = AcceptanceConfig
    card_name = "acceptance-prediction head"
    export_format = "hf"            # the base drafter as a transformers folder, the head beside it
    adaptive_length = True          # its proposer takes adaptive_threshold / min_draft (draftlab eval options)
    feature_layers: tuple[int, ...] = ()

    def __init__(self, target, base, settings: dict):
        super().__init__()
        if getattr(base, "kind", None) != "small_lm":
            raise ConfigError(f"drafter.base {settings['base']} is a '{getattr(base, 'kind', '?')}' drafter: the "
                             "acceptance head needs a small_lm base (its proposer keeps the drafter's hidden states)")
        if settings["acceptance_label"] not in LABELS:
            raise ConfigError(f"drafter.acceptance_label is '{settings['acceptance_label']}': choose one of "
                             f"{', '.join(LABELS)}")
        if not 0.0 <= settings["mix_ratio"] < 1.0:
            raise ConfigError(f"drafter.mix_ratio is {settings['mix_ratio']}: it must be in [0, 1) (the share of "
                             "target tokens in the head's input; 1 would leave no labelled position)")
        self.settings = dict(settings)
        self.__dict__["target"] = target
        self.__dict__["base"] = base.eval().requires_grad_(False)
        d = int(base.model.get_output_embeddings().weight.shape[1])
        self.blocks = nn.Sequential(*[ResBlock(d, identity=False) for _ in range(settings["acceptance_layers"])])
        self.out = nn.Linear(d, 1)
        self.to(next(target.parameters()).device)

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, cfg=None) -> "AcceptanceHead":
        """cfg: an AcceptanceConfig node or any object with its fields; `base` (a small_lm run or step folder) is
        required."""
        own = settings(AcceptanceConfig, cfg)
        if not own["base"]:
            raise ConfigError("drafter.base is empty: point it at the small_lm run (or step_N folder) whose drafts "
                             "the acceptance head should judge")
        from draftlab.checkpoint import resolve_checkpoint

        # the exact step folder, so a reload finds the same base even after the base run's `best` moves on
        own["base"] = str(resolve_checkpoint(own["base"]).resolve())
        return cls(target, cls._load_base(own["base"], target), own)

    @staticmethod
    def _load_base(path: str, target):
        from draftlab.checkpoint import CheckpointError, restore_drafter
        from draftlab.drafters.small_lm import SmallLM

        if not Path(path).exists():
            raise CheckpointError(f"the base drafter {path} of this acceptance head is missing: the head only "
                                  "stores its own weights and needs the base checkpoint it was trained on")
        return restore_drafter(path, target, {"small_lm": SmallLM})

    def drafter_config(self) -> dict:
        from draftlab.target import target_fingerprint

        return {"kind": self.kind, **self.settings, "base_kind": self.base.kind,
                "head_width": self.out.in_features, "target": target_fingerprint(self.target, None)}

    @classmethod
    def from_config(cls, config: dict, target) -> "AcceptanceHead":
        """config["folder"] (given by checkpoint.restore_drafter): the checkpoint folder, against which a relative
        `base` (an export's draftlab/base) is resolved."""
        own = settings(AcceptanceConfig, config)
        if own["base"] and not Path(own["base"]).is_absolute() and config.get("folder"):
            own["base"] = str((Path(config["folder"]) / own["base"]).resolve())
        return cls(target, cls._load_base(own["base"], target), own)

    # --- the network --------------------------------------------------------------------------------------
    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] base-drafter states (after the final norm) -> logits of "accepted" [...]."""
        return self.out(self.blocks(hidden.to(self.out.weight.dtype))).squeeze(-1)

    def _base_states(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The frozen base drafter's last hidden states [B, T, d] (after its final norm, the LM-head input)."""
        out = self.base.model(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True,
                              logits_to_keep=1)
        return out.hidden_states[-1]

    def _draft_and_label(self, base_states: Tensor, target_states: Tensor, chunk: int = 1024):
        """base_states [N, d], target_states [N, D] at the drafted positions -> drafted [N], labels [N]. A chunk
        of positions at a time, so the [N, V] logits of both models never exist in full."""
        # q: the base drafter's logits on its draft vocabulary (-inf outside), what its proposer drafts from
        lm_q, lm_p = self.base.draft_head.full, self.target.get_output_embeddings()
        pieces = [draft_and_label(lm_q(b), lm_p(t), self.settings["acceptance_label"])
                  for b, t in zip(base_states.split(chunk), target_states.split(chunk))]
        return torch.cat([d for d, _ in pieces]), torch.cat([label for _, label in pieces])

    # --- the loss -----------------------------------------------------------------------------------------
    def loss(self, batch: dict, features: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """batch: input_ids, attention_mask, loss_mask [B, T] (the target's own answers); features unused.

        Position t's state predicts token t+1, which is drafted (and labelled) where loss_mask[t+1] is 1.
        """
        from draftlab.losses import acceptance_bce

        ids, attn = batch["input_ids"], batch["attention_mask"]
        where = (batch["loss_mask"] * attn)[:, 1:].bool()                 # [B, T-1]: token t+1 is drafted
        with torch.no_grad():
            base_states = self._base_states(ids, attn)[:, :-1][where]                            # [N, d]
            target_states = text_decoder(self.target)(input_ids=ids, attention_mask=attn).last_hidden_state
            drafted, labels = self._draft_and_label(base_states, target_states[:, :-1][where])
            # Z: the target's token with probability mix_ratio (unlabelled), else the draft (labelled)
            keep_target = torch.rand(drafted.shape, device=ids.device) < self.settings["mix_ratio"]
            mixed = ids.clone()
            mixed[:, 1:][where] = torch.where(keep_target, ids[:, 1:][where], drafted)
            states = self._base_states(mixed, attn)[:, 1:][where]                                # [N, d]
        logits = self(states)                                                                   # [N]
        labelled = ~keep_target
        loss = acceptance_bce(logits[None], labels[None], labelled[None], self.settings["reject_weight"])
        with torch.no_grad():
            n = int(labelled.sum())
            pred = torch.sigmoid(logits.float())[labelled]
            lab = labels[labelled]
            metrics = {"tokens": float(n),
                       "label_mean": lab.mean().item() if n else 0.0,
                       "pred_mean": pred.mean().item() if n else 0.0,
                       "brier": ((pred - lab) ** 2).mean().item() if n else 0.0}
        return loss, metrics

    # --- evaluation ---------------------------------------------------------------------------------------
    def proposer(self, target=None, adaptive_threshold: float | None = None,
                 min_draft: int | None = None) -> "AdaptiveProposer":
        """The base drafter's chain proposer with SpecDec++ stopping; None = the value in the drafter config.
        adaptive_threshold=1 never stops early (fixed-k drafting, with the head's predictions still recorded)."""
        threshold = self.settings["adaptive_threshold"] if adaptive_threshold is None else adaptive_threshold
        min_draft = int(self.settings["min_draft"] if min_draft is None else min_draft)
        return AdaptiveProposer(self.base.model, self, float(threshold), min_draft, self.base.draft_head)

    # --- export --------------------------------------------------------------------------------------------
    @staticmethod
    def export(src, out: Path, meta: dict) -> dict:
        """A SpecDec++ acceptance head beside its drafter: the base small_lm as a transformers folder (it drafts on
        its own as `assistant_model`, with a fixed length), the head in acceptance_head/ (config.json +
        model.safetensors: blocks.{i}.linear.*, out.* over the drafter's final-norm hidden state), and the base's
        draftlab checkpoint in draftlab/base/, which the exported drafter_config.json names."""
        model, tokenizer = src.target()
        head = src.drafter(model)
        head.base.export_pretrained(out, tokenizer)
        add_legacy_keys(out)
        (out / "acceptance_head").mkdir()
        save_file({k: v.contiguous() for k, v in src.weights.items()},
                  str(out / "acceptance_head" / "model.safetensors"))
        keys = ("acceptance_layers", "adaptive_threshold", "min_draft", "acceptance_label")
        (out / "acceptance_head" / "config.json").write_text(json.dumps(
            {"hidden_size": head.out.in_features, **{k: head.settings[k] for k in keys},
             "input": "the draft model's last hidden state (after its final norm) at the draft token",
             "output": "logit of P(the target accepts the token); stop once 1 - prod(p) > adaptive_threshold"},
            indent=2))
        base = Path(src.config["base"])
        native = Path(meta["native_dir"])
        shutil.copytree(base, native / "base", ignore=shutil.ignore_patterns(STATE_NAME, "*.tmp"))
        config = {**src.config, "base": "base"}   # relative to draftlab/: the export loads wherever it is copied
        (native / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        return {"acceptance_head": True}


class AdaptiveProposer(CausalLMProposer):
    """The base drafter's proposer whose chains stop when 1 - prod(p_hat) > threshold (within [min_draft,
    draft_length]).

    After a propose(), `predicted_acceptance` lists p_hat per draft node (NaN where it was not computed: the
    last token of a chain that reached draft_length, whose state the drafter never needed), None for trees;
    the evaluator pairs these with the verdicts for calibration. `adaptive` describes the rule for the report.
    """

    def __init__(self, model, head: AcceptanceHead, threshold: float, min_draft: int = 1, draft_head=None):
        self.acceptance, self.threshold, self.min_draft = head, threshold, max(1, min_draft)
        self.predicted_acceptance: list[float] | None = None
        super().__init__(model, draft_head)

    @property
    def adaptive(self) -> dict | None:
        """The stopping rule for the report; None at threshold >= 1, which is fixed-k drafting."""
        return {"threshold": self.threshold, "min_draft": self.min_draft} if self.threshold < 1.0 else None

    @torch.inference_mode()
    def propose(self, spec, sampling, generator: torch.Generator | None = None):
        self.predicted_acceptance = None
        if spec.kind != "chain":
            return super().propose(spec, sampling, generator)
        predicted: list[float] = []

        def stop(i: int) -> bool:
            """The drafter has just read token i-1 (its state is `hidden`): judge that token, maybe stop."""
            predicted.append(float(torch.sigmoid(self.acceptance(self.hidden).float())))
            return i >= self.min_draft and 1.0 - math.prod(predicted) > self.threshold

        tree = drafting.chain(self, spec.draft_length, sampling, generator, stop)
        self.predicted_acceptance = predicted + [math.nan] * (len(tree) - len(predicted))
        return tree
