"""A strategy's saving and loading, as one mixin every litscale strategy lists (after
``StrategyContract``, before its Lightning class): Lightning's ``save_checkpoint`` and
``load_checkpoint`` wrapped so that a save is complete or invisible, may be written in the
background, and a checkpoint of another layout or kind loads.

Set on a strategy by the run (``checkpoint.async_save``, ``checkpoint.publish``: the app's
build) or by a user's own script; asked of the strategy's contract: whether it shares the file
and sharded formats (``shares_checkpoint_formats``: DeepSpeed keeps its own) and whether each
rank holds only some layers (``splits_layers_over_ranks``: a pipeline's stages). What each
branch does is the checkpoint package's: ``atomic`` (publish), ``background`` (the writer),
``moves`` (between layouts), ``deepspeed`` (into and out of ZeRO).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from litscale.checkpoint.atomic import publish

if TYPE_CHECKING:
    from litscale.checkpoint.background import Fingerprint


class StrategyCheckpointing:
    """Mixin of every litscale strategy: its checkpoints written beside the old one and
    published once every rank has written (``checkpoint.atomic``), in the background with
    ``async_save`` (``checkpoint.background``), and read back from any layout
    (``checkpoint.moves``, ``checkpoint.deepspeed``)."""

    # Set by the run from ``checkpoint.async_save`` (or by a user's own script): saves written
    # in the background (``litscale.checkpoint.background``) from the strategy's first save on.
    async_save: bool = False
    checkpoint_writer: Any = None
    # Set by the run from ``checkpoint.publish``: how a sharded save is made visible, by a rename
    # or by a pointer file (object-store mounts), ``auto`` by the mount (``litscale.checkpoint.atomic``).
    checkpoint_publish: str = "auto"

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """The strategy's own save, written beside the old checkpoint and made visible once every
        rank has written its part: a checkpoint is complete or invisible
        (``litscale.checkpoint.atomic``, by a rename or a pointer: ``checkpoint_publish``); with
        ``async_save``, written in the background."""
        from litscale.checkpoint.atomic import publishes_by_pointer, remove, saving_path
        from litscale.checkpoint.moves import OPTIMIZER_PARAM_NAMES, param_names_by_group

        by_pointer = self.is_global_zero and publishes_by_pointer(str(filepath), self.checkpoint_publish)
        # the one path rank 0 chose, and where its save is written
        path, staging, by_pointer = self.broadcast(
            (str(filepath), saving_path(str(filepath), by_pointer=by_pointer), by_pointer))
        names = param_names_by_group(self.lightning_module, self.optimizers) if self.optimizers else None
        if names is not None:  # what lets the checkpoint move to a layout of the other kind
            checkpoint[OPTIMIZER_PARAM_NAMES] = names
        if self.async_save and self.checkpoint_writer is None:
            from litscale.checkpoint.background import CheckpointWriter

            self.checkpoint_writer = CheckpointWriter()
        if self.checkpoint_writer is not None:
            from litscale.checkpoint.background import fingerprint

            now = fingerprint(checkpoint)  # before a sharded save takes the state out of it
            if self._save_again_in_background(checkpoint, now, staging, path, by_pointer, storage_options):
                return
            self.checkpoint_writer.wait()  # the save before this one, published
        if self.is_global_zero:
            remove(staging)  # what a save cut short left
        self.barrier("litscale checkpoint staged")
        if self.checkpoint_writer is not None:
            self._save_in_background(checkpoint, now, staging, path, by_pointer, storage_options)
            return
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier("litscale checkpoint written")
        if self.is_global_zero:
            publish(staging, path, by_pointer=by_pointer)
        self.barrier("litscale checkpoint published")

    def _save_again_in_background(self, checkpoint: dict[str, Any], now: Fingerprint | None, staging: str,
                                  path: str, by_pointer: bool, storage_options: Any) -> bool:
        """A second save of the last save's state (``ModelCheckpoint``'s ``last.ckpt`` after its
        top-k file, at one validation), published from the last save's bytes: nothing copied,
        nothing waited for (``litscale.checkpoint.background``). False, and nothing done, otherwise."""
        from litscale.checkpoint import background

        writer = self.checkpoint_writer
        last = writer.holding(now)
        if not self.reduce_boolean_decision(last is not None, all=True):  # every rank, or none
            return False
        if self.is_global_zero:
            writer.submit(background.save_again(
                last, now, checkpoint, staging=staging, path=path, by_pointer=by_pointer,
                write_file=lambda copied, where: self.checkpoint_io.save_checkpoint(
                    copied, where, storage_options=storage_options)))
        writer.last = background.LastSave(fingerprint=now, path=path, copied_state=last.copied_state)
        return True

    def _save_in_background(self, checkpoint: dict[str, Any], now: Fingerprint | None, staging: str, path: str,
                            by_pointer: bool, storage_options: Any) -> None:
        from litscale.checkpoint import background

        writer = self.checkpoint_writer
        copied_state = None
        if self.saves_shards:
            complete = background.start_directory_save(checkpoint, staging, writer=writer,
                                                       is_global_zero=self.is_global_zero)

            def finish() -> None:
                complete()
                if self.is_global_zero:
                    publish(staging, path, by_pointer=by_pointer)
        elif self.is_global_zero:
            copied = writer.snapshot(checkpoint)
            copied_state = {key: copied[key] for key in background.STATE_KEYS if key in copied}

            def finish() -> None:
                self.checkpoint_io.save_checkpoint(copied, staging, storage_options=storage_options)
                publish(staging, path, by_pointer=by_pointer)
        else:
            finish = None  # rank 0 writes the file
        if finish is not None:
            writer.submit(finish)
        writer.last = None if now is None else background.LastSave(fingerprint=now, path=path,
                                                                   copied_state=copied_state)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's removal of an old checkpoint (a pointer with the save only it named);
        behind the saves in flight, so the old one goes only once the new one is published."""
        from litscale.checkpoint.atomic import pointer_target, remove_published

        def removal() -> None:
            if self.is_global_zero and pointer_target(str(filepath)) is not None:
                remove_published(str(filepath))
            else:
                super(StrategyCheckpointing, self).remove_checkpoint(filepath)

        if self.checkpoint_writer is None:
            removal()
        else:
            self.checkpoint_writer.forget(str(filepath))
            self.checkpoint_writer.submit(removal)

    @property
    def checkpoint_io(self) -> Any:
        """Lightning's ``Strategy.checkpoint_io`` with litscale's ``FileCheckpointIO`` where the
        user gave none (under a wrapping one of theirs too): it writes straight to the staging
        path, which the publish makes atomic, and loads memory-mapped (``litscale.checkpoint.file_io``)."""
        from litscale.checkpoint.file_io import FileCheckpointIO
        from litscale.lightning_private import WrappingCheckpointIO

        if self._checkpoint_io is None:
            self._checkpoint_io = FileCheckpointIO()
        elif isinstance(self._checkpoint_io, WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = FileCheckpointIO()  # kept where the user set one
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    def teardown(self) -> None:
        writer, self.checkpoint_writer = self.checkpoint_writer, None
        if writer is not None:
            writer.close()  # the last save is written and published before the run ends
        super().teardown()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The strategy's own load, or a checkpoint of the other kind moved onto this layout
        (``litscale.checkpoint.moves``): a file into a sharded model, a sharded directory into a
        replicated one, a DeepSpeed directory into either; into DeepSpeed, anything its own
        loader cannot read, read whole and written into its engine; a sharded directory into a
        pipeline's stages, each stage its own layers."""
        from litscale.checkpoint import moves
        from litscale.checkpoint.deepspeed import deepspeed_as_file_checkpoint, moved_into_zero
        from litscale.checkpoint.reading import DCP_METADATA, is_deepspeed_checkpoint

        path = str(self.broadcast(str(checkpoint_path)))
        if not self.shares_checkpoint_formats:  # DeepSpeed ZeRO: its own directory, or one moved into it
            moved = moved_into_zero(path, self)
            return moved if moved is not None else super().load_checkpoint(checkpoint_path, weights_only)
        whole = None
        if is_deepspeed_checkpoint(path):
            # DeepSpeed's own directory under another strategy, read as a file (DeepSpeed loads its own)
            whole = deepspeed_as_file_checkpoint(path)
            if not self.saves_shards:
                return whole
        if self.saves_shards and (whole is not None or os.path.isfile(path)):
            return moves.load_file_into_sharded(path if whole is None else whole, self.model, self.optimizers,
                                                strict=self.lightning_module.strict_loading)
        if not self.saves_shards and os.path.isfile(os.path.join(path, DCP_METADATA)):
            return moves.directory_as_file_checkpoint(path)
        if self.splits_layers_over_ranks:  # a pipeline's stages: Lightning's loader wants DTensors
            return moves.load_directory_into_stages(path, self.model, self.optimizers, weights_only=weights_only,
                                                    strict=self.lightning_module.strict_loading)
        return super().load_checkpoint(checkpoint_path, weights_only)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        from litscale.checkpoint.moves import optimizer_states_by_position

        super().load_optimizer_state_dict(
            optimizer_states_by_position(checkpoint, self.lightning_module, self.optimizers))

    @property
    def saves_shards(self) -> bool:
        """Saves a ``torch.distributed.checkpoint`` directory (else one file, or DeepSpeed's own)."""
        return bool(getattr(self, "_save_distributed_checkpoint", False))
