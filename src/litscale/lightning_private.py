"""Lightning's private names that litscale relies on, imported here and nowhere else.

Lightning may rename or remove a private name in any release. Importing each one at module
level, in this one module, makes such an upgrade fail loudly at import (and in
``tests/test_lightning_private.py``) instead of in the middle of a run, and shows in one
screen what would have to be rewritten. Each is re-exported under a public name, with a line
saying what litscale uses it for.

Private *methods* that litscale overrides or calls on Lightning's own classes (e.g.
``DDPStrategy._register_ddp_hooks``, ``ModelParallelStrategy._setup_distributed``) are not
imports and stay where they are used, each with a comment.
"""

from __future__ import annotations

from lightning.fabric.strategies.model_parallel import (
           _METADATA_FILENAME,
           _distributed_checkpoint_load,
)
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

__all__ = ["CHECKPOINT_METADATA_FILENAME", "WrappingCheckpointIO", "distributed_checkpoint_load",
           "materialize_distributed_module", "optimizers_to_device"]

CHECKPOINT_METADATA_FILENAME: str = _METADATA_FILENAME
"""Name of the file (``meta.pt``) beside the DCP shards of a sharded checkpoint that holds the
non-tensor state; the pipeline strategy's per-stage loader reads it."""

distributed_checkpoint_load = _distributed_checkpoint_load
"""Loads a DCP directory into a state dict in place; the pipeline strategy's per-stage loader
uses it for the parameters and the optimizer state of this rank's stages."""

materialize_distributed_module = _materialize_distributed_module
"""Allocates and initialises parameters left on the meta device, after FSDP has sharded them
(the FSDP strategy's setup)."""

optimizers_to_device = _optimizers_to_device
"""Moves optimizer state tensors to the root device at the end of a mesh strategy's setup."""

WrappingCheckpointIO = _WrappingCheckpointIO
"""The base of a ``CheckpointIO`` that wraps another (Lightning's ``AsyncCheckpointIO``): the
strategies put litscale's file ``CheckpointIO`` inside one a user set
(``litscale.checkpoint.strategy_checkpointing``)."""
