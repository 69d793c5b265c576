"""litscale: config-driven distributed training on Hydra and PyTorch Lightning.

The library pieces (strategies, compression hooks, LR-scaling rules, callbacks) import
without Hydra; ``litscale.app.run`` is the Hydra-facing entry that composes them.
"""

import os

from litscale.torchmetrics_backends import SKIP_ENV, skip_torchmetrics_backends

__version__ = "0.1.0"

# train.py and the processes it starts (ranks) set this: the torchmetrics that Lightning imports
# next then skips transformers and scipy, about 3 s of every process's start (see the module).
if os.environ.get(SKIP_ENV) == "1":
    skip_torchmetrics_backends()
