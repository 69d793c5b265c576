"""The planner: predict memory per rank and step time of a model under each strategy, mesh,
micro batch and activation checkpointing on a described cluster, and rank them.

Library modules, no Hydra: ``cluster`` (the machines), ``model_facts`` (what a model needs:
FLOPs and activation bytes traced on the meta device), ``plan`` (one way to run, and a
published run's ``Framework``), ``cost`` (its prediction, with ``compute_cost``, ``moe_cost``,
``pipeline_cost`` and ``float8_cost`` for its parts), ``strategies`` (the registered
strategies, each built and asked why it refuses a plan), ``search`` (every plan for a world size
and global batch, pruned with reasons, ranked), ``calibrate`` (this machine's figures),
``trust`` (whether ``plan=auto`` may pick: the held-out study's interval) and the caches of
facts and timed profiles. The app asks it before launch (``plan=show|auto``, and each run's own
prediction); nothing of it runs on a rank.
"""
