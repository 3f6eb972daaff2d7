"""draftlab: train draft models for speculative decoding and score them by real speculative decoding."""

__version__ = "0.1.0"
