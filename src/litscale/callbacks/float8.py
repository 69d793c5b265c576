"""``precision=fp8``: the network's Linear layers computed in float8 by torchao's float8
training (dynamic scaling, a tensorwise or rowwise recipe), as torchtitan does.

torchao swaps each ``nn.Linear`` for a ``Float8Linear`` whose weight is the same fp32
parameter (checkpoints keep their keys); the matmuls cast their inputs to float8 with scales
computed on the fly. The swap must happen before ``torch.compile`` and before a strategy
shards the net, so it runs in ``setup``, which Lightning calls before ``configure_model``.
"""

from __future__ import annotations

from typing import Literal

from lightning.pytorch import Callback, LightningModule, Trainer

from litscale.precision import converts_to_float8


class Float8Training(Callback):
    """Converts ``pl_module.net`` to float8 training once, before the strategy sees it."""

    def __init__(self, recipe: Literal["tensorwise", "rowwise"] = "tensorwise") -> None:
        self.recipe = recipe
        self.converted: list[str] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.converted:
            return
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        net = pl_module.net
        self.converted = [name for name, module in net.named_modules() if converts_to_float8(module, name)]
        convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(self.recipe),
                                   module_filter_fn=converts_to_float8)
