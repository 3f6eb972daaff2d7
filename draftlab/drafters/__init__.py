"""Drafter kinds, by the name recipes use in `drafter.kind`: each kind's model class, and its config class (its
`drafter.*` keys, declared once in the kind's module)."""
from draftlab.drafters.acceptance import AcceptanceHead
from draftlab.drafters.dflash import DFlashDrafter
from draftlab.drafters.eagle import EagleHead
from draftlab.drafters.eagle3 import EagleHead3
from draftlab.drafters.gumiho import GumihoHeads
from draftlab.drafters.medusa import MedusaHeads
from draftlab.drafters.medusa2 import Medusa2Lora
from draftlab.drafters.small_lm import SmallLM

DRAFTERS = {cls.kind: cls for cls in (EagleHead, EagleHead3, GumihoHeads, MedusaHeads, Medusa2Lora, SmallLM,
                                                 AcceptanceHead, DFlashDrafter)}
CONFIGS = {kind: cls.config_class for kind, cls in DRAFTERS.items()}


def load_drafter(folder, target):
    """The drafter saved in a checkpoint folder (a run folder means its best step), on the target's device."""
    from draftlab import checkpoint

    return checkpoint.restore_drafter(folder, target, DRAFTERS)
