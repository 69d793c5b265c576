"""litscale: config-driven distributed training on Hydra and PyTorch Lightning.

The root is a face: a few small modules every floor may use (``errors``, ``arguments``,
``constraints``, ``precision``, ``extras``, ``user_paths``, ``lightning_private``,
``torchmetrics_backends``, ``loggers``), the LightningModules (``modules``, on the
strategies' floor) and ``python -m litscale.doctor`` (on the app's). Each concern is a package, on floors an import only goes down
(``tests/test_layering.py``): ``measure``, ``health`` -> ``parallel``, ``models``,
``compression`` -> ``data``, ``optim`` -> ``reliability``, ``checkpoint`` -> ``strategies``,
``callbacks`` -> ``planner`` -> ``app``. Everything below ``app`` imports without Hydra;
``litscale.app.run`` is the Hydra-facing entry that composes it.
"""

import os

from litscale.torchmetrics_backends import SKIP_ENV, skip_torchmetrics_backends

__version__ = "0.1.0"

# train.py and the processes it starts (ranks) set this: the torchmetrics that Lightning imports
# next then skips transformers and scipy, about 3 s of every process's start (see the module).
if os.environ.get(SKIP_ENV) == "1":
    skip_torchmetrics_backends()
