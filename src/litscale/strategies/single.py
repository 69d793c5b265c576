"""One process, one device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.checkpoint.strategy_checkpointing import StrategyCheckpointing
from litscale.constraints import NonNegativeInt
from litscale.parallel.contract import StrategyContract
from litscale.parallel.layout import MeshSizes


class SingleStrategy(StrategyContract, StrategyCheckpointing, SingleDeviceStrategy):
    """Lightning's single-device strategy, with the device taken from the accelerator.

    Lightning's class needs the device at construction, before the Trainer has chosen the
    accelerator; this one follows it (``cuda:<device_index>`` on GPU, else CPU).
    """

    refuses = {}  # one process: every option that runs on one device
    averages_across_replica_groups = True

    @checked_arguments("strategy")
    def __init__(self, *, device_index: NonNegativeInt = 0) -> None:
        super().__init__(device="cpu")
        self.device_index = device_index

    @property
    @override
    def root_device(self) -> torch.device:
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", self.device_index)
        return self._root_device


    @classmethod
    def candidate_meshes(cls, *, world_size: int, nodes: int, devices_per_node: int,
                         context_sizes: Sequence[int]) -> list[tuple[dict[str, Any], MeshSizes]]:
        """None: one process is data parallel over one rank, which the planner ranks as
        ``strategy=ddp``."""
        return []

    def resolve_mesh(self, world_size: int) -> MeshSizes:
        """One process: every mesh dimension has size 1."""
        return MeshSizes()
