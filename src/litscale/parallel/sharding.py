"""What a strategy does to one rank's share of the model, stated once (``Sharding``: the
contract's ``sharding``, ``litscale.parallel.contract``) and read by everyone who needs it: the memory callback (its estimate beside what a rank measures), the
planner (memory per rank and the collectives of a step) and the dry run.

A strategy first splits the network over the axes that divide the model itself (tensor and
pipeline: a rank holds ``1 / (tensor x pipeline)`` of it, evenly in the formulas), then shards
that share over the data-shard ranks by ZeRO stage (Rajbhandari et al. 2020, section 5), per
rank, for P parameters and N data-shard ranks, mixed-precision Adam (2 bytes of 16-bit
parameter, 2 of gradient, K = 12 of fp32 master copy + momentum + variance):

    DDP 16P;  ZeRO-1 4P + 12P/N;  ZeRO-2 2P + 14P/N;  ZeRO-3 / FSDP 16P/N.

The constants follow what is stored: parameter and gradient bytes are the parameter dtype's
size; K is 8 for Adam-family optimizers, 4 for SGD with momentum, 0 without, +4 where the
strategy keeps an fp32 master copy (DeepSpeed, or 16-bit parameters under a mixed policy).
"""

from __future__ import annotations

from dataclasses import dataclass

from litscale.parallel.layout import MeshSizes


@dataclass(frozen=True)
class Sharding:
    """How a rank holds its share of the model.

    ``zero_stage``: what is sharded over the data-shard ranks between steps (0: nothing, DDP;
    1: optimizer state; 2: and gradients; 3: and parameters, FSDP2 and the strategies built on
    it, tensor parallel and pipeline included). ``whole_parameters_in_step``: parameters are
    gathered once per step and held whole until backward ends (FSDP2's
    ``reshard_after_forward=False``, which the pipeline strategy uses): at its peak such a rank
    holds what ZeRO-2 does, and it gathers once per step instead of twice per micro-batch.
    ``fp32_master_copy``: an fp32 copy of the parameters beside the optimizer state.
    ``reduce_buffers`` buffers of ``reduce_bucket_elements`` each (at most the rank's share of
    the parameters), kept for the gradients' reduction (DeepSpeed's contiguous buckets, two with
    ``overlap_comm``), of ``reduce_buffer_bytes`` per element (0: the gradients' dtype)."""

    zero_stage: int
    whole_parameters_in_step: bool = False
    fp32_master_copy: bool = False
    reduce_buffers: int = 0
    reduce_bucket_elements: int = 0
    reduce_buffer_bytes: int = 0

    def reduce_buffer_bytes_per_rank(self, local_params: float, grad_bytes: int) -> float:
        """Bytes of the reduction buffers of a rank holding ``local_params`` parameters."""
        return self.reduce_buffers * min(self.reduce_bucket_elements, local_params) * (
            self.reduce_buffer_bytes or grad_bytes)

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Sharding.zero_stage={self.zero_stage} is not valid: expected 0, 1, 2 or 3")

    @property
    def peak_stage(self) -> int:
        """The ZeRO stage of what a rank holds at its peak, inside a step."""
        return 2 if self.zero_stage == 3 and self.whole_parameters_in_step else self.zero_stage


REPLICATED = Sharding(zero_stage=0)


def fsdp2_sharding(*, reshard_after_forward: bool) -> Sharding:
    """FSDP2 over the data-shard ranks (the FSDP strategy, and the data dimension of the
    tensor-parallel and pipeline strategies)."""
    return Sharding(zero_stage=3, whole_parameters_in_step=not reshard_after_forward)


def estimate_bytes(*, num_params: float, world_size: int, zero_stage: int, param_bytes: int,
                   optimizer_bytes_per_param: float) -> dict[str, float]:
    """The ZeRO paper's per-rank bytes for ``num_params`` sharded over ``world_size`` ranks:
    stage 0 (DDP) replicates everything; stage 1 shards optimizer state, 2 also gradients, 3
    (and FSDP) also parameters."""
    shard = 1 / world_size
    return {
        "memory/estimate_params_bytes": param_bytes * num_params * (shard if zero_stage >= 3 else 1),
        "memory/estimate_grads_bytes": param_bytes * num_params * (shard if zero_stage >= 2 else 1),
        "memory/estimate_optimizer_bytes":
            optimizer_bytes_per_param * num_params * (shard if zero_stage >= 1 else 1),
    }


def state_bytes_per_rank(*, num_params: int, mesh: MeshSizes, sharding: Sharding, param_bytes: int,
                         optimizer_bytes_per_param: float, at_peak: bool = False, tensor_whole_params: int = 0,
                         expert_params: int = 0) -> dict[str, float]:
    """Parameter, gradient and optimizer bytes one rank of ``mesh`` holds of a model of
    ``num_params``: its ``1 / (tensor x pipeline)`` share, sharded over the data-shard ranks by
    ``sharding`` (between steps, or ``at_peak`` inside one): with the context folded in, as
    context-parallel ranks share the sharding (``litscale.strategies.context_parallel``). The
    memory callback's estimate and the planner's memory both come from here.

    A mixture of experts: ``tensor_whole_params`` of them (its MoE layers) are held whole by
    every tensor-parallel rank; of those, the ``expert_params`` of the routed experts are split
    over ``mesh.expert`` ranks and, where it is above 1, sharded over the data x context ranks
    left (the expert-data ranks, all of them, replicas included: ``strategies/expert_parallel.py``)."""
    stage = sharding.peak_stage if at_peak else sharding.zero_stage
    master = 4 if sharding.fp32_master_copy else 0
    shards = mesh.fsdp

    def sharded(count: float, over: int) -> dict[str, float]:
        return estimate_bytes(num_params=count, world_size=over, zero_stage=stage if over > 1 else 0,
                              param_bytes=param_bytes, optimizer_bytes_per_param=optimizer_bytes_per_param + master)

    experts = expert_params if mesh.expert > 1 else 0
    parts = [sharded((num_params - tensor_whole_params) / (mesh.tensor * mesh.pipeline), shards),
             sharded((tensor_whole_params - experts) / mesh.pipeline, shards),
             sharded(experts / (mesh.pipeline * mesh.expert), mesh.expert_data)]
    return {key: sum(part[key] for part in parts) for key in parts[0]}
