"""What precision=fp8's dynamic scaling costs beside its faster matmuls.

torchao's tensorwise recipe (``precision.float8=tensorwise``, what torchtitan's and Megatron's
"current scaling" runs use) casts each float8 Linear's input, weight and output gradient to float8
in every forward-backward: an amax pass over the tensor, then a cast pass that writes it in float8
twice (row- and column-major, for forward and for backward's two matmuls). Each pass is
memory-bound, so each is costed from the bytes it moves at the device's memory bandwidth, as
torchao's own roofline does (``torchao/testing/training/roofline_utils.py``,
``get_tensor_memory_traffic_ovhd_s`` for ``tensorwise``, unfused, torchao 36027d8): per element,
an activation or gradient reads 2 bytes (amax) then reads 2 and writes 2 x 1 (cast); a weight
reads 2 (amax), then reads 2 and writes 1 for forward and again for backward; a second amax stage
over the partial maxima moves next to nothing. Each pass takes at least a kernel launch (2 us,
torchao's ``KERNEL_LAUNCH_OVERHEAD_SEC``), at ``memory_bandwidth_fraction`` of the bandwidth
(torchao's 0.92 for an H100).

Measured against it (``experiments/gpu``, one H100, GPT-2 small, micro batch 32 x 1,024 tokens,
compiled): precision=fp8 took 0.34 us per token more than bf16 (392k against 452k tokens/s); these
casts come to 0.29 us per token there.
"""

from __future__ import annotations

from litscale.planner.cluster import Cluster
from litscale.planner.model_facts import ModelFacts
from litscale.planner.plan import Plan

KERNEL_LAUNCH_S = 2e-6
# Bytes each pass moves per element (torchao's tensorwise roofline): the amax pass, its second
# stage (next to nothing), the cast pass(es).
ACTIVATION_PASSES = (2, 0, 2 + 2 * 1)
WEIGHT_PASSES = (2, 0, 2 + 1, 2 + 1)


def cast_s(numel: float, passes: tuple[int, ...], cluster: Cluster) -> float:
    """Seconds to cast a ``numel``-element bf16 tensor to float8 in ``passes``."""
    bandwidth = cluster.memory_bandwidth_bytes_s * cluster.memory_bandwidth_fraction
    return sum(max(numel * nbytes / bandwidth, KERNEL_LAUNCH_S) for nbytes in passes)


def float8_cast_s(plan: Plan, facts: ModelFacts, cluster: Cluster) -> float:
    """The casts of one forward-backward of one rank, before a pipeline's split (its share of the
    layers is taken as it is for the FLOPs): every float8 Linear's input, weight and output
    gradient, each split over the tensor-parallel ranks and the sequence over the context ranks.
    0 without precision=fp8, or where the cluster states no memory bandwidth."""
    if not plan.float8 or not cluster.memory_bandwidth_bytes_s or "float8" not in cluster.peak_flops:
        return 0.0
    mesh = plan.mesh
    tokens = plan.pipeline_micro_batch * facts.seq_len / mesh.context
    return sum(cast_s(tokens * inputs / mesh.tensor, ACTIVATION_PASSES, cluster)
               + cast_s(inputs * outputs / mesh.tensor, WEIGHT_PASSES, cluster)
               + cast_s(tokens * outputs / mesh.tensor, ACTIVATION_PASSES, cluster)
               for inputs, outputs in facts.float8_linears)
