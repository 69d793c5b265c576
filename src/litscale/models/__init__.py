"""The model zoo: plain single-device ``nn.Module``s, one file per family."""

from litscale.models.gpt import GPT, PRESETS, GPTConfig, build_gpt
from litscale.models.mlp import MLP
from litscale.models.resnet import ResNet

__all__ = ["GPT", "GPTConfig", "MLP", "PRESETS", "ResNet", "build_gpt"]
