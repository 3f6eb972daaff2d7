"""Small LM drafter: a standalone causal LM with the target's tokenizer, distilled from the target.

Papers (method_specs.md section 4): DistillSpec (Zhou et al., ICLR 2024: on-policy data + a divergence
chosen for the decoding strategy), Online Speculative Decoding (Liu et al., ICML 2024) and Hong et al.,
"Training Domain Draft Models for Speculative Decoding" (2025: offline vs online, white-box vs black-box).

The model is any transformers causal LM with exactly the target's vocabulary: built from the target's own
config with fewer / narrower layers (optionally with the target's embeddings and LM head copied in and frozen),
or loaded from a small pretrained folder (`init_from`), optionally adapted with LoRA (`lora_r`).

What it optimises, by `distill_mode` (logits at position t predict token t+1, weighted by the mask of t+1):
  offline_blackbox  cross-entropy on the assistant tokens of conversations the target wrote itself
                    (sequence-level KD; `data.regenerate_from` makes them);
  offline_whitebox  divergence (`distill_loss`: fkl | rkl | jsd | tvd) to the target's top-k distribution
                    at every assistant position, read from the offline store (`data.store`);
  online_whitebox   DistillSpec / GKD: with probability `student_ratio` the student continues the prompt
                    itself (sampled, `rollout_tokens`) and the target, run inside the step, scores those
                    tokens; otherwise the dataset's assistant tokens, with teacher logits from a target forward;
  online_blackbox   the target answers the prompt inside the step (greedy, `rollout_tokens`); CE on its text.
Why TVD: a draft token drawn from q is accepted with probability sum_x min(p, q) = 1 - TVD(p, q) (method_specs
1.3), so minimising the expected TVD over the prefixes the drafter will see (its own, on-policy) maximises the
acceptance rate; the other divergences are smoother surrogates of the same goal.

Draft vocabulary (`draft_vocab_size`, draftlab/vocab.py; FR-Spec, Zhao et al. 2025): the proposer runs the
model's decoder and only the LM-head rows of the most frequent assistant tokens, and drafts inside them (greedy:
the argmax over those rows; sampling: q = the drafter's distribution renormalised on them, zero elsewhere).
Training keeps the full LM head, on purpose: FR-Spec restricts the head at inference only, so every loss above
stays what it was (a black-box label outside the draft vocabulary has no row to score, and a white-box teacher
would need renormalising on the draft vocabulary, differently per divergence); the exported transformers
folder, which engines run as `assistant_model` with its full head, stays a fully trained drafter; and the
argmax over the draft rows of a full-head model is exactly its argmax wherever that token is draftable.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from draftlab import packing, vocab
from draftlab.drafters.options import DrafterConfig, DraftVocabOption, LoraOptions, settings
from draftlab.errors import ConfigError
from draftlab.proposers import CausalLMProposer
from draftlab.serving import add_legacy_keys, decoder_layers, final_norm, lora_targets

MODES = ("offline_blackbox", "offline_whitebox", "online_whitebox", "online_blackbox")


@dataclass
class SmallLMConfig(LoraOptions, DraftVocabOption, DrafterConfig):
    """drafter.* keys of drafter.kind=small_lm. Its draft vocabulary restricts the LM head at drafting time only
    (training keeps the full head); lora_* put adapters on the small LM (0 = none)."""
    kind: str = "small_lm"
    num_layers: int = 1
    """Decoder layers of a drafter built from the target's config."""
    hidden_size: int = 0
    """Width of a drafter built from the target's config (0 = the target's)."""
    num_attention_heads: int = 0
    """Attention heads (0 = the target's at the target's width, else hidden_size // 64)."""
    num_key_value_heads: int = 0
    """Key/value heads (0 = the target's, at most num_attention_heads)."""
    intermediate_size: int = 0
    """MLP width (0 = the target's at the target's width, else 4 x hidden_size)."""
    share_embeddings: bool = True
    """Built from the target's config: copy the target's input embeddings and LM head in (needs the target's width)."""
    train_shared_embeddings: bool = False
    """Keep the copied embeddings / LM head trainable and saved (default: frozen, restored from the target)."""
    init_from: str = ""
    """Start from this local pretrained model folder (the target's tokenizer) instead of the target's config."""
    target_layers: list[int] = field(default_factory=list)
    """Build the drafter from these decoder layers of the target (indices; negative count from the end), with its
    embeddings, final norm and LM head: the self-speculative / layer-skip start. Sets the depth (num_layers is
    then ignored) and needs the target's width (hidden_size 0)."""
    distill_mode: str = "offline_blackbox"
    """offline_blackbox, offline_whitebox, online_whitebox, online_blackbox."""
    distill_loss: str = "fkl"
    """White-box divergence: fkl, rkl, jsd, tvd."""
    distill_temperature: float = 1.0
    """White-box: temperature applied to both student and teacher logits."""
    jsd_beta: float = 0.5
    """Beta of the generalised JSD (beta*KL(p||M) + (1-beta)*KL(q||M), M = beta*p + (1-beta)*q)."""
    student_ratio: float = 0.5
    """online_whitebox: probability that a step trains on the student's own continuations."""
    rollout_tokens: int = 64
    """Online modes: tokens generated per prompt by the student (online_whitebox) or the target (online_blackbox)."""
    teacher_topk: int = 20
    """offline_whitebox: the target's top-k log-probs (plus tail mass) read from data.store."""

    @staticmethod
    def target_problem(drafter_cfg, text) -> str | None:
        from draftlab.drafters.options import layer_ids

        ids, depth = layer_ids(drafter_cfg, "target_layers"), text.num_hidden_layers
        bad = [i for i in ids if not -depth <= int(i) < depth]
        if bad:
            return (f"drafter.target_layers {ids}: {bad} outside the target's {depth} decoder layers (use "
                    f"0..{depth - 1}, or -1 for the last)")
        resolved = [int(i) % depth for i in ids]
        if resolved != sorted(set(resolved)):
            return (f"drafter.target_layers {ids} = layers {resolved} of the target: give each layer once, in the "
                    "target's order")
        return DrafterConfig.target_problem(drafter_cfg, text)

    @staticmethod
    def run_problem(cfg) -> str | None:
        from draftlab.drafters.options import layer_ids, whole_numbers_problem

        problem = whole_numbers_problem("target_layers", layer_ids(cfg.drafter, "target_layers"), low=None)
        if problem:
            return problem
        if cfg.drafter.distill_mode == "offline_whitebox" and not cfg.data.store:
            return ("drafter.distill_mode=offline_whitebox reads the target's top-k logits from a store: set "
                    "data.store=PATH (built on first use)")
        return None

    @staticmethod
    def packs(drafter_cfg) -> bool:
        return str(drafter_cfg.distill_mode).startswith("offline")   # online modes continue the batch's prompts


