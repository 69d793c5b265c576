"""litscale's strategies, built inside a rank.

Module-level factories (alone or in ``functools.partial``) pickle into spawned ranks, and
import the strategies only there: the test process never pays for DeepSpeed's import.
"""

from __future__ import annotations


def ddp(**options):
    from litscale.strategies import DDPStrategy

    return DDPStrategy(**options)


def fsdp(**options):
    from litscale.strategies import FSDPStrategy

    return FSDPStrategy(**options)


def zero(stage: int, **options):
    """DeepSpeed ZeRO at ``stage`` (1, 2 or 3)."""
    from litscale.strategies import DeepSpeedZeroStrategy

    return DeepSpeedZeroStrategy(stage=stage, **options)


def ddp_compressed(method: str, **options):
    """DDP with the gradient-compression hook ``litscale.compression.<method>(**options)``."""
    from litscale import compression
    from litscale.strategies import DDPStrategy

    return DDPStrategy(compression=getattr(compression, method)(**options))


def local_sgd(**options):
    from litscale.strategies import LocalSGDStrategy

    return LocalSGDStrategy(**options)


def federated(**options):
    from litscale.strategies import FederatedStrategy

    return FederatedStrategy(**options)


def tensor_parallel(**options):
    from litscale.strategies import TensorParallelStrategy

    return TensorParallelStrategy(**options)


def pipeline(**options):
    from litscale.strategies import PipelineParallelStrategy

    return PipelineParallelStrategy(**options)


def single(**options):
    from litscale.strategies.single import SingleStrategy

    return SingleStrategy(**options)
