"""Drafter kinds, by the name recipes use in `drafter.kind`: each kind's model class and config (its
`drafter.*` keys, declared once in the kind's module)."""
from draftlab.drafters.acceptance import AcceptanceConfig, AcceptanceHead
from draftlab.drafters.eagle import EagleConfig, EagleHead
from draftlab.drafters.eagle3 import Eagle3Config, EagleHead3
from draftlab.drafters.medusa import Medusa2Config, Medusa2Lora, MedusaConfig, MedusaHeads
from draftlab.drafters.small_lm import SmallLM, SmallLMConfig

DRAFTERS = {
    "eagle": EagleHead,
    "eagle3": EagleHead3,
    "medusa": MedusaHeads,
    "medusa2": Medusa2Lora,
    "small_lm": SmallLM,
    "acceptance": AcceptanceHead,
}
CONFIGS = {
    "eagle": EagleConfig,
    "eagle3": Eagle3Config,
    "medusa": MedusaConfig,
    "medusa2": Medusa2Config,
    "small_lm": SmallLMConfig,
    "acceptance": AcceptanceConfig,
}


def load_drafter(folder, target):
    """The drafter saved in a checkpoint folder (a run folder means its best step), on the target's device."""
    from draftlab import checkpoint

    return checkpoint.restore_drafter(folder, target, DRAFTERS)
