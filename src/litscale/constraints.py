"""Value ranges written into constructor annotations.

Every ``_target_`` in ``conf/`` is a typed keyword-only constructor, and its signature is the
schema that ``litscale.arguments`` checks (with pydantic) before any process starts. The
``annotated_types`` bounds below add ranges to those types, so a bound is written once,
beside the argument.
"""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge, Gt, Interval

PositiveInt = Annotated[int, Ge(1)]
AtLeastTwo = Annotated[int, Ge(2)]  # replica groups: one group is no redundancy
NonNegativeInt = Annotated[int, Ge(0)]
PositiveFloat = Annotated[float, Gt(0)]
NonNegativeFloat = Annotated[float, Ge(0)]
AtLeastOne = Annotated[float, Ge(1)]  # a ratio of the most to the mean
Fraction = Annotated[float, Interval(ge=0, le=1)]
# A share that cannot be all or nothing: a held-out split, a top-k ratio's open end.
OpenFraction = Annotated[float, Interval(gt=0, lt=1)]
