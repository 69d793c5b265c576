"""The dtypes a ``precision/`` option stands for, as strategies that shard or cast need them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PrecisionDtypes:
    """Parameter storage, compute (autocast) and gradient-reduction dtypes."""

    param: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32

    @classmethod
    def from_names(cls, *, param_dtype: str, compute_dtype: str, reduce_dtype: str) -> PrecisionDtypes:
        return cls(_DTYPES[param_dtype], _DTYPES[compute_dtype], _DTYPES[reduce_dtype])


# precision=fp8 (``callbacks/float8.py``): layers left in bf16: the output head (its logits feed
# the loss directly; torchtitan keeps it high-precision too).
KEPT_IN_BF16 = ("lm_head", "head", "output")
# torch._scaled_mm needs both matmul dimensions divisible by 16.
FLOAT8_ALIGNMENT = 16


def converts_to_float8(module: nn.Module, name: str) -> bool:
    """Whether ``module`` (called ``name`` in the net) runs in float8 under precision=fp8."""
    return (isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in KEPT_IN_BF16
            and module.in_features % FLOAT8_ALIGNMENT == 0 and module.out_features % FLOAT8_ALIGNMENT == 0)


def float8_flops_per_token(net: nn.Module) -> float:
    """Training FLOPs per token (forward 2, backward 4 per weight) of the layers precision=fp8
    runs in float8: every token passes each of them (a mixture of experts' routed experts are
    grouped weights, not ``nn.Linear``, and stay in 16 bits)."""
    return 6.0 * sum(m.in_features * m.out_features for name, m in net.named_modules() if converts_to_float8(m, name))
