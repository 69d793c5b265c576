"""The Hydra application behind ``train.py``: the only package of litscale that imports
``hydra`` or ``omegaconf``.

A run goes: ``preflight`` (every job of the command line checked before Hydra writes
anything; a cluster launcher answers for its own jobs) -> ``checks`` (``validate``: each field
and combination, in one sequence; the run layout computed once) -> ``run`` (the run described
once as the planner reads it, ``plan/description``, and its prediction made, ``plan/runs``)
-> ``launch`` (the ranks; ``replica_launch`` for replica groups) -> on each rank ``build``
(objects from ``_target_``s) -> fit -> ``summary``. ``plan/`` is ``plan=show|auto`` (the
planner ranks layouts and verifies its pick); ``scaling_study`` and ``report`` compare runs of
a sweep. Everything these modules build (strategies, compression, callbacks, models, data) is
the library outside this package, usable in a plain Lightning script.
"""

from litscale.app import resolvers  # noqa: F401  (registers the configs' resolvers)
