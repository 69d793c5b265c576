"""The Hydra application behind ``train.py``: the only package of litscale that imports
``hydra`` or ``omegaconf``.

A run goes: ``preflight`` (every job of the command line checked before Hydra writes
anything) -> ``validation`` (each field and combination; the run layout computed once) ->
``launch`` (the ranks) -> on each rank ``build`` (objects from ``_target_``s) -> fit ->
``summary``. ``scaling_study`` and ``report`` compare runs of a sweep. Everything these
modules build (strategies, compression, callbacks, models, data) is the library outside
this package, usable in a plain Lightning script.
"""

from litscale.app import resolvers  # noqa: F401  (registers the configs' resolvers)
