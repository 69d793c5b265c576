"""Value constraints written into constructor annotations.

Every ``_target_`` in ``conf/`` is a typed keyword-only constructor, and its signature is the
schema the config validator checks before any process starts. ``Annotated`` metadata from
this module adds ranges to those types, so a bound is written once, beside the argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated


@dataclass(frozen=True)
class Range:
    """Inclusive bounds (``None`` = unbounded); ``exclusive_min`` makes the lower bound strict."""

    min: float | None = None
    max: float | None = None
    exclusive_min: bool = False

    def allows(self, value: float) -> bool:
        if self.min is not None:
            if value < self.min or (self.exclusive_min and value == self.min):
                return False
        return self.max is None or value <= self.max

    def describe(self) -> str:
        parts = []
        if self.min is not None:
            parts.append(f"{'>' if self.exclusive_min else '>='} {self.min:g}")
        if self.max is not None:
            parts.append(f"<= {self.max:g}")
        return " and ".join(parts)


PositiveInt = Annotated[int, Range(min=1)]
NonNegativeInt = Annotated[int, Range(min=0)]
PositiveFloat = Annotated[float, Range(min=0, exclusive_min=True)]
NonNegativeFloat = Annotated[float, Range(min=0)]
Fraction = Annotated[float, Range(min=0, max=1)]
