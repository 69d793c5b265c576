"""litscale's Muon under DeepSpeed ZeRO stages 1-2, stepped by DeepSpeed's own ZeRO Muon.

ZeRO flattens each param group into one buffer and hands the optimizer its rank's partition:
no matrix is left to orthogonalise. DeepSpeed's ZeRO-1/2 optimizer knows Muon
(``deepspeed/runtime/zero/muon``): for the parameters flagged ``use_muon`` it all-reduces a
matrix that straddles a partition boundary to every rank owning a part of it, keeps the
momentum of every matrix its partition touches, orthogonalises the whole matrix and keeps its
partition's slice; ``MuonWithAuxAdam`` then applies the decay and the step, and AdamW to the
rest. Written by hand here is only the mapping of litscale's Muon onto it, so that a run steps
what one process steps (``tests/test_parity.py``, the ``zero`` family):

- **the update's scale**: DeepSpeed scales by ``sqrt(max(1, rows / cols))`` (litscale's
  ``adjust_lr=original``). For ``match_rms_adamw`` the matrices are grouped by shape, each
  group's lr (and ``lr_multiplier``, as µP's groups keep theirs) multiplied by the ratio of the
  two scales and its weight decay divided by it: the step is litscale's, and ``W (1 - lr wd)``
  is unchanged;
- **Newton-Schulz's dtype**: DeepSpeed picks it from its method and the accelerator
  (``ns_compute_dtype``): on a CPU, ``gram`` runs in float32 and ``standard`` in bfloat16; on a
  GPU, float16 and bfloat16. The method whose dtype is ``ns_dtype`` is chosen, and a dtype
  neither gives is refused before any rank starts (``why_not_muon``);
- **the schedule**: litscale's schedules are ``LambdaLR``s of the optimizer they were built
  on; the same multiplier is rebuilt on DeepSpeed's optimizer.

What DeepSpeed's ZeRO Muon does not do is refused in one line before any rank starts: ZeRO-3
(``DeepSpeedZeroStrategy.why_not``), and (``why_not_muon``) a Muon without Nesterov or with
other than 5 Newton-Schulz steps, and gradient clipping (it clips by the norm of its
orthogonalised updates, not of the gradients).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from litscale.optim.muon import MATRIX, Muon, state_bytes_per_param
from litscale.parallel.contract import SettingRefusal

# DeepSpeed's ZeRO Muon calls its update with these (``muon_update``'s defaults).
DEEPSPEED_NS_STEPS = 5
DEEPSPEED_NESTEROV = True
# The dtypes each Newton-Schulz method of DeepSpeed runs in, on a CPU and on a GPU
# (``deepspeed.runtime.zero.muon.original_muon.ns_compute_dtype``, read again once the ranks
# start, by ``ns_method_for``): what the pre-flight check allows without importing DeepSpeed.
NS_DTYPES_ON = {"cpu": ("float32", "bfloat16"), "gpu": ("bfloat16",)}


# What the compatibility page says a yes needs (``why_not_muon`` checks each).
MUON_CONDITIONS = ("Muon is stepped by DeepSpeed's ZeRO Muon, which takes trainer.gradient_clip_val=null, "
                   f"optimizer.nesterov=true, optimizer.ns_steps={DEEPSPEED_NS_STEPS} and, on a GPU, "
                   "optimizer.ns_dtype=bfloat16 (each other value is refused in one line)")


def muon_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Muon's keyword arguments as a run builds it: the config's ``optimizer.<key>`` values over
    the constructor's defaults."""
    defaults = {name: parameter.default for name, parameter in inspect.signature(Muon.__init__).parameters.items()
                if parameter.default is not inspect.Parameter.empty}
    return {**defaults, **{key.removeprefix("optimizer."): value for key, value in settings.items()
                           if key.startswith("optimizer.")}}


def why_not_muon(settings: Mapping[str, Any]) -> SettingRefusal | None:
    """The setting (``optimizer.<key>``, ``trainer.gradient_clip_val``, ``trainer.accelerator``)
    that DeepSpeed's ZeRO Muon cannot step as litscale's Muon does; ``None`` if none."""
    muon = muon_settings(settings)
    clip = settings.get("trainer.gradient_clip_val")
    accelerator = "cpu" if settings.get("trainer.accelerator") == "cpu" else "gpu"
    if clip:
        return SettingRefusal("trainer.gradient_clip_val", clip, "DeepSpeed's ZeRO Muon clips by the norm of its "
                              "orthogonalised updates, not of the gradients one process clips", "trainer.gradient_clip_val=null")
    if muon["nesterov"] is not DEEPSPEED_NESTEROV:
        return SettingRefusal("optimizer.nesterov", muon["nesterov"], "DeepSpeed's ZeRO Muon steps Nesterov's momentum",
                              "optimizer.nesterov=true")
    if muon["ns_steps"] != DEEPSPEED_NS_STEPS:
        return SettingRefusal("optimizer.ns_steps", muon["ns_steps"], f"DeepSpeed's ZeRO Muon runs {DEEPSPEED_NS_STEPS} "
                              "Newton-Schulz steps", f"optimizer.ns_steps={DEEPSPEED_NS_STEPS}")
    if muon["ns_dtype"] not in NS_DTYPES_ON[accelerator]:
        allowed = " or ".join(NS_DTYPES_ON[accelerator])
        return SettingRefusal("optimizer.ns_dtype", muon["ns_dtype"], f"on a {accelerator.upper()} DeepSpeed's ZeRO "
                              f"Muon runs Newton-Schulz in {allowed}", f"optimizer.ns_dtype={allowed}")
    return None


