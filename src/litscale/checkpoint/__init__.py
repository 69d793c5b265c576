"""Checkpoints: what a run resumes, how a save becomes visible, and how one moves between
layouts, strategies and formats.

- ``resume``: what ``ckpt_path`` names (``last``, ``auto``, a path), resolved before launch.
- ``reading``: a checkpoint's files read without running code (weights-only, DCP's metadata,
  DeepSpeed's files), below every other module here.
- ``atomic``: a save is complete or invisible (a rename, or a pointer file on object stores).
- ``background``: saves written while training goes on (``checkpoint.async_save``).
- ``moves``: a checkpoint of one layout loaded onto another (files, sharded directories, stages).
- ``deepspeed``: DeepSpeed ZeRO checkpoints read whole, and others written into a ZeRO engine.
- ``strategy_checkpointing``: the strategies' saving and loading, one mixin every strategy lists.
- ``export``: one consolidated ``model.pt`` (and a Hugging Face directory) from any strategy.
"""
