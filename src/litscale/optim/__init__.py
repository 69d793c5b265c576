"""Optimizers and what sets their learning rate, for every strategy.

- ``layerwise``: LARS and LAMB, each tensor's step scaled by its trust ratio.
- ``muon``: Muon, orthogonalised updates for the hidden matrices (AdamW for the rest).
- ``mup``: µP, the learning rates and init that transfer across width.
- ``lr_scaling``: the learning rate from the effective global batch (linear, square root).
- ``schedulers``: warmup and decay schedules.
- ``parameter_steps``: what litscale's own optimizers share (a step per parameter, betas).
"""
