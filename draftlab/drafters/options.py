"""What every drafter kind's config shares: the `kind` key, and option groups that several kinds take.

Each drafter module declares its config once, as a dataclass built from these (`EagleConfig` in eagle.py, ...):
its fields are the `drafter.*` keys of that kind, with their defaults and docs. config.py selects the dataclass
by `drafter.kind`, so a key that belongs to another kind is an error, and a drafter reads its settings with
`settings(ConfigClass, source)`.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields


@dataclass
class DrafterConfig:
    kind: str = "eagle"
    """Drafter kind: one of draftlab.drafters.DRAFTERS (eagle, eagle3, gumiho, medusa, medusa2, small_lm,
    acceptance)."""

    @staticmethod
    def run_problem(cfg) -> str | None:
        """What makes the whole run config `cfg` unusable for this kind, in one line (None: nothing); config.validate
        raises it before anything loads."""
        return None

    @staticmethod
    def target_problem(drafter_cfg, text) -> str | None:
        """What these drafter.* settings cannot be for this target, in one line (None: nothing). `text`: the target's
        text config (config.json, read before its weights load: num_hidden_layers, vocab_size). Kinds with layer or
        token ids add theirs (and call this one)."""
        return draft_vocab_problem(drafter_cfg, text)

    @staticmethod
    def packs(drafter_cfg) -> bool:
        """Whether this kind (with these drafter.* settings) trains on packed rows (train.pack_tokens,
        draftlab/packing.py): kinds whose loss reads only the batch's conversations say yes."""
        return False


@dataclass
class DraftVocabOption:
    draft_vocab_size: int = 0
    """Draft vocabulary = the N most frequent assistant tokens of data.train; the drafter proposes only those, so
    a draft step skips most of the LM head (0 = the full vocabulary, -1 = auto: 32000, or every distinct
    assistant token when the data holds fewer; an explicit N above that count is an error)."""


def draft_vocab_problem(drafter_cfg, text) -> str | None:
    """A draft vocabulary larger than the target's (it would silently become the full vocabulary)."""
    size, vocab = getattr(drafter_cfg, "draft_vocab_size", None), getattr(text, "vocab_size", None)
    if size is not None and vocab and int(size) > int(vocab):
        return (f"drafter.draft_vocab_size={size} is above the target's vocabulary of {vocab} tokens: give N up to "
                f"{vocab}, 0 (the full vocabulary) or -1 (auto)")
    return None


def layer_ids(drafter_cfg, key: str) -> list:
    """A list-valued drafter key (aux_layers, target_layers) as a plain list ([] when the kind has none)."""
    value = getattr(drafter_cfg, key, None)
    return list(value) if value is not None else []


def whole_numbers_problem(key: str, ids: list, low: int | None = 0) -> str | None:
    """Layer ids that are not whole numbers, or below `low`."""
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or (low is not None and i < low)]
    if bad:
        return (f"config key 'drafter.{key}' is {ids}: {bad} {'is' if len(bad) == 1 else 'are'} not "
                f"{'a layer id' if len(bad) == 1 else 'layer ids'} (whole numbers"
                f"{f' from {low}' if low is not None else ''}), e.g. drafter.{key}='[1,2]'")
    return None


@dataclass
class EagleHeadOptions:
    """The settings of an EAGLE-1 head (eagle.py `EagleHead`): its own kind's, and Gumiho's serial head's."""
    feature_noise: float = 0.2
    """Std of the uniform noise added to target features during training (0 = off)."""
    reg_weight: float = 1.0
    """Weight of the feature-regression (SmoothL1) loss terms."""
    cls_weight: float = 0.1
    """Weight of the soft cross-entropy terms against the target distribution."""
    fc_bias: bool = True
    """Bias in the fusion layer."""


@dataclass
class LoraOptions:
    lora_r: int = 0
    """LoRA rank (0 = no adapters)."""
    lora_alpha: int = 0
    """LoRA alpha (0 = 2 * lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA path."""


def settings(config_class, source=None) -> dict:
    """The kind's settings (every field but `kind`) read from `source`: a config node or object (attributes), a
    dict (a saved drafter_config.json), or None; what it lacks takes the dataclass default. Lists come back as
    plain lists (a config node holds ListConfig)."""
    out = {}
    for f in fields(config_class):
        if f.name == "kind":
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        if source is None:
            value = default
        elif isinstance(source, dict):
            value = source.get(f.name, default)
        else:
            value = getattr(source, f.name, default)
        out[f.name] = list(value) if isinstance(default, list) and value is not None else value
    return out


def check_target_size(kind: str, saved: dict, target) -> None:
    """Refuse to rebuild a `kind` checkpoint for a target of another width or vocabulary (saved: the sizes it
    recorded)."""
    text = target.config.get_text_config()
    for key in ("hidden_size", "vocab_size"):
        if key in saved and saved[key] != getattr(text, key):
            raise ValueError(f"{kind} checkpoint was trained for a target with {key}={saved[key]} but this target has "
                             f"{getattr(text, key)}: load it with the target it was trained on")


def setting_names(config_class) -> list[str]:
    """The kind's setting keys (every field but `kind`), in declaration order."""
    return [f.name for f in fields(config_class) if f.name != "kind"]