class VocabularyMismatchError(ConfigError):
    """The drafter's tokenizer or vocabulary is not the target's; the message says what, where and how to fix."""


# ----------------------------------------------------------------------------------------------------------
# building the model


def target_tokenizer(target):
    """The target's tokenizer when it can be found from the model alone (its local folder), else None."""
    path = getattr(target.config, "_name_or_path", "") or ""
    return _folder_tokenizer(path) if os.path.isdir(path) else None


def _folder_tokenizer(folder: str):
    """The tokenizer saved in a model folder, or None when it has none."""
    if not any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def check_vocabulary(model, tokenizer, target, target_tok, where: str) -> None:
    """Refuse a drafter whose vocabulary (embedding rows) or tokenizer fingerprint differs from the target's.

    tokenizer / target_tok may be None (then only the vocabulary sizes are compared)."""
    from draftlab.target import vocab_hash

    mine, theirs = model.get_output_embeddings().weight.shape[0], target.get_output_embeddings().weight.shape[0]
    if mine != theirs:
        raise VocabularyMismatchError(
            f"drafter from {where} has a vocabulary of {mine} tokens but the target has {theirs}: a draft model must "
            "use the target's tokenizer (pick a model of the target's family, or train one from the target's config "
            "with drafter.init_from='')")
    if tokenizer is not None and target_tok is not None and vocab_hash(tokenizer) != vocab_hash(target_tok):
        raise VocabularyMismatchError(
            f"drafter from {where} has a different tokenizer than the target (vocabulary fingerprint "
            f"{vocab_hash(tokenizer)} vs {vocab_hash(target_tok)}, same size {mine}): token ids would not mean the "
            "same thing; use a model trained with the target's tokenizer, or drafter.init_from='' to build one")


