"""The run layout: how many processes, how they split into a mesh, and the batch they make.

Computed once, before any process or process group exists (by the app's validation, or by
hand in a library script), then passed along: the launcher starts ``processes_per_node``
ranks, the data module gets ``micro_batch``, LR scaling reads ``global_batch``, the start
line prints it and ``summary.json`` records it. torchtitan's ``ParallelDims`` is the model:
a frozen dataclass that checks its own arithmetic.

    world size   = nodes x processes per node
                 = pipeline x data-replicate x data-shard x context x tensor
    global batch = micro batch x data-parallel size (replicate x shard) x accumulation

Tensor-, context- and pipeline-parallel ranks share one data shard, so they do not multiply
the batch. Expert parallel is a view, not a dimension of its own: its ranks are borrowed from
the data x context ranks (as in torchtitan), so ``expert`` divides ``data x context``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from litscale.errors import ConfigError


class MeshAxis(StrEnum):
    """The names of the device mesh's dimensions, outermost first, in one place: strategies
    build their meshes with them, parity tests and the planner read them. ``DATA`` is the name
    Lightning's ModelParallelStrategy reads for its sampler arguments; FSDP's own mesh names
    its data dimension ``REPLICATE`` x ``SHARD`` (HSDP). ``EXPERT`` is a view over the data x
    context ranks, ``EXPERT_DATA`` the rest of them."""

    PIPELINE = "pipeline_parallel"
    DATA = "data_parallel"
    REPLICATE = "replicate"
    SHARD = "shard"
    CONTEXT = "context_parallel"
    TENSOR = "tensor_parallel"
    EXPERT = "expert_parallel"
    EXPERT_DATA = "expert_data_parallel"  # the data x context ranks that hold the same experts


PIPELINE, DATA, CONTEXT, TENSOR = MeshAxis.PIPELINE, MeshAxis.DATA, MeshAxis.CONTEXT, MeshAxis.TENSOR


@dataclass(frozen=True)
class MeshSizes:
    """How many ranks each mesh dimension spans; the product is the world.

    ``data_replicate`` ranks hold whole copies (DDP, HSDP's outer dimension); ``data_shard``
    ranks each hold a shard (FSDP, ZeRO, the data dimension of a 2-D/3-D mesh). Both see
    distinct samples. ``context`` ranks split one sample's sequence; ``expert`` ranks (a view
    over data x context) split the experts. NOTE: the fields after ``tensor`` come last so that
    ``MeshSizes(pipeline, data, tensor)`` keeps its meaning from when the mesh had three sizes."""

    pipeline: int = 1
    data_shard: int = 1
    tensor: int = 1
    data_replicate: int = 1
    context: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        for name in ("pipeline", "data_shard", "tensor", "data_replicate", "context", "expert"):
            if getattr(self, name) < 1:
                raise ValueError(f"MeshSizes.{name}={getattr(self, name)} is not valid: expected >= 1")
        borrowed = self.expert_borrowed
        if borrowed % self.expert:
            raise ValueError(f"strategy.expert_parallel_size={self.expert} does not divide the data x context "
                             f"ranks ({self.data} x {self.context} = {borrowed}); allowed: a divisor of {borrowed}")

    @property
    def data(self) -> int:
        """Ranks that see distinct samples."""
        return self.data_replicate * self.data_shard

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data * self.context * self.tensor

    # The derived groups, named once (torchtitan's ParallelDims): nobody multiplies sizes again.
    @property
    def fsdp(self) -> int:
        """Ranks a parameter is sharded over: the data shards x the context ranks, which hold
        the same weights and split the work of a sample."""
        return self.data_shard * self.context

    @property
    def loss(self) -> int:
        """Ranks whose tokens one loss averages: every data rank's samples, each split over
        the context ranks. Also the factor the summed gradients are divided by."""
        return self.data * self.context

    gradient_divide_factor = loss

    @property
    def expert_borrowed(self) -> int:
        """Ranks expert parallel borrows its groups from: data x context."""
        return self.data * self.context

    @property
    def expert_data(self) -> int:
        """Ranks that hold the same experts (the borrowed ranks over the expert-parallel size)."""
        return self.expert_borrowed // self.expert

    def shape_and_names(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The ``pipeline x data x tensor`` mesh of the tensor-parallel and pipeline strategies
        (the pipeline dimension is kept at size 1, so 2-D and 3-D meshes have the same names),
        with a ``context`` dimension before ``tensor`` where the sequence is split."""
        if self.context > 1:
            return (self.pipeline, self.data, self.context, self.tensor), (PIPELINE, DATA, CONTEXT, TENSOR)
        return (self.pipeline, self.data, self.tensor), (PIPELINE, DATA, TENSOR)

    def describe(self) -> str:
        data = f"data {self.data}"
        if self.data_replicate > 1 and self.data_shard > 1:
            data += f" (replicate {self.data_replicate} x shard {self.data_shard})"
        context = f" x context {self.context}" if self.context > 1 else ""
        expert = f" (expert {self.expert} over data x context)" if self.expert > 1 else ""
        return f"pipeline {self.pipeline} x {data}{context} x tensor {self.tensor}{expert}"


