"""Lightning Strategy subclasses, usable in any Lightning script.

Importing this package registers each under a ``litscale_*`` name in Lightning's
``StrategyRegistry``, so ``Trainer(strategy="litscale_ddp")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from litscale.strategies.ddp import DDPStrategy
from litscale.strategies.single import SingleStrategy

__all__ = ["DDPStrategy", "SingleStrategy"]

_REGISTRATIONS = {
    "litscale_single": (SingleStrategy, "one process, one device"),
    "litscale_ddp": (DDPStrategy, "DDP with comm hooks on every backend and a clean exit"),
}
for _name, (_cls, _description) in _REGISTRATIONS.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _cls, description=_description)