def drafter_model_config(target, num_layers: int, hidden_size: int, heads: int, kv_heads: int, intermediate: int):
    """The target's own config (same family, same vocabulary and special tokens) with a smaller stack."""
    source = target.config.get_text_config(decoder=True)
    cfg = copy.deepcopy(source)
    hidden = hidden_size or cfg.hidden_size
    heads = heads or (cfg.num_attention_heads if hidden == cfg.hidden_size else max(1, hidden // 64))
    kv = kv_heads or min(getattr(cfg, "num_key_value_heads", heads) or heads, heads)
    if hidden % heads or heads % kv:
        raise ConfigError(f"small_lm: hidden_size {hidden} must be divisible by num_attention_heads {heads}, and "
                         f"that by num_key_value_heads {kv}: set drafter.num_attention_heads / num_key_value_heads")
    default_inter = cfg.intermediate_size if hidden == cfg.hidden_size else 4 * hidden
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = num_layers, hidden, intermediate or default_inter
    reshaped = (hidden, heads) != (source.hidden_size, source.num_attention_heads)
    cfg.num_attention_heads, cfg.num_key_value_heads = heads, kv
    if reshaped and getattr(cfg, "head_dim", None) is not None:
        # a head size derived from the new width; left alone for the target's own shapes (MLA's head_dim is its
        # rope part) and where the config computes it (a read-only property, as Falcon's)
        with contextlib.suppress(AttributeError):
            cfg.head_dim = hidden // heads
    for key, value in source.to_dict().items():      # per-layer lists (layer_types, attention_layers, ...): the first
        if isinstance(value, list) and len(value) == source.num_hidden_layers and hasattr(cfg, key):
            with contextlib.suppress(AttributeError):
                setattr(cfg, key, list(value)[:num_layers])
    # the proposer's trees need explicit 4-D masks, which flash-attention kernels do not take
    if cfg._attn_implementation not in ("eager", "sdpa"):
        cfg._attn_implementation = "sdpa"
    return cfg


def target_layer_indices(target, layers) -> list[int]:
    """drafter.target_layers resolved against the target's depth (negative = from the end): distinct, ascending."""
    depth = target.config.get_text_config(decoder=True).num_hidden_layers
    bad = [i for i in layers if not -depth <= int(i) < depth]
    if bad:
        raise ConfigError(f"drafter.target_layers {list(layers)}: {bad} outside the target's {depth} decoder layers "
                          f"(use 0..{depth - 1}, or -1 for the last)")
    resolved = [int(i) % depth for i in layers]
    if resolved != sorted(set(resolved)):
        raise ConfigError(f"drafter.target_layers {list(layers)} = layers {resolved} of the target: give each layer "
                          "once, in the target's order")
    return resolved


def layer_subset(target, s: dict):
    """A causal LM of the target's family made of some of its decoder layers (copied, trainable) with its
    embeddings, final norm and LM head (copied; embeddings and head frozen unless train_shared_embeddings):
    the self-speculative / layer-skip start (Draft & Verify, LayerSkip), then distilled like any small_lm."""
    from transformers import AutoModelForCausalLM

    if s["hidden_size"] or s["intermediate_size"] or s["num_attention_heads"] or s["num_key_value_heads"] \
            or not s["share_embeddings"]:
        raise ConfigError("drafter.target_layers copies the target's layers, so the drafter has the target's shapes: "
                          "leave drafter.hidden_size, intermediate_size, num_attention_heads and num_key_value_heads "
                          "at 0 and share_embeddings true")
    chosen = target_layer_indices(target, s["target_layers"])
    config = drafter_model_config(target, len(chosen), 0, 0, 0, 0)
    source = target.config.get_text_config(decoder=True)
    if getattr(source, "layer_types", None) is not None:
        config.layer_types = [source.layer_types[i] for i in chosen]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    (theirs, name), (mine, _) = decoder_layers(target), decoder_layers(model)
    theirs_norm, mine_norm = final_norm(target), final_norm(model)
    with torch.no_grad():
        for j, i in enumerate(chosen):
            getattr(mine, name)[j].load_state_dict({k: v.float() for k, v in getattr(theirs, name)[i].state_dict().items()})
        mine_norm.load_state_dict({k: v.float() for k, v in theirs_norm.state_dict().items()})
    SmallLM._copy_embeddings(model, target, not s["train_shared_embeddings"])
    for p in [*getattr(mine, name).parameters(), *mine_norm.parameters()]:
        p.requires_grad_(True)
    return model


# ----------------------------------------------------------------------------------------------------------
# batches of prompts and continuations (the online modes)


def prompt_part(batch: dict, pad_id: int) -> tuple[Tensor, Tensor]:
    """The prompt of each right-padded row (tokens before its first assistant token), left-padded so that every
    prompt ends at the same column: ids [B, P], attention_mask [B, P]."""
    ids, attn = batch["input_ids"], batch["attention_mask"].bool()
    mask, lengths = batch["loss_mask"].bool() & attn, attn.sum(1)
    first = torch.where(mask.any(1), mask.float().argmax(1), lengths).clamp(min=1)
    width = int(first.max())
    out = torch.full((ids.shape[0], width), pad_id, dtype=ids.dtype, device=ids.device)
    out_mask = torch.zeros_like(out)
    for b, n in enumerate(first.tolist()):
        out[b, width - n:], out_mask[b, width - n:] = ids[b, :n], 1
    return out, out_mask


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids [B, T] that count only attended tokens, so left padding does not shift RoPE."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def continue_prompts(model, ids: Tensor, attention_mask: Tensor, steps: int, eos_ids: list[int], pad_id: int,
                     greedy: bool, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Continue left-padded prompts ids [B, P] by up to `steps` tokens with the model's KV cache.

    Greedy (argmax) or sampled from softmax(logits / temperature). Returns tokens [B, S] and mask [B, S]
    (1 up to and including each row's first EOS, S <= steps; pad_id after)."""
    cache, attn = DynamicCache(config=model.config), attention_mask.long()
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn), past_key_values=cache, use_cache=True)
    eos = torch.tensor(eos_ids, device=ids.device)
    alive = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    tokens, masks = [], []
    for step in range(steps):
        logits = out.logits[:, -1].float()
        tok = logits.argmax(-1) if greedy else torch.multinomial((logits / temperature).softmax(-1), 1)[:, 0]
        tok = torch.where(alive, tok, torch.full_like(tok, pad_id))
        tokens.append(tok)
        masks.append(alive.clone())
        alive &= ~torch.isin(tok, eos)
        if not alive.any() or step == steps - 1:
            break
        attn = torch.cat([attn, alive[:, None].long()], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=attn.sum(1, keepdim=True) - 1,
                    past_key_values=cache, use_cache=True)
    return torch.stack(tokens, 1), torch.stack(masks, 1).long()


# ----------------------------------------------------------------------------------------------------------
# the drafter


class SmallLM(nn.Module):
    """A small causal LM (`self.model`, any transformers architecture) drafting for the target.

    The target is held as an unregistered reference (not a submodule: never trained, saved or moved); the
    online modes run it under no_grad inside `loss`. `teacher_topk` > 0 (offline white-box only) makes the
    training loop ask the store for the target's top-k log-probabilities.
    """

    kind = "small_lm"
    config_class = SmallLMConfig
    card_name = "small draft language model"
    export_format = "hf"            # a transformers folder: `assistant_model`, vLLM and SGLang draft models
    feature_layers: tuple[int, ...] = ()
    teacher_topk = 0

    def __init__(self, target, model: nn.Module, settings: dict, tokenizer=None, draft_vocab: list[int] | None = None):
        super().__init__()
        vocab.check_size(settings["draft_vocab_size"])
        if settings["distill_mode"] not in MODES:
            raise ConfigError(f"drafter.distill_mode is '{settings['distill_mode']}': choose one of {', '.join(MODES)}")
        from draftlab.losses import DIVERGENCES

        if settings["distill_loss"] not in DIVERGENCES:
            raise ConfigError(f"drafter.distill_loss is '{settings['distill_loss']}': choose one of "
                             f"{', '.join(DIVERGENCES)}")
        self.model, self.settings = model, dict(settings)
        self.__dict__["target"] = target
        self.__dict__["tokenizer"] = tokenizer
        self.teacher_topk = settings["teacher_topk"] if settings["distill_mode"] == "offline_whitebox" else 0
        from draftlab.target import eos_ids

        self.eos_ids = eos_ids(None, target)
        pad = getattr(target.config, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        # the model's own LM head read on the draft vocabulary (all rows until prepare() or a checkpoint sets one)
        self.draft_head = vocab.DraftHead(model.get_output_embeddings(), self.vocab_size)
        if draft_vocab is not None:
            self.draft_head.set_vocab(draft_vocab)

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, cfg=None, tokenizer=None) -> "SmallLM":
        """cfg: a SmallLMConfig node or any object with its fields (missing ones and None = the defaults).
        tokenizer: the target's (None: found from the target's folder when it has one) to check a pretrained
        drafter's tokenizer."""
        own = settings(SmallLMConfig, cfg)
        own["target_layers"] = [int(i) for i in own["target_layers"]]
        return cls._build(target, own, tokenizer if tokenizer is not None else target_tokenizer(target))

    @classmethod
    def _build(cls, target, s: dict, tokenizer, draft_vocab: list[int] | None = None) -> "SmallLM":
        from transformers import AutoModelForCausalLM

        if s["init_from"]:
            where = f"drafter.init_from={s['init_from']}"
            if not (Path(s["init_from"]) / "config.json").is_file():
                raise ConfigError(f"{where}: no config.json there; point it at a local transformers model folder")
            model = AutoModelForCausalLM.from_pretrained(s["init_from"], dtype=torch.float32)
            check_vocabulary(model, _folder_tokenizer(s["init_from"]), target, tokenizer, where)
        elif s["target_layers"]:
            model = layer_subset(target, s)
        else:
            config = drafter_model_config(target, s["num_layers"], s["hidden_size"], s["num_attention_heads"],
                                          s["num_key_value_heads"], s["intermediate_size"])
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            if s["share_embeddings"]:
                cls._copy_embeddings(model, target, not s["train_shared_embeddings"])
        if s["lora_r"] > 0:
            from peft import LoraConfig, get_peft_model

            model.requires_grad_(False)
            lora = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"] or 2 * s["lora_r"],
                              lora_dropout=s["lora_dropout"], target_modules=lora_targets(model), task_type="CAUSAL_LM")
            model = get_peft_model(model, lora)
        model.generation_config.pad_token_id = getattr(target.config, "pad_token_id", None)
        return cls(target, model.to(target.device).train(), s, tokenizer, draft_vocab)

    @staticmethod
    def _copy_embeddings(model, target, freeze: bool) -> None:
        """Copy the target's input embeddings and LM head (same width needed); frozen ones are not saved and are
        copied again from the target when a checkpoint is loaded."""
        mine, theirs = model.get_input_embeddings().weight, target.get_input_embeddings().weight
        if mine.shape != theirs.shape:
            raise ConfigError(f"drafter.share_embeddings needs the target's width: the drafter has hidden_size "
                             f"{mine.shape[1]}, the target {theirs.shape[1]}; set drafter.hidden_size=0 (the target's) "
                             "or drafter.share_embeddings=false")
        with torch.no_grad():
            mine.copy_(theirs)
            head, target_head = model.get_output_embeddings().weight, target.get_output_embeddings().weight
            if head is not mine:
                head.copy_(target_head)
        for p in (mine, model.get_output_embeddings().weight):
            p.requires_grad_(not freeze)

    def drafter_config(self) -> dict:
        from draftlab.target import target_fingerprint

        settings = dict(self.settings)
        if settings["init_from"]:
            settings["init_from"] = str(Path(settings["init_from"]).resolve())
        return {"kind": self.kind, **settings, "vocab_size": self.vocab_size,
                "target": target_fingerprint(self.target, self.tokenizer),
                "draft_vocab": self.draft_head.draft_vocab.tolist() if self.draft_head.reduced else None}

    @classmethod
    def from_config(cls, config: dict, target) -> "SmallLM":
        return cls._build(target, settings(SmallLMConfig, config), target_tokenizer(target), config.get("draft_vocab"))

    def prepare(self, dataset) -> None:
        """Choose the draft vocabulary (drafter.draft_vocab_size) from the training rows' assistant tokens."""
        if self.settings["draft_vocab_size"]:
            self.draft_head.set_vocab(vocab.choose(vocab.assistant_token_counts(dataset),
                                                   self.settings["draft_vocab_size"], self.vocab_size, who="small_lm"))

    def checkpoint_tensors(self) -> dict[str, dict[str, Tensor]]:
        return self.draft_head.maps()

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    # --- the network --------------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                logits_to_keep: int = 0) -> Tensor:
        """input_ids [B, T] -> logits [B, T, V] (position t predicts token t+1); only the last `logits_to_keep`
        positions when > 0 ([B, logits_to_keep, V])."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          logits_to_keep=logits_to_keep).logits

    # --- losses -------------------------------------------------------------------------------------------
    def loss(self, batch: dict, features: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """batch: input_ids, attention_mask, loss_mask [B, T] (right-padded; offline white-box also
        teacher_topk_ids / teacher_topk_logprobs [B, T, k] and teacher_tail_mass [B, T], aligned with the
        positions whose logits they describe). features: unused (None). Returns (loss, metrics)."""
        mode = self.settings["distill_mode"]
        if mode == "online_blackbox":
            return self._cross_entropy(*self._continuation(batch, self.target, greedy=True))
        if mode == "online_whitebox":
            on_policy = bool(torch.rand(()) < self.settings["student_ratio"])
            seq = self._continuation(batch, self.model, greedy=False) if on_policy else self._dataset(batch)
            with torch.no_grad():
                teacher = self.target(input_ids=seq[0], attention_mask=seq[1], position_ids=seq[3],
                                      logits_to_keep=seq[4]).logits
            loss, metrics = self._divergence(*seq, teacher_logits=teacher)
            return loss, {**metrics, "on_policy": float(on_policy)}
        seq = self._dataset(batch)
        if mode == "offline_blackbox":
            return self._cross_entropy(*seq)
        missing = [k for k in ("teacher_topk_ids", "teacher_topk_logprobs") if k not in batch]
        if missing:
            raise ConfigError(f"small_lm offline_whitebox needs the target's top-k logits in the batch ({missing} "
                             "missing): set data.store=PATH so the training loop builds and reads the store")
        return self._divergence(*seq, topk=(batch["teacher_topk_ids"],
                                batch["teacher_topk_logprobs"], batch.get("teacher_tail_mass")))

    def topk_loss(self, batch: dict) -> tuple[Tensor, dict[str, float]]:
        """The divergence (drafter.distill_loss) to the target's top-k distribution given in the batch
        (teacher_topk_ids / teacher_topk_logprobs [B, T, k], teacher_tail_mass [B, T], as in offline white-box
        mode) at the loss_mask positions, whatever distill_mode the drafter was trained with: what online updates
        from a round log use (`draftlab/online.py`), with no target run."""
        return self._divergence(*self._dataset(batch), topk=(batch["teacher_topk_ids"], batch["teacher_topk_logprobs"],
                                                             batch.get("teacher_tail_mass")))

    def _dataset(self, batch: dict):
        """The batch as is: ids, attention [B, T] (a packed batch: its block-diagonal mask [B, 1, T, T]), weight
        [B, T] (1 on assistant tokens; 0 on a packed conversation's first token, which the one before it does not
        predict), positions (None, or per conversation when packed), and 0 = logits at every position."""
        docs = packing.doc_ids(batch)
        weight = batch["loss_mask"] * (docs > 0)
        weight[:, 1:] *= packing.same_doc(docs, 1)
        inputs = packing.model_inputs(batch, self.model.dtype)
        return batch["input_ids"], inputs["attention_mask"], weight, inputs.get("position_ids"), 0

    def _continuation(self, batch: dict, model, greedy: bool):
        """Prompts of the batch continued by `model` (the target: greedy; the student: sampled at T=1):
        ids [B, P+S], attention [B, P+S], weight [B, P+S] (1 on the new tokens), positions [B, P+S], and S+1:
        only the logits of the last S+1 positions are needed (the predictions of the S new tokens, plus one)."""
        prompts, prompt_mask = prompt_part(batch, self.pad_id)
        new, new_mask = continue_prompts(model, prompts, prompt_mask, self.settings["rollout_tokens"], self.eos_ids,
                                         self.pad_id, greedy=greedy)
        ids, attn = torch.cat([prompts, new], 1), torch.cat([prompt_mask, new_mask], 1)
        weight = torch.cat([torch.zeros_like(prompt_mask), new_mask], 1)
        return ids, attn, weight, positions(attn), new.shape[1] + 1

    def _cross_entropy(self, ids, attn, weight, pos, keep: int):
        """CE of the next token at the weighted positions; keep > 0: only the last `keep` positions can count."""
        from draftlab.losses import hard_cross_entropy

        logits = self(ids, attn, pos, keep)[:, :-1]
        labels, mask = ids[:, -keep:][:, 1:], weight[:, -keep:][:, 1:].bool()
        loss = hard_cross_entropy(logits, labels, mask)
        acc = (logits.argmax(-1) == labels)[mask].float().mean() if mask.any() else torch.zeros(())
        return loss, {"acc": acc.item(), "tokens": float(mask.sum())}

    def _divergence(self, ids, attn, weight, pos, keep: int, teacher_logits: Tensor | None = None, topk=None):
        """Divergence at the weighted positions only: both distributions are gathered to [1, N, V] first, so the
        dense [B, T, V] teacher never exists for the (long) prompt and padding positions. teacher_logits cover
        the same last `keep` positions as the student's (all when 0); topk tensors cover every position."""
        from draftlab.losses import DIVERGENCES, sparse_teacher_probs, total_variation

        mask = weight[:, -keep:][:, 1:].bool()
        student = self(ids, attn, pos, keep)[:, :-1][mask][None]           # [1, N, V]
        if topk is not None:
            top_ids, top_lp, tail = (t[:, :-1][mask] if t is not None else None for t in topk)
            teacher = {"teacher_logits": None, "teacher_probs": sparse_teacher_probs(
                top_ids[None], top_lp[None], tail[None] if tail is not None else None, student.shape[-1])}
        else:
            teacher = {"teacher_logits": teacher_logits[:, :-1][mask][None].to(student.dtype)}
        ones = torch.ones(student.shape[:2], device=student.device)
        name = self.settings["distill_loss"]
        extra = {"beta": self.settings["jsd_beta"]} if name == "jsd" else {}
        loss = DIVERGENCES[name](student, mask=ones, temperature=self.settings["distill_temperature"], **teacher,
                                 **extra)
        with torch.no_grad():  # 1 - TVD at T=1: the expected acceptance rate of a sampled draft token here
            tvd = total_variation(student, mask=ones, **teacher)
            p = teacher["teacher_probs"] if topk is not None else teacher["teacher_logits"]
            acc = (student.argmax(-1) == p.argmax(-1)).float().mean() if mask.any() else torch.zeros(())
        return loss, {"accept_est": 1.0 - tvd.item(), "acc": acc.item(), "tokens": float(mask.sum())}

    # --- evaluation and export ----------------------------------------------------------------------------
    def proposer(self, target=None, **opts):
        """Drafts with the model through its draft head."""
        return CausalLMProposer(self.model, self.draft_head)

    def export_pretrained(self, folder: str | Path, tokenizer=None) -> Path:
        """Write a standard transformers folder (config, model.safetensors, generation config, tokenizer) that
        loads with AutoModelForCausalLM and serves as `assistant_model` in `generate`. LoRA is merged first."""
        folder = Path(folder)
        model = self.model
        if hasattr(model, "merge_and_unload"):      # a peft model: fold the adapters into a copy of the weights
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(str(folder))
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))
        return folder

    @staticmethod
    def export(src, out: Path, meta: dict) -> dict:
        """A standard transformers folder (config, weights, generation config, tokenizer) that loads with
        AutoModelForCausalLM and drafts as `assistant_model`; written by the drafter's own export_pretrained."""
        model, tokenizer = src.target()
        src.drafter(model).export_pretrained(out, tokenizer)
        add_legacy_keys(out)
        return {}
