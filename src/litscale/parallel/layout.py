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
the data x context ranks (as in torchtitan), so ``expert`` divides ``data x context``. Replica
groups (``fault_tolerance=replicas``) are an outer replicate axis around the whole mesh: they
multiply the batch, not the mesh.

Every product of sizes is taken here, once, and named (``MeshSizes.fsdp``, ``loss``,
``model_split``, ``RunLayout.batch_ranks``, ...): the strategies, the planner, the callbacks
and the data modules read the names (a test holds that nobody else multiplies sizes).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from litscale.errors import ConfigError


class MeshAxis(StrEnum):
    """The names of the device mesh's dimensions, in one spelling: the world mesh's, outermost
    first (``PIPELINE`` x ``REPLICATE`` x ``SHARD`` x ``CONTEXT`` x ``TENSOR``), then the meshes
    derived from them (``litscale.parallel.mesh.ParallelMesh`` builds each and says who asks):
    ``FSDP``, the shard x context ranks a parameter is sharded over; ``EXPERT``, a view over the
    data x context ranks, and ``EXPERT_DATA``, the rest of them."""

    PIPELINE = "pipeline_parallel"
    REPLICATE = "replicate"
    SHARD = "shard"
    CONTEXT = "context_parallel"
    TENSOR = "tensor_parallel"
    FSDP = "fsdp"
    EXPERT = "expert_parallel"
    EXPERT_DATA = "expert_data_parallel"  # the data x context ranks that hold the same experts


PIPELINE, CONTEXT, TENSOR = MeshAxis.PIPELINE, MeshAxis.CONTEXT, MeshAxis.TENSOR


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

    @property
    def model_split(self) -> int:
        """Ranks one copy of the model is split over: each holds ``1 / (tensor x pipeline)`` of
        its weights (evenly, in the planner's formulas) before any data sharding."""
        return self.tensor * self.pipeline

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage (world / pipeline): those a gradient norm sums over."""
        return self.data * self.context * self.tensor

    @property
    def sample_split(self) -> int:
        """Ranks one sample's forward and backward is split over: tensor parallel splits its
        matmuls, context parallel its sequence."""
        return self.tensor * self.context

    @property
    def expert_split(self) -> int:
        """Ranks the routed experts are split over: the expert ranks of each pipeline stage."""
        return self.pipeline * self.expert

    def data_rank(self, global_rank: int) -> int:
        """The data-parallel rank of ``global_rank``: ranks are laid out row-major over
        (pipeline, data, context, tensor), so the context and tensor ranks of one sample share it."""
        return (global_rank // self.sample_split) % self.data

    def stride(self, group: MeshAxis | str) -> int:
        """How many ranks apart the members of ``group`` stand in the row-major world (which
        link a collective over it crosses): ``pipeline``, the data x context ranks (``FSDP``,
        ``loss``), the tensor ones, the expert ranks (the innermost of data x context) and the
        expert-data ones."""
        strides = {MeshAxis.PIPELINE: self.stage_ranks, MeshAxis.FSDP: self.tensor, "loss": self.tensor,
                   MeshAxis.TENSOR: 1, MeshAxis.CONTEXT: self.tensor, MeshAxis.EXPERT: self.tensor,
                   MeshAxis.EXPERT_DATA: self.tensor * self.expert}
        return strides[group]

    @classmethod
    def with_data_rest(cls, world_size: int, **sizes: int) -> MeshSizes | None:
        """The mesh whose data shards take every rank that ``sizes`` (any fields but
        ``data_shard``) leave of ``world_size``; None where they do not divide it (the planner's
        candidate layouts)."""
        taken = math.prod(sizes.get(name, 1) for name in ("pipeline", "data_replicate", "context", "tensor"))
        if world_size % taken:
            return None
        return cls(**sizes, data_shard=world_size // taken)

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
        return world_size_of(num_nodes=self.num_nodes, processes_per_node=self.processes_per_node)

    @property
    def replica_processes(self) -> int:
        """Processes of every replica group on this node (the groups run on one node)."""
        return self.processes_per_node * self.replica_groups

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.data

    @property
    def batch_ranks(self) -> int:
        """Ranks that draw distinct samples: the data-parallel ranks of every replica group
        (the groups are an outer replicate axis: ``replicas_around``)."""
        return self.mesh.data * self.replica_groups

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.batch_ranks * self.accumulation

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


def world_size_of(*, num_nodes: int, processes_per_node: int) -> int:
    """The world: nodes x processes per node (what a run layout is of, before its mesh is known)."""
    return num_nodes * processes_per_node


def resolve_mesh_sizes(
    world_size: int, *, pipeline: int | None = 1, data: int | None = None, tensor: int | None = 1,
    context: int = 1,
) -> MeshSizes:
    """Fill in the one size left ``None`` (at most one) and check the product is ``world_size``
    (the tensor-parallel and pipeline strategies' ``strategy.*_parallel_size`` keys)."""
    given = {"pipeline_parallel_size": pipeline, "data_parallel_size": data,
             **({"context_parallel_size": context} if context > 1 else {}), "tensor_parallel_size": tensor}
    missing = [key for key, size in given.items() if size is None]
    if len(missing) > 1:
        raise ValueError(f"strategy.{missing[0]} and strategy.{missing[1]} are both null; "
                         "set all but one mesh size")
    known = math.prod(size for size in given.values() if size is not None)
    shown = " x ".join(f"strategy.{key}={size}" for key, size in given.items() if size is not None)
    if missing:
        if world_size % known:
            raise ValueError(f"{shown} = {known} does not divide the world size ({world_size}); "
                             f"allowed: sizes whose product divides {world_size}")
        given[missing[0]] = world_size // known
    elif known != world_size:
        raise ValueError(f"{shown} = {known} but the world size is {world_size} "
                         "(trainer.devices x trainer.num_nodes); the product must equal it")
    return MeshSizes(pipeline=given["pipeline_parallel_size"], data_shard=given["data_parallel_size"],
                     tensor=given["tensor_parallel_size"], context=context)


def data_shards_left(world_size: int, **sizes: int) -> int:
    """The data shards ``world_size`` ranks hold once each of ``sizes`` (``strategy.<key>`` ->
    its value: FSDP's replicas and context ranks) has taken its share: each size, and their
    product, must divide the world (else ``ValueError`` naming the key)."""
    named = {**sizes, " x ".join(sizes): math.prod(sizes.values())} if len(sizes) > 1 else sizes
    for key, size in named.items():
        if world_size % size:
            raise ValueError(f"strategy.{key}={size} must divide the world size ({world_size}); "
                             f"allowed: a divisor of {world_size}")
    return world_size // math.prod(sizes.values())


def replicas_around(num_replicas: int, rank: int, *, group: int, groups: int) -> tuple[int, int]:
    """``(num_replicas, rank)`` of a data-parallel rank among every replica group's: the groups
    are an outer replicate axis, so group ``g``'s ranks follow group ``g - 1``'s."""
    return num_replicas * groups, group * num_replicas + rank
