"""The keys of ``conf/`` that are not constructor arguments (the top level, the precision
group, ``scaling``, ``launcher``, ``preflight``, ``plan``), described as dataclasses whose
annotations ``litscale.app.checks.validation`` checks a composed config against; a key that makes
litscale import an optional package is named in the schema's ``requires_when``
(``litscale.extras``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from litscale.constraints import AtLeastOne, NonNegativeInt, PositiveFloat, PositiveInt
from litscale.extras import TORCHAO, TRANSFORMERS


@dataclass
class RunSchema:
    """Top-level keys of ``conf/train.yaml`` that are not groups."""

    name: str
    seed: int
    ckpt_path: str | None
    allowed_targets: list[str]
    export_hf: bool
    elastic: bool = False  # the data-parallel count may change between the job's starts on its own

    requires_when = {"export_hf": TRANSFORMERS}  # litscale.models.hf_writing writes through transformers


@dataclass
class PrecisionSchema:
    """A ``precision/`` option: the Lightning precision and the dtypes strategies derive from it."""

    lightning: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
    param_dtype: Literal["float32", "bfloat16", "float16"]
    compute_dtype: Literal["float32", "bfloat16", "float16"]
    reduce_dtype: Literal["float32", "bfloat16", "float16"]
    float8: Literal["tensorwise", "rowwise"] | None = None

    requires_when = {"float8": TORCHAO}  # torchao's float8 training (litscale.callbacks.float8)


@dataclass
class ScalingSchema:
    """``scaling.*``: the 1-device baseline, and a fixed global batch for strong scaling."""

    baseline: str | None
    global_batch: PositiveInt | None


@dataclass
class LauncherSchema:
    """``launcher.*``: how litscale starts a run's ranks on this machine."""

    oversubscribe: bool  # cpu: more gloo ranks than cores, one thread each


@dataclass
class CheckpointSchema:
    """``checkpoint.*``: how the strategy writes checkpoints."""

    async_save: bool  # written in the background (litscale.checkpoint.background); the step pays for one copy
    # how a sharded save is made visible (litscale.checkpoint.atomic): by a rename, by a pointer
    # file (object-store mounts, where a directory's rename is not atomic), auto: by the mount
    publish: Literal["auto", "rename", "pointer"] = "auto"


@dataclass
class PreflightSchema:
    """``preflight.*``: checks before any rank starts."""

    collectives: bool  # each rank's first step traced on a fake process group, compared across ranks


@dataclass
class PlanSchema:
    """``plan/``: train as configured, or print (``show``) / also write (``auto``) the
    planner's ranking instead."""

    mode: Literal["none", "show", "auto"]
    top: PositiveInt
    verify: NonNegativeInt  # run the top k as short jobs here; print predicted vs measured
    verify_steps: PositiveInt
    predict_run: bool  # an ordinary run's summary: the planner's prediction from what plan=show timed
    moe_load_imbalance: AtLeastOne = 1.0  # expert parallel's busiest rank over an even split
    moe_load_from: str | None = None  # a run's summary.json, whose moe/tokens_per_expert measure it
    calibrate_from: str | list[str] | None = None  # run dirs or sweep dirs: the cluster's constants refit from their steps


@dataclass
class OptimizerSchema:
    """What every ``optimizer/`` option shares; the rest is checked against its ``_target_``."""

    lr: PositiveFloat
