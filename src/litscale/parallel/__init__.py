"""How a run is laid out over its ranks, and what a strategy answers about it: asked by the
strategies, the planner, validation and the callbacks, before and after the ranks start.

- ``layout``: the run layout (processes, mesh sizes, batch), computed once before launch, and
  every product of sizes named once (``MeshSizes``: model split, batch ranks, expert split...).
- ``mesh``: ``ParallelMesh``, every device mesh of a run built once from the layout and asked
  by name (torchtitan's ``ParallelDims``): nobody else lays a mesh out or flattens one.
- ``gradient_norm``: gradients split across ranks, their global norm and clipping by it.
- ``contract``: the strategy contract: the questions every strategy answers, and the options
  it refuses, in one place.
- ``sharding``: what a strategy does to a rank's share of the model, and the bytes it holds.
- ``declarations``: what a model declares about itself (sharding units, experts, widths).
"""
