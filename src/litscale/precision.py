"""The dtypes a ``precision/`` option stands for, as strategies that shard or cast need them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
