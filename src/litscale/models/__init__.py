"""The model zoo: plain single-device ``nn.Module``s, one file per family, each with its
declarations for the strategies beside it (``<family>_parallel``: sharding units, the
tensor-parallel plan, the blocks a pipeline cuts between); Hugging Face models read
(``hf``, ``hf_reading``) and written back (``hf_writing``)."""

from litscale.models.gpt import GPT, PRESETS, GPTConfig, build_gpt
from litscale.models.mlp import MLP
from litscale.models.resnet import ResNet

__all__ = ["GPT", "GPTConfig", "MLP", "PRESETS", "ResNet", "build_gpt"]
