"""The planted defects: for each promise litscale makes (parity with one process, a move
between layouts, a resume, a refusal, a save), a realistic defect that breaks it, planted at
run time by replacing one function (``plant.py``), and the tests of ``make test`` or ``make
test-full`` that must fail with it in. ``make mutants`` (``run.py``) runs each row's tests with
its defect and writes the table in ``tests/README.md``.

Each ``wrap`` takes the original function and returns its replacement; it imports what it
needs inside (this file is loaded at the start of every interpreter, before torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """One planted defect: its name, what it breaks (as a sentence), the function it replaces
    (``module:Qualified.name``), how (``wrap``), and the pytest node ids that must fail."""

    name: str
    defect: str
    target: str
    wrap: Callable[[Callable], Callable]
    tests: tuple[str, ...]


# --- the defects' replacements ------------------------------------------------------------------


def _scaled_loss(factor: float):
    """A strategy's ``backward(closure_loss, ...)`` on the loss times ``factor``: every
    gradient of the step scaled by it (a loss divided twice, a mean taken over the wrong count)."""

    def wrap(original):
        def backward(self, closure_loss, *args, **kwargs):
            return original(self, closure_loss * factor, *args, **kwargs)

        return backward

    return wrap


def _ddp_summed_not_averaged(original):
    """DDP's gradient all-reduce as a sum, not a mean: every gradient times the world size."""

    def register(self):
        original(self)
        if self.compression is None:
            self.model.register_comm_hook(None, _sum_hook)

    return register


def _sum_hook(state, bucket):
    import torch.distributed as dist

    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


# --- the catalog --------------------------------------------------------------------------------

PARITY = "tests/test_parity.py::test_strategy_matches_one_process_step_by_step"
COMBINATIONS = "tests/test_combinations.py::test_a_sample_of_accepted_combinations_trains_and_matches_one_process"

_ROWS = [
    Mutant("ddp-sum-not-mean", "DDP sums the ranks' gradients instead of averaging them (every gradient x 2 on 2 "
           "ranks)", "litscale.strategies.ddp:DDPStrategy._register_ddp_hooks", _ddp_summed_not_averaged,
           (f"{PARITY}[ddp-2ranks-sgd]",)),
    Mutant("combination-ddp-gradient-halved", "under DDP every gradient is half what it should be: the combination "
           "sample, with its defaults (AdamW, norm clipping)", "litscale.strategies.ddp:DDPStrategy.backward",
           _scaled_loss(0.5), (COMBINATIONS,)),
    Mutant("fsdp-gradient-halved", "under FSDP every gradient is half what it should be",
           "litscale.strategies.fsdp:FSDPStrategy.backward", _scaled_loss(0.5),
           (f"{PARITY}[fsdp_reshard-2ranks-sgd]",)),
]
MUTANTS = {mutant.name: mutant for mutant in _ROWS}
