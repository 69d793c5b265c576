"""How a run is laid out over its ranks, and what a strategy answers about it: asked by the
strategies, the planner, validation and the callbacks, before and after the ranks start.

- ``layout``: the run layout (processes, mesh sizes, batch), computed once before launch.
- ``contract``: the strategy contract: the questions every strategy answers, and the options
  it refuses, in one place.
- ``sharding``: what a strategy does to a rank's share of the model, and the bytes it holds.
- ``declarations``: what a model declares about itself (sharding units, experts, widths).
"""
