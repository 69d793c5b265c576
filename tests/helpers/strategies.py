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
