"""The peak of tensor memory in one training step on CPU, where no allocator keeps a
high-water mark (CUDA's ``torch.cuda.max_memory_allocated`` is that figure on a GPU).

Measured with torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``), a dispatch
mode that sees every tensor an operator creates and every storage freed, and sorts them as
parameters, gradients, optimizer state, activations and temporaries. Written by hand here is
only the window: the tracker is told of the module and optimizers, which exist before the
step, and is entered at the step's start and left at its end. Tensors that no operator in the
window touches and that are neither (a data loader's prefetched batches) are not counted.
The tracker slows the step it watches, so only a run that asks for it pays
(``callbacks.memory.measure_peak=true``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer

from litscale.measure.tensor_bytes import torch_optimizer

TOTAL = "Total"


class StepPeak:
    """``enter(module, optimizers)`` at a step's start, ``leave()`` at its end; then ``peak``:
    bytes of tensors live at the step's high-water mark on ``device``.

    NOTE: the total only. The tracker also sorts bytes by kind, but Lightning runs the forward
    and backward inside ``optimizer.step(closure)``, which the tracker takes for the optimizer's
    own work: nearly everything would be called optimizer state."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.peak: int | None = None
        self._tracker = None

    def enter(self, module: torch.nn.Module, optimizers: Iterable[Optimizer]) -> None:
        self._tracker = total_only_tracker()
        self._tracker.track_external(module, *(torch_optimizer(o) for o in optimizers))
        self._tracker.__enter__()

    def leave(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return
        tracker.__exit__(None, None, None)
        snapshot = tracker.get_tracker_snapshot("peak").get(self.device, {})
        self.peak = int(snapshot.get(TOTAL, 0))

    @property
    def active(self) -> bool:
        return self._tracker is not None


def total_only_tracker():
    """A MemTracker that keeps the total alone. MemTracker also keeps figures per module, from
    hooks on every module's forward and backward, which are not read here and cost twice: it
    refuses a module that runs forward twice in the window (a pipeline stage runs once per
    micro-batch), and it walks every module's figures at each operator (minutes for a model of
    thousands of expert modules). Its module hooks are left out; the total is kept from tensors'
    storages, each counted once, whatever module they pass through."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class TotalOnlyTracker(MemTracker):
        window_peak: int | None = None  # the largest total since ``open_window``; None: not watched

        def current_total(self) -> int:
            return sum(snapshot.get(TOTAL, 0) for snapshot in self._curr_mem_snap.values())

        def open_window(self) -> int:
            """Start watching for a part of the step's own peak; returns the total now."""
            self.window_peak = self.current_total()
            return self.window_peak

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            if self.window_peak is not None:
                self.window_peak = max(self.window_peak, self.current_total())

        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    return TotalOnlyTracker()
