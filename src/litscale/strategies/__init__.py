"""Lightning Strategy subclasses, usable in any Lightning script: thin, each listing the
contract (``litscale.parallel.contract``) and the checkpointing mixin
(``litscale.checkpoint.strategy_checkpointing``). FSDP, tensor and pipeline parallel share one
base (``mesh_strategy``: their ``ParallelMesh`` and the hooks they would otherwise repeat) and
one ``parallelize`` function (TP -> CP -> EP -> activation checkpointing -> FSDP), which each
pipeline stage calls too.

Importing this package registers each under a ``litscale_*`` name in Lightning's
``StrategyRegistry``, so ``Trainer(strategy="litscale_ddp")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from litscale.strategies.ddp import DDPStrategy
from litscale.strategies.deepspeed_zero import DeepSpeedZeroStrategy
from litscale.strategies.federated import FederatedStrategy
from litscale.strategies.fsdp import FSDPStrategy
from litscale.strategies.local_sgd import LocalSGDStrategy
from litscale.strategies.pipeline import PipelineParallelStrategy
from litscale.strategies.single import SingleStrategy
from litscale.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["DDPStrategy", "DeepSpeedZeroStrategy", "FSDPStrategy", "FederatedStrategy", "LocalSGDStrategy",
           "PipelineParallelStrategy", "SingleStrategy", "TensorParallelStrategy"]

_REGISTRATIONS = {
    "litscale_single": (SingleStrategy, "one process, one device"),
    "litscale_ddp": (DDPStrategy, "DDP with comm hooks on every backend and a clean exit"),
    "litscale_local_sgd": (LocalSGDStrategy, "local SGD / DiLoCo: parameters averaged every H steps"),
    "litscale_federated": (FederatedStrategy, "federated averaging (FedAvg/FedProx/FedOpt), sampled clients"),
    "litscale_fsdp": (FSDPStrategy, "FSDP2 on CPU and CUDA, sharded checkpoints at any world size"),
    "litscale_deepspeed_zero": (DeepSpeedZeroStrategy, "DeepSpeed ZeRO 1/2/3 on CPU and CUDA"),
    "litscale_tensor_parallel": (TensorParallelStrategy, "tensor parallel (+ FSDP2 data parallel)"),
    "litscale_pipeline": (PipelineParallelStrategy, "pipeline parallel (+ data and tensor parallel: 3D)"),
}
for _name, (_cls, _description) in _REGISTRATIONS.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _cls, description=_description)
