"""A plan: one way to run a model, a strategy with its options on a mesh, the batch split and
what trades memory for time; what the cost model (``cost.py``) predicts and ``plan=show`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from litscale.parallel.layout import MeshSizes
from litscale.parallel.sharding import Sharding
from litscale.planner.strategies import built, registered, takes

# The strategies' keywords for mesh sizes: ``describe`` shows them as the mesh (pp, dp, cp, tp, ep).
MESH_KEYWORDS = frozenset({"replicate_size", "data_parallel_size", "context_parallel_size", "tensor_parallel_size",
                           "expert_parallel_size", "pipeline_parallel_size"})
# A plan's fields that are keywords of the same name of the strategies that take them.
PLAN_KEYWORDS = ("activation_checkpointing", "microbatches", "schedule", "virtual_stages")


@dataclass(frozen=True)
class Framework:
    """What a published run's framework does that no litscale strategy does, for the cost model to
    predict that run as it ran (``experiments/planner/anchors.py``); each default is litscale's own."""

    # FLOPs per token its partial recompute adds in backward (torchtitan's selective checkpointing
    # by op, Megatron's full recompute of some layers).
    recompute_flops_per_token: float = 0.0
    # Bytes per token a layer keeps from its forward to its backward under its selective
    # checkpointing (torchtitan's by op: the matmul outputs its policy saves, attention's output,
    # the layer's input); the rest of the layer is recomputed in backward, one layer at a time.
    # 0: none (every traced activation is kept, or the plan's own full checkpointing applies).
    selective_saves_bytes_per_token: float = 0.0
    # How it holds a rank's share instead of the strategy's (Megatron's distributed optimizer).
    held: Sharding | None = None
    # torch's pipelining keeps a receive buffer per micro-batch and stage for the whole run;
    # Megatron's point-to-point receives into tensors freed once used.
    pipeline_receive_buffers: bool = True
    # Sequence parallel saves each column-parallel matmul's sequence-gathered input whole (DTensor's
    # all-gather output); Megatron saves the rank's shard and gathers it again in backward.
    saves_gathered_inputs: bool = True
    # The cross-entropy over the vocabulary-split logits, without gathering them whole (Megatron's
    # vocabulary-parallel loss, torchtitan's loss_parallel).
    loss_parallel: bool = False
    # The share of litscale's saved activations (an eager PyTorch layer's, as traced) the framework
    # keeps: fused kernels that save less (Transformer Engine's fused SwiGLU keeps the gate and up
    # projections, not their product; its float8 Linear keeps float8 inputs).
    saved_activation_share: float = 1.0
    # Each token's rows cross to another node once per node that holds any of its experts, then
    # fan out over that node's NVLink (DeepEP's and HybridEP's dispatch), not once per expert.
    dispatch_once_per_node: bool = False


@dataclass(frozen=True)
class Plan:
    """A way to run: a strategy (its ``strategy=`` option and its own options) on a mesh, the
    batch split, and what trades memory for time."""

    strategy: str
    mesh: MeshSizes
    micro_batch: int
    accumulation: int
    activation_checkpointing: bool = False
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    microbatches: int = 1  # a pipeline's split of the micro batch
    schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per pipeline rank (interleaved schedules: 2 or more)
    compression: str = "none"  # DDP's gradient compression (litscale's compression= option)
    float8: bool = False  # precision=fp8: the Linear layers' matmuls in float8 (the rest in compute_dtype)
    # A published run's framework, where it does what no litscale strategy does (None: litscale's).
    framework: Framework | None = None
    # The strategy's constructor options for this layout, as its ``candidate_meshes`` states them
    # (``{"stage": 1}``, ``{"tensor_parallel_size": 2, "data_parallel_size": 4, ...}``).
    options: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def pipeline_micro_batch(self) -> int:
        """Samples in one forward-backward: the micro batch, split into a pipeline's micro-batches."""
        return self.micro_batch // self.microbatches

    @property
    def forward_backwards(self) -> int:
        """Forward-backwards a rank runs per optimizer step."""
        return self.accumulation * self.microbatches

    def strategy_options(self) -> dict[str, Any]:
        """The strategy's constructor keywords for this plan: its options, and the plan's fields
        it takes (activation checkpointing, a pipeline's micro-batches and schedule)."""
        cls = registered()[self.strategy]
        return {**self.options, **{key: getattr(self, key) for key in PLAN_KEYWORDS if takes(cls, key)}}

    @property
    def sharding(self) -> Sharding:
        """How the plan's strategy, built with its options, holds a rank's share
        (``litscale.parallel.sharding``; a pipeline keeps its stage gathered through the step), or
        the published run's framework's (``Framework.held``)."""
        if self.framework is not None and self.framework.held is not None:
            return self.framework.held
        return built(self.strategy, self.strategy_options()).sharding

    @property
    def published(self) -> Framework:
        """The framework the plan runs on: a published run's, else litscale's (the defaults)."""
        return self.framework or Framework()

    def describe(self) -> str:
        mesh = self.mesh
        hybrid = mesh.data_replicate > 1 and mesh.data_shard > 1  # HSDP: replicas x shards
        data = f"dp{mesh.data_replicate}x{mesh.data_shard}" if hybrid else f"dp{mesh.data}"
        stated = [f"{key}={value}" for key, value in self.options.items()
                  if key not in MESH_KEYWORDS and key not in PLAN_KEYWORDS]  # the rest is shown below
        parts = [self.strategy, *stated, f"pp{mesh.pipeline}", data,
                 *([f"cp{mesh.context}"] if mesh.context > 1 else []), f"tp{mesh.tensor}",
                 *([f"ep{mesh.expert}"] if mesh.expert > 1 else []),
                 f"mb{self.micro_batch}", f"acc{self.accumulation}"]
        if self.mesh.pipeline > 1:
            parts.append(f"{self.schedule}x{self.microbatches}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.compression != "none":
            parts.append(self.compression)
        return " ".join(parts) + (" ac" if self.activation_checkpointing else "")
