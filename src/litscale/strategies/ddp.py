"""Data parallel: DistributedDataParallel, with communication hooks on every backend."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.checkpoint.strategy_checkpointing import StrategyCheckpointing
from litscale.compression import CommHook
from litscale.constraints import PositiveFloat, PositiveInt
from litscale.parallel.contract import StrategyContract
from litscale.parallel.layout import MeshSizes
from litscale.strategies.lifecycle import destroy_process_group_at_exit


class DDPStrategy(StrategyContract, StrategyCheckpointing, LightningDDPStrategy):
    """Lightning's DDP, plus gradient-compression hooks on CPU/gloo and a clean exit.

    Lightning attaches ``ddp_comm_hook`` only when the device is CUDA; torch's DDP runs comm
    hooks on gloo too, and CPU is where every strategy is tested, so this one always
    attaches them.
    """

    refuses = {}
    averages_across_replica_groups = True
    phase_collectives = {"backward": "gradient all-reduce"}

    @checked_arguments("strategy")
    def __init__(
        self,
        *,
        compression: CommHook | None = None,
        bucket_cap_mb: PositiveFloat = 25,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: PositiveInt = 1800,
    ) -> None:
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        self.compression = compression


    def resolve_mesh(self, world_size: int) -> MeshSizes:
        """Every rank holds a full replica and sees distinct samples."""
        return MeshSizes(data_replicate=world_size)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()

    # NOTE: `_register_ddp_hooks` is a private method of Lightning's DDPStrategy, overridden
    # because it is where Lightning attaches comm hooks once the model is wrapped in DDP (and it
    # does so only on CUDA). The hook is registered through litscale's own CommHook.register.
    @override
    def _register_ddp_hooks(self) -> None:
        if self.compression is not None:
            self.compression.register(self.model)
