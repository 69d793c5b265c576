"""A small ResNet (He et al. 2016, basic blocks) for small images such as 8x8 digits."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from litscale.constraints import PositiveInt


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """``[B, C, H, W]`` -> class logits; each stage after the first halves the resolution."""

    output_layers = ("head",)  # the classifier, which an optimizer of matrices (Muon) leaves to AdamW

    def __init__(
        self,
        *,
        input_shape: list[PositiveInt],
        num_classes: PositiveInt,
        widths: list[PositiveInt] = (32, 64),
        blocks_per_stage: PositiveInt = 2,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(input_shape[0], widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        stages, channels = [], widths[0]
        for index, width in enumerate(widths):
            for block in range(blocks_per_stage):
                stride = 2 if index > 0 and block == 0 else 1
                stages.append(BasicBlock(channels, width, stride))
                channels = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))
