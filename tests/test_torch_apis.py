"""Where litscale uses torch's own distributed helpers, and where it keeps its own because
torch's do a different job (2 gloo CPU ranks, GPT with the tensor-parallel plan):

- ``parallelize_module`` takes wildcard plans itself, but only warns for a pattern that
  matches nothing, so ``apply_tensor_parallel`` checks its plan first.
- ``get_total_norm`` (and so ``clip_grad_norm_``) raises on a mix of DTensor and plain
  gradients, and sees only this rank's pipeline stage; ``clip_grad_norm_across_mesh`` gives
  the single-process norm in both cases. ``clip_grads_with_norm_`` scales such a mix only
  one gradient at a time (``foreach=False``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers.distributed import run_distributed

from litscale.models.gpt import GPT, GPTConfig

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)


def _backward(net: torch.nn.Module) -> None:
    tokens = torch.randint(0, TINY.vocab_size, (4, TINY.block_size + 1), generator=torch.Generator().manual_seed(0))
    logits = net(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def _error(call) -> str:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return ""


def torch_and_litscale_on_two_ranks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from litscale.parallel.gradient_norm import clip_grad_norm_across_mesh
    from litscale.strategies.tensor_plan import apply_tensor_parallel

    torch.manual_seed(0)
    reference = GPT(TINY)
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_module(copy.deepcopy(reference), mesh, {"nope.*": ColwiseParallel()})
    results["torch_unmatched_warns"] = any("could not be resolved" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="strategy.plan pattern 'nope.\\*' matches no submodule of GPT"):
        apply_tensor_parallel(copy.deepcopy(reference), mesh, {"nope.*": "colwise"})

    parallel = copy.deepcopy(reference)
    apply_tensor_parallel(parallel, mesh, GPT.tensor_parallel_plan)  # wpe is not in the plan
    _backward(reference)
    _backward(parallel)
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    mixed = list(parallel.parameters())
    results["mixed_kinds"] = sorted({type(p.grad).__name__ for p in mixed})
    results["torch_norm_mixed"] = _error(lambda: torch.nn.utils.get_total_norm([p.grad for p in mixed]))
    # (a norm below max_norm: the scale is 1, so the gradients stay as they are if it ran)
    results["torch_foreach_scale_mixed"] = _error(
        lambda: torch.nn.utils.clip_grads_with_norm_(mixed, 1.0, torch.tensor(0.5)))
    results["mesh_norm_mixed"] = (float(clip_grad_norm_across_mesh(mixed, 1e9, ranks_per_stage=world_size)), expected)

    # Two pipeline stages: each rank holds every other parameter of the plain network.
    stage = list(reference.parameters())[rank::world_size]
    results["torch_norm_stage"] = (float(torch.nn.utils.get_total_norm([p.grad for p in stage])), expected)
    results["mesh_norm_stage"] = (float(clip_grad_norm_across_mesh(stage, 1e9, ranks_per_stage=1)), expected)
    return results


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_torch_wildcard_plans_and_norms_against_litscale():
    for results in run_distributed(torch_and_litscale_on_two_ranks, 2, timeout=140):
        assert results["torch_unmatched_warns"]
        assert results["mixed_kinds"] == ["DTensor", "Tensor"]
        assert "mixed torch.Tensor and DTensor" in results["torch_norm_mixed"]
        assert "mixed torch.Tensor and DTensor" in results["torch_foreach_scale_mixed"]
        assert results["mesh_norm_mixed"][0] == pytest.approx(results["mesh_norm_mixed"][1], rel=1e-5)
        assert results["torch_norm_stage"][0] < 0.99 * results["torch_norm_stage"][1]
        assert results["mesh_norm_stage"][0] == pytest.approx(results["mesh_norm_stage"][1], rel=1e-5)
