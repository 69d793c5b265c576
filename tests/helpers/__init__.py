"""Harnesses the test modules share, so that no test module imports another.

- ``configs``: composing ``conf/`` as ``train.py`` and a job see it.
- ``distributed``: running a function on several gloo ranks (``run_distributed``).
- ``cli``: running ``train.py`` as a user would, and reading what a run leaves behind.
- ``parity``: a strategy on N ranks against one process on the same global batches.
- ``strategies``: litscale strategies built inside a rank, from picklable factories.
- ``checkpoints``: checkpoint layouts written for real, for the resolution tests.
"""
