"""Every device mesh of a run, built once from its sizes and asked by name (torchtitan's
``ParallelDims``): nobody else lays a mesh out, flattens or splits one.

The world mesh is ``pipeline x [replicate] x shard x [context] x tensor``, row-major, the
dimensions in brackets only where they span more than one rank (the others are kept at size 1
so that every layout has the names the strategies ask for: a pipeline of one stage still has a
pipeline group). The meshes derived from it are built the first time they are asked for, then
kept. Each name, and who asks for it:

- ``pipeline``: the pipeline strategy's stages (schedule, send/recv, the loss broadcast);
- ``tensor``: the tensor-parallel plan (``strategies/parallelize.py``), loss parallel;
- ``context``: context-parallel attention and each batch's sequence split (``batch_to_device``);
- ``replicate``: HSDP's outer dimension, asked beside ``fsdp`` (``get(REPLICATE, FSDP)``);
- ``fsdp``: shard x context, flattened: the ranks FSDP2 shards a parameter over (context ranks
  hold the same weights);
- ``expert`` and ``expert_data``: the data x context ranks split into expert-data x expert, the
  expert ranks innermost: the experts' weights and all-to-all, and their FSDP2.

Asking for a dimension the layout does not have (``replicate`` without replicas, ``context``
without a sequence split, ``expert`` without expert parallel) raises ``ValueError`` naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from litscale.parallel.layout import MeshAxis, MeshSizes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The world's dimensions, outermost first; ``OPTIONAL`` ones only where they span ranks.
WORLD = (MeshAxis.PIPELINE, MeshAxis.REPLICATE, MeshAxis.SHARD, MeshAxis.CONTEXT, MeshAxis.TENSOR)
OPTIONAL = (MeshAxis.REPLICATE, MeshAxis.CONTEXT)
# The flattened data x context ranks that expert parallel borrows from.
BORROWED = "expert_borrowed"


def world_layout(sizes: MeshSizes) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The world mesh's shape and dimension names for ``sizes``, outermost first."""
    shape = {MeshAxis.PIPELINE: sizes.pipeline, MeshAxis.REPLICATE: sizes.data_replicate,
             MeshAxis.SHARD: sizes.data_shard, MeshAxis.CONTEXT: sizes.context, MeshAxis.TENSOR: sizes.tensor}
    names = tuple(name for name in WORLD if name not in OPTIONAL or shape[name] > 1)
    return tuple(shape[name] for name in names), names


class ParallelMesh:
    """The world mesh of ``sizes`` on ``device_type`` and the meshes derived from it.

    ``ParallelMesh.build(sizes, "cpu")`` starts its process groups (a collective: every rank
    builds it, in the same order); ``get(name, ...)`` returns one named mesh, or several names
    as one multi-dimensional mesh (``get(REPLICATE, FSDP)``: HSDP's)."""

    def __init__(self, sizes: MeshSizes, world: DeviceMesh) -> None:
        self.sizes = sizes
        self.world = world
        self._derived: dict[str, str] = {}  # a derived name -> its dimension's name in the world's registry
        self._experts: dict[str, DeviceMesh] = {}

    @classmethod
    def build(cls, sizes: MeshSizes, device_type: str) -> ParallelMesh:
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = world_layout(sizes)
        return cls(sizes, init_device_mesh(device_type, shape, mesh_dim_names=names))

    @property
    def names(self) -> tuple[str, ...]:
        """The world mesh's dimensions, outermost first."""
        return tuple(self.world.mesh_dim_names)

    def get(self, *names: str) -> DeviceMesh:
        """The mesh of ``names`` (world dimensions or derived ones), in that order."""
        dims = tuple(self._dimension(name) for name in names)
        if len(dims) == 1 and dims[0] in self._experts:  # a split of the borrowed ranks, not of the world
            return self._experts[dims[0]]
        return self.world[dims[0]] if len(dims) == 1 else self.world[dims]

    def size(self) -> int:
        return self.world.size()

    def describe(self) -> str:
        """``replicate 2 x shard 128``: the dimensions that span ranks, outermost first (the
        data shards where none does)."""
        spanned = [(name, size) for name, size in zip(self.names, self.world.shape, strict=True) if size > 1]
        return " x ".join(f"{name} {size}" for name, size in spanned or [(MeshAxis.SHARD, 1)])

    def _dimension(self, name: str) -> str:
        if name in self.names:
            return name
        if name in self._derived:
            return self._derived[name]
        if name == MeshAxis.FSDP:
            return self._flattened(MeshAxis.FSDP, (MeshAxis.SHARD, MeshAxis.CONTEXT))
        if name in (MeshAxis.EXPERT, MeshAxis.EXPERT_DATA) and self.sizes.expert > 1:
            self._split_experts()
            return self._derived[name]
        if name in WORLD or name in (MeshAxis.EXPERT, MeshAxis.EXPERT_DATA):
            raise ValueError(f"the {name} mesh is not enabled in this layout ({self.sizes.describe()}); "
                             f"its dimensions: {', '.join(self.names)}")
        raise ValueError(f"{name!r} names no mesh; allowed: {', '.join(m.value for m in MeshAxis)}")

    def _flattened(self, name: str, dims: tuple[str, ...]) -> str:
        """The world's ``dims`` that it has, as one dimension named ``name`` (the one itself
        where it has one only)."""
        present = tuple(dim for dim in dims if dim in self.names)
        if len(present) == 1:
            self._derived[name] = present[0]
        else:
            self.world[present]._flatten(name)
            self._derived[name] = name
        return self._derived[name]

    def _split_experts(self) -> None:
        """The data x context ranks flattened and split as expert-data x expert, the expert
        ranks innermost (torchtitan's EP borrows them the same way)."""
        borrowed = self.get(self._flattened(BORROWED, (MeshAxis.REPLICATE, MeshAxis.SHARD, MeshAxis.CONTEXT)))
        split = borrowed._unflatten(0, (self.sizes.expert_data, self.sizes.expert),
                                    (MeshAxis.EXPERT_DATA, MeshAxis.EXPERT))
        for name in (MeshAxis.EXPERT, MeshAxis.EXPERT_DATA):
            self._experts[name] = split[name]
            self._derived[name] = name
