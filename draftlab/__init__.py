"""draftlab: train draft models for speculative decoding and score them by real speculative decoding."""

__version__ = "0.1.0"

import logging as _logging

# DeepSpeed (the `deepspeed` extra) logs to stdout, and transformers imports it while saving a model: on a machine
# without a GPU every such command would print "Setting accelerator to CPU ..." among its own output. The logger's
# filter survives DeepSpeed setting the logger up later; its other messages pass.
_logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to CPU" not in record.getMessage())
