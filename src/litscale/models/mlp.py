"""A multilayer perceptron classifier over flattened inputs."""

from __future__ import annotations

import math

from torch import Tensor, nn

from litscale.constraints import Fraction, PositiveInt


class MLP(nn.Module):
    """``[B, *input_shape]`` -> class logits ``[B, num_classes]``."""

    def __init__(
        self,
        *,
        input_shape: list[PositiveInt],
        num_classes: PositiveInt,
        hidden_sizes: list[PositiveInt] = (256, 256),
        dropout: Fraction = 0.0,
    ) -> None:
        super().__init__()
        widths = [math.prod(input_shape), *hidden_sizes]
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(width_in, width_out), nn.ReLU(), nn.Dropout(dropout)]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.layers = nn.Sequential(*layers)

    def output_layers(self) -> list[str]:
        """The classifier layer (declared: an optimizer of matrices, Muon, leaves it to AdamW)."""
        return [f"layers.{len(self.layers) - 1}"]

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)