@dataclass(frozen=True)
class RunLayout:
    """Processes, mesh and batch of one run; raises ``ValueError`` if they do not agree."""

    num_nodes: int = 1
    processes_per_node: int = 1
    mesh: MeshSizes = field(default_factory=MeshSizes)
    micro_batch: int = 1
    accumulation: int = 1
    ckpt_path: str | None = None
    strong_scaling: bool = False  # the micro batch was derived from a fixed global batch
    replica_groups: int = 1  # fault_tolerance=replicas: copies of this layout, averaged together

    def __post_init__(self) -> None:
        for name in ("num_nodes", "processes_per_node", "micro_batch", "accumulation", "replica_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunLayout.{name}={getattr(self, name)} is not valid: expected >= 1")
        if self.mesh.world_size != self.world_size:
            raise ValueError(f"mesh {self.mesh.describe()} = {self.mesh.world_size} ranks but "
                             f"{self.num_nodes} node(s) x {self.processes_per_node} processes = "
                             f"{self.world_size}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.processes_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.data

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.data_parallel_size * self.accumulation * self.replica_groups

    def describe(self) -> str:
        """One line for the start of a run."""
        return (f"{self.num_nodes} node(s) x {self.processes_per_node} process(es) = world "
                f"{self.world_size} | mesh {self.mesh.describe()} | batch: micro "
                f"{self.micro_batch} x data-parallel {self.data_parallel_size} x accumulation "
                f"{self.accumulation}"
                + (f" x replica groups {self.replica_groups}" if self.replica_groups > 1 else "")
                + f" = global {self.global_batch}"
                + (" (strong scaling)" if self.strong_scaling else ""))

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``summary.json``, the derived figures included."""
        return {**asdict(self), "world_size": self.world_size,
                "data_parallel_size": self.data_parallel_size, "global_batch": self.global_batch}


def micro_batch_for(global_batch: int, *, data_parallel_size: int, accumulation: int) -> int:
    """The per-device micro batch that keeps ``global_batch`` fixed (strong scaling)."""
    share = data_parallel_size * accumulation
    if global_batch % share:
        raise ConfigError(
            f"scaling.global_batch={global_batch} does not split over {data_parallel_size} "
            f"data-parallel rank(s) x {accumulation} accumulation step(s); allowed: multiples of {share}"
        )
    return global_batch // share


def mesh_of(strategy: Any, world_size: int) -> MeshSizes:
    """The mesh a strategy lays ``world_size`` ranks out on: its own ``resolve_mesh``, or, for
    a strategy that has none (a user's own), plain data parallel over every rank."""
    resolve_mesh = getattr(strategy, "resolve_mesh", None)
    if resolve_mesh is None:
        return MeshSizes(data_replicate=world_size)
    return resolve_mesh(world_size)
