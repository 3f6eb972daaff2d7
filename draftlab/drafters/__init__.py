"""Drafter kinds, by the name recipes use in `drafter.kind`."""
from draftlab.drafters.eagle import EagleHead

DRAFTERS = {
    "eagle": EagleHead,
}