def ns_method_for(dtype_name: str) -> str:
    """DeepSpeed's Newton-Schulz method that runs in ``dtype_name`` on this accelerator."""
    from deepspeed.runtime.zero.muon.original_muon import NS_METHODS, ns_compute_dtype

    for method in sorted(NS_METHODS):
        if ns_compute_dtype(method) == getattr(torch, dtype_name):
            return method
    raise ValueError(f"optimizer.ns_dtype={dtype_name}: DeepSpeed's ZeRO Muon has no Newton-Schulz method in "
                     f"{dtype_name} on this accelerator (methods: {', '.join(sorted(NS_METHODS))})")


def scale_ratio(shape: torch.Size, adjust_lr: str) -> float:
    """litscale's scale of a matrix's update over DeepSpeed's (``sqrt(max(1, rows / cols))``)."""
    if adjust_lr == "original":
        return 1.0
    rows, cols = shape[-2:]
    return 0.2 * math.sqrt(max(rows, cols)) / math.sqrt(max(1.0, rows / cols))


def deepspeed_groups(optimizer: Muon, ns_method: str) -> list[dict]:
    """The param groups of DeepSpeed's ``MuonWithAuxAdam`` that step what ``optimizer`` steps,
    each parameter flagged as DeepSpeed's ZeRO optimizer reads it (``use_muon``,
    ``is_expert_group``)."""
    groups = []
    for group in optimizer.param_groups:
        settings = {key: value for key, value in group.items() if key != "params"}
        if group["role"] != MATRIX:
            for param in group["params"]:
                param.use_muon = False
            groups.append({**settings, "params": list(group["params"]), "use_muon": False})
            continue
        by_ratio: dict[float, list[torch.nn.Parameter]] = {}
        for param in group["params"]:
            param.use_muon, param.is_expert_group = True, param.dim() == 3
            by_ratio.setdefault(scale_ratio(param.shape, group["adjust_lr"]), []).append(param)
        for ratio, params in by_ratio.items():
            # lr_multiplier: what the rule's lr is multiplied by in this group (as µP's groups
            # say), read when a resumed run rescales its schedule to the rule's lr.
            scaled = {key: settings.get(key, 1.0) * ratio for key in ("lr", "initial_lr", "lr_multiplier")
                      if key in settings or key == "lr_multiplier"}
            groups.append({**settings, **scaled, "params": params, "use_muon": True, "ns_method": ns_method,
                           "weight_decay": settings["weight_decay"] / ratio})
    return groups


def deepspeed_muon(optimizer: Muon, scheduler: Any) -> tuple[torch.optim.Optimizer, Any]:
    """DeepSpeed's ``MuonWithAuxAdam`` stepping what ``optimizer`` steps, and ``scheduler``
    (a ``LambdaLR`` of ``optimizer``, or None) rebuilt on it."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    method = ns_method_for(optimizer.defaults["ns_dtype"])
    replacement = MuonWithAuxAdam(deepspeed_groups(optimizer, method))
    # What the memory estimate reads (``callbacks.memory``): Muon's state, by the groups' roles,
    # not the AdamW's its class name would suggest.
    replacement.state_bytes_per_param = lambda: state_bytes_per_param(replacement.param_groups)
    matrix_groups = sum(group["use_muon"] for group in replacement.param_groups)
    rank_zero_info(f"litscale: muon stepped by DeepSpeed's ZeRO optimizer: Newton-Schulz '{method}' in "
                   f"{optimizer.defaults['ns_dtype']}, the matrices in {matrix_groups} group(s) by the scale of their update")
    return replacement, rebuilt_schedule(scheduler, replacement)


def rebuilt_schedule(scheduler: Any, optimizer: torch.optim.Optimizer) -> LambdaLR | None:
    """``scheduler``'s multiplier on ``optimizer``, whose groups already hold its initial lrs."""
    if scheduler is None:
        return None
    multipliers = getattr(scheduler, "lr_lambdas", None)
    if not isinstance(scheduler, LambdaLR) or any(m is not multipliers[0] for m in multipliers):
        raise ValueError(f"optimizer=muon under strategy=deepspeed_zero takes a schedule of one LambdaLR multiplier "
                         f"(litscale's scheduler group), not {type(scheduler).__name__}")
    return LambdaLR(optimizer, multipliers[0])
