"""litscale: config-driven distributed training on Hydra and PyTorch Lightning.

The library pieces (strategies, compression hooks, LR-scaling rules, callbacks) import
without Hydra; ``litscale.app.run`` is the Hydra-facing entry that composes them.
"""

__version__ = "0.1.0"
