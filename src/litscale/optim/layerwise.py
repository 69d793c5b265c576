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

Under FSDP and tensor parallel each rank steps DTensor shards, whose norms DTensor reduces over
the mesh: the same norm as one process's to fp32 rounding, not bit for bit (the shards' sums of
squares are added in another order). ``determinism=layout_invariant`` sets
``whole_tensor_norms``: each norm is then taken of the whole tensor (gathered), by the same
kernel on every layout, and the steps are bit-identical to one process's.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytorch_optimizer  # ~1 s to import; this module loads only when lars/lamb is chosen
import torch

from litscale.constraints import Fraction, NonNegativeFloat, PositiveFloat
from litscale.optim.parameter_steps import ParameterwiseOptimizer, check_betas, whole_tensor


class TrustRatio:
    """What LARS and LAMB share: each weight tensor's step is scaled by that tensor's norms."""

    adapts_each_tensor = True  # the trust ratio takes each tensor's norms (litscale.optim.muon.adapts_each_tensor)
    # Take each norm of the whole tensor, gathered from its DTensor shards: the same number as one
    # process's, bit for bit, at the cost of an all-gather of every sharded matrix and of its update
    # per step. Set by determinism=layout_invariant (LayoutInvariance.take_optimizer).
    whole_tensor_norms = False

    def tensor_norm(self, tensor: torch.Tensor) -> torch.Tensor:
        """The 2-norm of ``tensor`` (of a DTensor's whole tensor, as a plain tensor, with
        ``whole_tensor_norms``; else DTensor's reduction over its shards)."""
        return torch.linalg.vector_norm(whole_tensor(tensor) if self.whole_tensor_norms else tensor)


class LARS(TrustRatio, pytorch_optimizer.LARS):
    """LARS (SGD + momentum with a layer-wise trust ratio), ``pytorch_optimizer``'s, with a
    typed keyword-only signature so configs are checked before a run starts.

    ``weight_decay`` is the default for param groups that do not set their own (litscale's
    modules set it per group: ``model.weight_decay`` on matrices, 0 on 1-D tensors).
    """

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
        # DTensors. With whole-tensor norms every layout takes the per-tensor path: the batched
        # one's norms (torch._foreach_norm) are another kernel, with its own order of addition.
        from torch.distributed.tensor import DTensor

        return (not self.whole_tensor_norms and not any(isinstance(p, DTensor) for p in group["params"])
                and super()._can_use_foreach(group))

    def _step_per_param(self, group: dict) -> None:
        """``pytorch_optimizer.LARS``'s per-tensor step (4.1.0) with the norms taken by
        ``tensor_norm``. NOTE: written out because the library computes the norms inline, with no
        hook to take a sharded tensor's whole norm."""
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            self.maximize_gradient(grad, maximize=self.maximize)
            if p.ndim > 1:
                param_norm, update_norm = self.tensor_norm(p), self.tensor_norm(grad)
                one = torch.ones_like(param_norm)
                denominator = update_norm + group["weight_decay"] * param_norm
                trust_ratio = torch.where(
                    param_norm > 0.0,
                    torch.where(denominator > 0.0, group["trust_coefficient"] * param_norm / denominator, one),
                    one)
                grad.add_(p, alpha=group["weight_decay"])
                grad.mul_(trust_ratio)
            if group["momentum"] > 0.0:
                buffer = self.state[p]["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(grad, alpha=1.0 - group["dampening"])
                if group["nesterov"]:
                    grad.add_(buffer, alpha=group["momentum"])
                else:
                    grad.copy_(buffer)
            p.add_(grad, alpha=-group["lr"])


class LAMB(TrustRatio, ParameterwiseOptimizer):
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
            weight_norm, update_norm = self.tensor_norm(param), self.tensor_norm(update)
            trust = torch.where((weight_norm > 0) & (update_norm > 0),
                                weight_norm / update_norm, torch.ones_like(weight_norm))
            update.mul_(trust)
        param.add_(update, alpha=-group["lr"])
