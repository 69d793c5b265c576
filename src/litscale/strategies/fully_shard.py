"""FSDP2 (``fully_shard``) applied to a module from what it declares: its sharding units,
the roots that take the rest, the mixed-precision policy. What the one parallelize function
applies for the FSDP strategy, the tensor-parallel strategy's data dimension and each pipeline
stage (``shard_stage``) (torchtitan style: a reusable function, not a strategy)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from litscale.parallel.declarations import declared, name_matches
from litscale.precision import PrecisionDtypes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

NO_UNITS_WARNING = (
    "litscale FSDP: the model declares no sharding units, so it is sharded as one unit (all "
    "parameters are gathered at once, which saves no peak memory). Declare units with a "
    "`sharding_units(self) -> list[nn.Module]` method on the LightningModule or its `net` "
    "(e.g. returning the transformer blocks), or pass strategy.sharding_units=['net.blocks.*']"
)


def mixed_precision_policy(dtypes: PrecisionDtypes | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for the ``precision`` group: parameters are gathered in the compute
    dtype and gradients reduced in the reduce dtype; the sharded (optimizer-facing)
    parameters keep the storage dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtypes is None or (dtypes.compute == dtypes.param and dtypes.reduce == dtypes.param):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtypes.compute, reduce_dtype=dtypes.reduce)


def find_sharding_units(module: nn.Module, patterns: Sequence[str] | None = None) -> list[nn.Module]:
    """The submodules to shard one by one: from ``patterns`` if given, else what ``module``
    or its ``net`` declares as ``sharding_units``; ``[]`` (with a warning) if neither."""
    if patterns:
        units = [m for name, m in module.named_modules() if any(name_matches(name, p) for p in patterns)]
        if not units:
            raise ValueError(f"strategy.sharding_units={list(patterns)} matches no submodule of the model")
        return units
    found = declared(module, "sharding_units")
    if found is not None:
        return list(found[1])
    warnings.warn(NO_UNITS_WARNING, stacklevel=2)
    return []


def _roots(module: nn.Module) -> list[nn.Module]:
    """The modules whose forward runs each step and that own the remaining parameters: ``net``
    for litscale modules, else each direct child holding parameters (a LightningModule's own
    forward is not what Lightning calls, so it cannot be FSDP's root)."""
    net = getattr(module, "net", None)
    if isinstance(net, nn.Module) and not any(True for _ in module.parameters(recurse=False)):
        owned = {id(p) for p in net.parameters()}
        if all(id(p) in owned for p in module.parameters()):
            return [net]
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"{type(module).__name__} holds parameters directly; FSDP shards submodules, so move "
            "them into a submodule (e.g. self.net)")
    return [child for child in module.children() if any(True for _ in child.parameters())]


def fsdp_options(mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
                 cpu_offload: bool = False) -> dict[str, Any]:
    """``fully_shard`` keyword arguments shared by every FSDP group on ``mesh``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return {
        "mesh": mesh,
        "mp_policy": mp_policy or mixed_precision_policy(None),
        "offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload
        else OffloadPolicy(),
    }


def shard_units(units: Sequence[nn.Module], *, reshard_after_forward: bool,
                activation_checkpointing: bool = False, **options: Any) -> None:
    """Make each unit its own FSDP group (gathered just before its forward and, with
    ``reshard_after_forward``, freed after it: ZeRO-3; without, kept until backward: ZeRO-2).
    Activation checkpointing, applied per unit first, recomputes a unit's activations in backward."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        if activation_checkpointing:
            checkpoint(unit)  # composable: parameter names (and checkpoint keys) stay the same
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **options)


def keep_running_statistics_in_float32(module: nn.Module, *, reshard_after_forward: bool,
                                       **options: Any) -> None:
    """Under a 16-bit policy, each norm that keeps running statistics (BatchNorm) becomes its
    own FSDP group whose parameters stay float32, as its statistics do, and as a plain
    mixed-precision run keeps them (torch's batch norm takes a 16-bit input beside float32
    weights and statistics, not 16-bit weights beside float32 statistics). NOTE: found by the
    combination test: ``strategy=fsdp precision=bf16_mixed model=resnet`` failed its first
    forward ("expected scalar type BFloat16 but found Float"). FSDP1 left such norms out of its
    policy (``_module_classes_to_ignore_for_mixed_precision``); FSDP2 takes a policy per group."""
    import dataclasses

    import torch
    from torch.distributed.fsdp import fully_shard

    policy = options["mp_policy"]
    if policy.param_dtype in (None, torch.float32):
        return
    float32 = {**options, "mp_policy": dataclasses.replace(policy, param_dtype=None, output_dtype=None)}
    for norm in norms_with_running_statistics(module):
        fully_shard(norm, reshard_after_forward=reshard_after_forward, **float32)


def norms_with_running_statistics(module: nn.Module) -> list[nn.Module]:
    """The BatchNorm modules of ``module`` that keep running statistics in buffers."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def apply_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    units: Sequence[nn.Module] = (),
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
) -> None:
    """Shard ``module`` in place with FSDP2 on ``mesh`` (1D: shard; 2D: replicate x shard).

    Each of ``units`` becomes its own FSDP group (``shard_units``); the roots (``net``, or the
    children holding parameters) take the rest.
    """
    from torch.distributed.fsdp import fully_shard

    options = fsdp_options(mesh, mp_policy=mp_policy, cpu_offload=cpu_offload)
    keep_running_statistics_in_float32(module, reshard_after_forward=reshard_after_forward, **options)
    shard_units(units, reshard_after_forward=reshard_after_forward,
                activation_checkpointing=activation_checkpointing, **options)
    for root in _roots(module):
        # NOTE: a root is resharded after forward only when it is not the last to run; keeping
        # it gathered (False) avoids an all-gather at the start of backward, as torchtitan does.
        fully_shard(root, reshard_after_forward=False if units else reshard_after_forward, **options)


def shard_stage(stage: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool,
                mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """FSDP2 on a pipeline stage: its sharding units (GPT: its blocks), then the stage itself as
    the root for the rest. (Not ``apply_fsdp``: its roots are a LightningModule's children; a
    stage's root is the stage, which the schedule calls, and it is always kept gathered after
    forward, as the last module of the stage to run.)"""
    from torch.distributed.fsdp import fully_shard

    options = fsdp_options(mesh, mp_policy=mp_policy)
    shard_units(find_sharding_units(stage), reshard_after_forward=reshard_after_forward, **options)
    fully_shard(stage, reshard_after_forward=False, **options)
