"""Drafter kinds, by the name recipes use in `drafter.kind`."""
from draftlab.drafters.acceptance import AcceptanceHead
from draftlab.drafters.eagle import EagleHead
from draftlab.drafters.eagle3 import EagleHead3
from draftlab.drafters.medusa import Medusa2Lora, MedusaHeads
from draftlab.drafters.small_lm import SmallLM

DRAFTERS = {
    "eagle": EagleHead,
    "eagle3": EagleHead3,
    "medusa": MedusaHeads,
    "medusa2": Medusa2Lora,
    "small_lm": SmallLM,
    "acceptance": AcceptanceHead,
}
