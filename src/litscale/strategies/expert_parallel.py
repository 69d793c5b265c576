"""Expert parallel: a model's grouped experts sharded over ``expert_parallel_size`` ranks,
tokens moved to their experts' ranks and back with all-to-all (torchtitan's ``ExpertParallel``
and its FSDP composition, on torch's own pieces).

The model declares its grouped-experts modules (``expert_modules``: stacked weights, expert
index first, whose forward takes rows sorted by expert and the count of rows per expert; see
``litscale/models/moe_parallel.py``). ``apply_expert_parallel``, for each:

1. shards its weights along dim 0 over the expert mesh (a DTensor ``Shard(0)``: rank ``i`` of
   ``ep`` holds experts ``i * n / ep`` to ``(i + 1) * n / ep - 1``);
2. wraps its forward (``torch.distributed.tensor.distribute_module``'s input and output
   functions): before it, an all-to-all of the counts, then of the rows, sends each expert's
   rows to the rank that holds it, where they are regrouped by expert; after it, the reverse
   all-to-all brings each row's output back to where it was routed from. Routing and the
   capacity are decided before, on the rank that holds the token, so EP changes no routing;
3. shards it with FSDP2 over the data ranks that hold the same experts (the "expert data"
   mesh: data x context / ep ranks; a mesh of one rank where EP takes them all), with the
   gradient divided by the whole data x context size. NOTE: a rank's expert gradient already
   sums the contributions of its ``ep`` peers' tokens (the all-to-all's backward brings them),
   so FSDP's default mean over the expert-data ranks alone would weigh them ``ep`` times too
   much (torchtitan's ``set_gradient_divide_factor`` for the same reason).

The expert ranks are borrowed from the innermost data (x context) ranks: the mesh's data
dimensions flattened, then unflattened as ``expert data x expert`` (both sharing the
strategy's root mesh, as FSDP2's EP path asks; ``litscale.parallel.mesh`` builds them). The other parameters are sharded by the
strategy over all data ranks afterwards; FSDP2 leaves the experts, already sharded, alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from litscale.measure.tensor_bytes import shapes_only
from litscale.parallel.declarations import find_expert_modules

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


def check_expert_parallel_fits(net: nn.Module, expert_parallel_size: int, context_parallel_size: int = 1) -> None:
    """Pre-flight: the model has experts, and their number splits evenly over the EP ranks.
    NOTE: EP is refused beside context parallel for now: its ranks would come from data x
    context, which no parity test checks yet."""
    if expert_parallel_size == 1:
        return
    config = getattr(net, "config", None)
    n_experts = getattr(config, "n_experts", None)
    check_expert_parallel_sizes(expert_parallel_size, n_experts if find_expert_modules(net) else None,
                                context_parallel_size, model_name=type(net).__name__)


def check_expert_parallel_sizes(expert_parallel_size: int, n_experts: int | None, context_parallel_size: int = 1,
                                *, model_name: str = "the model") -> None:
    """``check_expert_parallel_fits`` on numbers (``n_experts`` None: a model without
    experts), for the planner's search, which has a model's facts rather than the model."""
    if expert_parallel_size == 1:
        return
    if context_parallel_size > 1:
        raise ValueError(f"strategy.expert_parallel_size={expert_parallel_size} with context_parallel_size="
                         f"{context_parallel_size} is not supported yet; allowed: one of them 1")
    if not isinstance(n_experts, int):
        raise ValueError(f"strategy.expert_parallel_size={expert_parallel_size} needs a mixture-of-experts "
                         f"model, and {model_name} declares no experts; allowed: 1 (or model=moe)")
    if n_experts % expert_parallel_size:
        raise ValueError(f"strategy.expert_parallel_size={expert_parallel_size} does not divide "
                         f"model.net.n_experts={n_experts}; allowed: a divisor of {n_experts}")


class TokenExchange:
    """The all-to-all around one grouped-experts module on the expert mesh; holds, between the
    two, how the rows were split and regrouped."""

    def __init__(self) -> None:
        self._sent: list[int] = []
        self._received: list[int] = []
        self._order: Tensor | None = None

    def dispatch(self, module: nn.Module, inputs: tuple[Tensor, Tensor], mesh: DeviceMesh) -> tuple[Tensor, Tensor]:
        """(rows sorted by global expert, rows per global expert) of this rank -> (the rows for
        this rank's experts from every peer, sorted by local expert, rows per local expert)."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        rows, tokens_per_expert = inputs
        ranks, group = mesh.size(), mesh.get_group()
        if shapes_only(rows):
            return self._dispatch_evenly(rows, tokens_per_expert, ranks, group)
        received = torch.empty_like(tokens_per_expert)
        # Peer j gets the counts of its experts: [ranks, local experts] row j.
        dist.all_to_all_single(received, tokens_per_expert, group=group)
        received = received.view(ranks, -1)  # [source rank, local expert]
        self._sent = tokens_per_expert.view(ranks, -1).sum(1).tolist()
        self._received = received.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows, self._received, self._sent, group)
        # Rows arrive by source rank, then local expert; regroup by local expert, each expert's
        # rows in source-rank order (a stable sort).
        local_expert = torch.arange(received.shape[1], device=rows.device).repeat(ranks)
        self._order = torch.sort(local_expert.repeat_interleave(received.flatten()), stable=True).indices
        return arrived[self._order], received.sum(0)

    def _dispatch_evenly(self, rows: Tensor, tokens_per_expert: Tensor, ranks: int, group) -> tuple[Tensor, Tensor]:
        """A shape trace (the planner's step on fake tensors) has no counts to exchange: each
        peer is sent an even share of the rows and sends as many back (a balanced routing, as
        the planner costs it), and this rank's experts split what arrives evenly."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        share, rest = divmod(rows.shape[0], ranks)
        self._sent = self._received = [share + (peer < rest) for peer in range(ranks)]
        self._order = torch.arange(rows.shape[0], device=rows.device)
        arrived = all_to_all_single_autograd(rows, self._received, self._sent, group)
        local_experts = tokens_per_expert.numel() // ranks
        return arrived, tokens_per_expert.new_full((local_experts,), rows.shape[0] // local_experts)

    def combine(self, module: nn.Module, outputs: Tensor, mesh: DeviceMesh) -> Tensor:
        """The experts' outputs back to the ranks and places their rows came from."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        by_source = torch.empty_like(outputs).index_copy(0, self._order, outputs)
        return all_to_all_single_autograd(by_source, self._sent, self._received, mesh.get_group())


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.data, mesh, [Shard(0)])
        module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def apply_expert_parallel(module: nn.Module, expert_mesh: DeviceMesh, expert_data_mesh: DeviceMesh, *,
                          divide_factor: int, reshard_after_forward: bool = True,
                          mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Shard ``module``'s declared experts over ``expert_mesh`` (the expert ranks borrowed from
    the data x context ranks: ``ParallelMesh``'s ``expert``), wrap them with the token exchange
    and FSDP2 them over ``expert_data_mesh`` (the rest of those ranks), their gradients divided by
    ``divide_factor`` (every borrowed rank's samples) (module docstring). Call before the
    strategy's own FSDP of the other parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_module

    experts = find_expert_modules(module)
    if not experts:
        return
    for experts_module in experts:
        exchange = TokenExchange()
        distribute_module(experts_module, expert_mesh, _shard_experts,
                          input_fn=exchange.dispatch, output_fn=exchange.combine)
        fully_shard(experts_module, mesh=expert_data_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy or MixedPrecisionPolicy())
        experts_module.set_gradient_divide_factor(divide_factor)
        if expert_data_mesh.device_type == "cpu" and expert_data_mesh.size() > 1:
            # NOTE: a divide factor makes FSDP reduce with NCCL's PREMUL_SUM, which gloo refuses;
            # a plain sum with the division after it is the same arithmetic. Not on a mesh of one
            # rank: there torch 2.13 divides by the factor with no reduction, then again after it.
            experts_module.set_force_sum_reduction_for_comms(True)
