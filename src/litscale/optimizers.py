"""Large-batch optimizers: LARS (You et al. 2017) and LAMB (You et al. 2019).

Both adapt each weight tensor's step to ``||w|| / ||update||`` (the layer-wise trust ratio).
As in the papers, biases and normalisation gains (the 1-D tensors, which litscale's modules
also put in the weight-decay-free param group) take plain, unadapted steps.

- ``LARS`` is a typed front for ``pytorch_optimizer.LARS``, which matches Algorithm 1 of the
  LARS paper: local LR = trust_coefficient x ||w|| / (||g|| + weight_decay x ||w||) on tensors
  of 2+ dimensions, momentum on the scaled gradient (with the global LR applied after the
  momentum buffer, the PyTorch SGD convention; identical to the paper at a constant LR).
- ``LAMB`` is written here: ``pytorch_optimizer.Lamb`` drops Adam's bias correction and
  applies the trust ratio to every tensor, biases and norms included, which departs from
  Algorithm 2 of the LAMB paper.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytorch_optimizer  # ~1 s to import; this module loads only when lars/lamb is chosen
import torch

from litscale.constraints import Fraction, NonNegativeFloat, PositiveFloat
from litscale.parameter_steps import ParameterwiseOptimizer, check_betas


class LARS(pytorch_optimizer.LARS):
    """LARS (SGD + momentum with a layer-wise trust ratio), ``pytorch_optimizer``'s, with a
    typed keyword-only signature so configs are checked before a run starts.

    ``weight_decay`` is the default for param groups that do not set their own (litscale's
    modules set it per group: ``model.weight_decay`` on matrices, 0 on 1-D tensors).
    """

    adapts_each_tensor = True  # the trust ratio takes each tensor's norms (litscale.muon.adapts_each_tensor)

    def __init__(
        self,
        params: Iterable,
        *,
        lr: PositiveFloat,
        momentum: Fraction = 0.9,
        weight_decay: NonNegativeFloat = 0.0,
        trust_coefficient: PositiveFloat = 1.0e-3,
        nesterov: bool = False,
    ) -> None:
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         trust_coefficient=trust_coefficient, nesterov=nesterov)

    def _can_use_foreach(self, group: dict) -> bool:
        # NOTE: the batched path calls torch._foreach_copy_, which DTensor has no sharding rule
        # for (FSDP2 and tensor parallel crashed in their first step); the per-tensor path takes
        # DTensors, their norms reduced over the mesh by DTensor itself.
        from torch.distributed.tensor import DTensor

        return not any(isinstance(p, DTensor) for p in group["params"]) and super()._can_use_foreach(group)


class LAMB(ParameterwiseOptimizer):
    """LAMB, Algorithm 2 of You et al. 2019 ("Large Batch Optimization for Deep Learning").

    Per tensor ``x`` with gradient ``g`` at step ``t``::

        m = beta1 m + (1 - beta1) g            v = beta2 v + (1 - beta2) g^2
        r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
        u = r + weight_decay x
        x = x - lr * (||x|| / ||u||) * u        (trust ratio 1 if either norm is 0)

    The trust ratio (phi = identity) applies to tensors of 2+ dimensions; 1-D tensors
    (biases, norm gains) take the plain step ``x - lr * u``, as the paper's BERT runs exclude
    LayerNorm and bias from layer adaptation. Norms stay on the device: no host sync.
    """

    adapts_each_tensor = True  # the trust ratio takes each tensor's norms (litscale.muon.adapts_each_tensor)

    def __init__(
        self,
        params: Iterable,
        *,
        lr: PositiveFloat,
        betas: tuple[Fraction, Fraction] = (0.9, 0.999),
        eps: PositiveFloat = 1.0e-6,
        weight_decay: NonNegativeFloat = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": check_betas(betas), "eps": eps,
                                  "weight_decay": weight_decay})

    def _update(self, param: torch.Tensor, group: dict) -> None:
        if param.grad.is_sparse:
            raise RuntimeError("LAMB does not support sparse gradients")
        beta1, beta2 = group["betas"]
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(param.grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
        denominator = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
        update = (exp_avg / (1 - beta1**step)).div_(denominator)
        if group["weight_decay"]:
            update.add_(param, alpha=group["weight_decay"])
        if param.dim() >= 2:
            weight_norm, update_norm = param.norm(), update.norm()
            trust = torch.where((weight_norm > 0) & (update_norm > 0),
                                weight_norm / update_norm, torch.ones_like(weight_norm))
            update.mul_(trust)
        param.add_(update, alpha=-group["lr"])
