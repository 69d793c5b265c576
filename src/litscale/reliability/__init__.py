"""Run modes that keep a run right or alive, whatever the strategy.

- ``determinism``: ``determinism=layout_invariant``, data-parallel layouts that train
  bit-identically (chunks of the global batch, gradients summed in one fixed tree).
- ``determinism_checks``: the layouts and networks that mode can hold to, checked before launch.
- ``replica_groups``: ``fault_tolerance=replicas``, replica groups that keep training when one
  dies (torchft), as HSDP's outer replicate axis.
"""
