"""DeepSpeed ZeRO stages 1/2/3 as a Lightning strategy, on CUDA and on CPU.

Lightning's ``DeepSpeedStrategy`` drives ``deepspeed.initialize`` inside the fit loop, saves
DeepSpeed checkpoints and maps Lightning's precision to DeepSpeed's config; it refuses CPU
only by a check in ``setup_environment`` (and a device-index check that CPU devices, which
have no index, cannot pass). DeepSpeed itself trains on CPU with ``DS_ACCELERATOR=cpu`` and
gloo, so this subclass lifts those two checks, sets the variable before DeepSpeed is first
imported, and exposes the ZeRO options as typed, validated keys. ``deepspeed`` is imported
only once a run uses this strategy (Lightning's constructor imports it eagerly; this one
does not, so the pre-flight check stays fast).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy
from torch import nn
from typing_extensions import override

from litscale.arguments import checked_arguments
from litscale.checkpoint.strategy_checkpointing import StrategyCheckpointing
from litscale.constraints import PositiveInt
from litscale.extras import DEEPSPEED
from litscale.optim.muon import Muon
from litscale.parallel.contract import Option, SettingRefusal, StrategyContract, refusal_line
from litscale.parallel.declarations import declared
from litscale.parallel.layout import MeshSizes
from litscale.parallel.sharding import Sharding
from litscale.precision import PrecisionDtypes
from litscale.strategies.fully_shard import norms_with_running_statistics
from litscale.strategies.lifecycle import destroy_process_group_at_exit
from litscale.strategies.zero_muon import MUON_CONDITIONS, deepspeed_muon, why_not_muon

_DEEPSPEED_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_offload(stage: int, offload_optimizer: bool, offload_parameters: bool) -> None:
    """DeepSpeed offloads optimizer state (ZeRO-Offload) from stage 1 on, parameters only at
    stage 3 (ZeRO-Infinity); raise a one-line ``ValueError`` for anything else."""
    if offload_parameters and stage != 3:
        raise ValueError(
            f"strategy.offload_parameters=true needs strategy.stage=3 (got stage {stage}): only "
            "ZeRO-3 partitions parameters; use strategy.offload_optimizer=true with stages 1-2")
    if stage not in (1, 2, 3):
        raise ValueError(f"strategy.stage={stage} is not valid: expected one of 1, 2, 3")


# NOTE: found training model=moe: the engine releases an expert weight that the MoE layer's
# backward then reads. Refused up front (and never planned) until it trains.
ZERO3_MIXTURE_OF_EXPERTS = ("DeepSpeed's ZeRO-3 does not train a mixture of experts yet (its backward reads an "
                            "expert weight the engine has released: \"The size of tensor a (0) must match the "
                            "size of tensor b (64)\")")


# NOTE: found by the combination test: LARS under ZeRO-1 on 2 ranks trained, and its second step's
# loss was 1% off one process's (5.528 against 5.585): the trust ratio took the norms of the rank's
# flat partition. Refused at every stage.
LAYERWISE_ON_PARTITIONS = ("ZeRO hands the optimizer flat partitions of the parameters, so a layer-wise trust "
                           "ratio would take the norms of a partition, not of each weight tensor")


# NOTE: DeepSpeed's ZeRO-3 orthogonalises in its sub-group loop, which no parity test here checks.
ZERO3_MUON = ("ZeRO hands the optimizer flat partitions of the parameters, and litscale hands Muon's whole "
              "matrices to DeepSpeed's ZeRO Muon at stages 1 and 2 only")


def check_no_running_statistics_in_16_bit(net: nn.Module, dtypes: PrecisionDtypes | None) -> None:
    """NOTE: DeepSpeed's bf16/fp16 engine casts the parameters to 16 bits but leaves BatchNorm's
    running statistics in fp32, and the first forward fails ("expected scalar type BFloat16 but
    found Float", seen at ZeRO-3 with precision=bf16_mixed on model=resnet): refused up front."""
    if dtypes is None or dtypes.compute == torch.float32:
        return
    norm = next(iter(norms_with_running_statistics(net)), None)
    if norm is not None:
        raise ValueError(f"strategy=deepspeed_zero with a {str(dtypes.compute).removeprefix('torch.')} precision: "
                         f"the network's {type(norm).__name__} keeps fp32 running statistics, which DeepSpeed's "
                         "16-bit engine does not cast; allowed: precision=fp32 with this model, or strategy=ddp "
                         "or fsdp in 16 bits")


def zero_sharding(stage: int, *, contiguous_gradients: bool = True, overlap_comm: bool = True,
                  reduce_bucket_size: int = 200_000_000) -> Sharding:
    """ZeRO stage ``stage``; DeepSpeed's ZeRO optimizers keep an fp32 partition of the weights,
    even in fp32. With contiguous gradients they also keep a reduction bucket (stages 1-2: two
    with ``overlap_comm``; stage 1's in fp32), as ``setup_buckets`` in
    deepspeed/runtime/zero/stage_1_and_2.py and ``stage3.py``'s IPG buffer allocate them."""
    buffers = 0 if not contiguous_gradients else 1 if stage == 3 or not overlap_comm else 2
    return Sharding(zero_stage=stage, fp32_master_copy=True, reduce_buffers=buffers,
                    reduce_bucket_elements=reduce_bucket_size, reduce_buffer_bytes=4 if stage == 1 else 0)


class DeepSpeedZeroStrategy(StrategyContract, StrategyCheckpointing, LightningDeepSpeedStrategy):
    """ZeRO-1 (optimizer state sharded), ZeRO-2 (+ gradients) or ZeRO-3 (+ parameters).

    Precision comes from the Trainer's ``precision`` (Lightning writes DeepSpeed's
    ``bf16``/``fp16`` sections); ``precision_dtypes`` (the ``precision`` group) adds the
    gradient-communication dtype, so ``bf16_mixed`` reduces gradients in fp32.
    """

    # NOTE: DeepSpeed's ZeRO optimizer steps only the flat, partitioned gradient buffers its own
    # backward hooks fill (bucketed reduce or reduce-scatter, in its order); it has no public way
    # to take a gradient computed elsewhere, so the fixed tree's sum cannot replace its reduction.
    refuses = {Option.LAYOUT_INVARIANT: "DeepSpeed's engine reduces gradients in its own backward hooks into the "
               "partitioned buffers its optimizer steps, and takes no gradient summed outside them",
               Option.ASYNC_SAVE: "DeepSpeed's engine writes its own partitioned checkpoint files, on the training thread",
               Option.LAYERWISE_OPTIMIZER: LAYERWISE_ON_PARTITIONS}
    requires = (DEEPSPEED,)
    conditions = {Option.MATRIX_OPTIMIZER: MUON_CONDITIONS}
    untraced = "its engine is not built on the fake process group the check traces on (it flattens the parameters into buffers on its device)"
    phase_collectives = {"backward": "gradient reduction", "optimizer": "parameter all-gather"}
    shares_checkpoint_formats = False  # its own partitioned files, which only DeepSpeed reads
    keeps_gradients_apart = True  # in ZeRO's partitions: its engine's norm is logged
    steps_muon = False  # DeepSpeed's ZeRO Muon steps the optimizer (set when the engine is built)

    @checked_arguments("strategy")
    def __init__(
        self,
        *,
        stage: Literal[1, 2, 3] = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        precision_dtypes: PrecisionDtypes | None = None,
        overlap_comm: bool = True,
        contiguous_gradients: bool = True,
        reduce_bucket_size: PositiveInt = 200_000_000,
        allgather_bucket_size: PositiveInt = 200_000_000,
        partition_activations: bool = False,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: PositiveInt = 1800,
    ) -> None:
        check_offload(stage, offload_optimizer, offload_parameters)
        # NOTE: Lightning's DeepSpeedStrategy.__init__ imports deepspeed (seconds, and before
        # DS_ACCELERATOR can be set for a CPU run); its config builder is reused instead.
        LightningDDPStrategy.__init__(
            self, process_group_backend=process_group_backend, timeout=timedelta(seconds=timeout_s))
        self._timeout = timedelta(seconds=timeout_s)
        self.stage = stage
        self.precision_dtypes = precision_dtypes
        self.config = self._create_default_config(
            zero_optimization=True, zero_allow_untested_optimizer=True,
            logging_batch_size_per_gpu="auto", partition_activations=partition_activations,
            cpu_checkpointing=False, contiguous_memory_optimization=False,
            synchronize_checkpoint_boundary=False, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, nvme_path="/local_nvme",
            offload_params_device="cpu", params_buffer_count=5, params_buffer_size=100_000_000,
            max_in_cpu=1_000_000_000, offload_optimizer_device="cpu", optimizer_buffer_count=4,
            pin_memory=False, block_size=1048576, queue_depth=8, single_submit=False,
            overlap_events=True, thread_count=1, stage=stage,
            contiguous_gradients=contiguous_gradients, overlap_comm=overlap_comm,
            allgather_partitions=True, reduce_scatter=True,
            allgather_bucket_size=allgather_bucket_size, reduce_bucket_size=reduce_bucket_size,
            sub_group_size=1_000_000_000_000,
        )
        # DeepSpeed refuses offload with any optimizer but its compiled CPU Adam unless told
        # otherwise; litscale's optimizers are torch's, built by the LightningModule, and a
        # compiled extension is not there on every machine. The torch optimizer then steps the
        # fp32 partitions on the CPU (slower than DeepSpeed's, the same result).
        self.config["zero_force_ds_cpu_optimizer"] = False
        self._config_initialized = False
        self.remote_device = None
        self.load_full_weights = False
        self.exclude_frozen_parameters = False
        self.loss_scale, self.initial_scale_power, self.loss_scale_window = 0, 16, 1000
        self.hysteresis, self.min_loss_scale = 2, 1

    @classmethod
    def candidate_meshes(cls, *, world_size: int, nodes: int, devices_per_node: int,
                         context_sizes: Sequence[int]) -> list[tuple[dict[str, Any], MeshSizes]]:
        """Each ZeRO stage over every rank (the planner's layouts)."""
        return [({"stage": stage}, MeshSizes(data_shard=world_size)) for stage in (1, 2, 3)]

    def resolve_mesh(self, world_size: int) -> MeshSizes:
        """Every rank holds a shard (of the optimizer state, gradients, parameters: by stage)
        and sees distinct samples."""
        return MeshSizes(data_shard=world_size)

    def why_not(self, option: Option) -> str | None:
        if option is Option.MIXTURE_OF_EXPERTS and self.stage == 3:
            return ZERO3_MIXTURE_OF_EXPERTS
        if option is Option.MATRIX_OPTIMIZER and self.stage == 3:
            return ZERO3_MUON
        return super().why_not(option)

    def why_not_with(self, option: Option, settings: Mapping[str, Any]) -> SettingRefusal | None:
        """Muon at stages 1-2 is DeepSpeed's ZeRO Muon, which takes some of Muon's settings only."""
        if option is Option.MATRIX_OPTIMIZER:
            return why_not_muon(settings)
        return None

    def validate_setup(self, *, world_size: int, net: nn.Module, seq_len: int | None = None,
                       micro_batch: int | None = None) -> None:
        """Pre-flight: ZeRO-3 cannot train a network with experts (one that declares them), and
        DeepSpeed's 16-bit engine no network with BatchNorm statistics."""
        check_no_running_statistics_in_16_bit(net, self.precision_dtypes)
        if self.stage == 3 and declared(net, "expert_modules") is not None:
            raise ValueError(refusal_line(Option.MIXTURE_OF_EXPERTS, "deepspeed_zero strategy.stage=3",
                                          ZERO3_MIXTURE_OF_EXPERTS))

    @override
    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            # Read once, when deepspeed is first imported: must precede that import.
            os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed

        deepspeed.utils.logging.logger.setLevel(logging.WARNING)
        LightningDDPStrategy.setup_environment(self)  # skips Lightning's CUDA-only check
        destroy_process_group_at_exit()

    @override
    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        if not isinstance(self.accelerator, CPUAccelerator):
            return super().setup_distributed()  # CUDA: Lightning's device-index check applies
        reset_seed()
        self.set_world_ranks()
        skip_shared_memory_all_reduce_build()
        self._init_deepspeed_distributed()

    @override
    def teardown(self) -> None:
        super().teardown()
        restore_torch_linear()
        forget_deepspeed_groups()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's backward through DeepSpeed's engine, the loss divided once for accumulation.

        NOTE: Lightning's loop already divides each micro batch's loss by
        ``accumulate_grad_batches``, and the engine's ``backward`` divides it again by its
        ``gradient_accumulation_steps`` (which Lightning sets to the same number): gradients came
        out ``accumulate_grad_batches`` times too small (SGD's parity at accumulation 2 failed by
        4.6e-3 in the second step's loss). The engine's own division is switched off."""
        return super().backward(closure_loss, optimizer, *args, scale_wrt_gas=False, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """DeepSpeed's step; at the end of an accumulation window, ``train/grad_norm`` as its
        engine took it (the gradient before clipping, unscaled): ZeRO keeps the gradients in its
        own partitions, so the module's norm of ``.grad`` would see none.

        NOTE: none under Muon: DeepSpeed's ZeRO Muon takes its norm over the orthogonalised
        updates it clips, not over the gradients, and no other is at hand."""
        from litscale.loggers import is_logging_step

        stepping = self.model.is_gradient_accumulation_boundary() and not self.steps_muon
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        norm = self.model.get_global_grad_norm() if stepping else None
        if norm is not None and is_logging_step(self.lightning_module.trainer):
            self.lightning_module.log("train/grad_norm", float(norm))
        return result

    @override
    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        """Lightning's call, with a device rank DeepSpeed accepts on CPU (a CPU device has no
        index; DeepSpeed compares it with 0)."""
        import deepspeed

        device_rank = self.root_device.index if self.root_device.index is not None else self.local_rank
        # DeepSpeed allocates its reduction buckets whole (2 x 200M elements by default: 1.6 GB
        # in fp32), whatever the model: a bucket larger than the rank's parameters is memory no
        # reduction uses, so it is cut to them (the planner counts the same, Sharding.reduce_*).
        zero = self.config["zero_optimization"]
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            zero[key] = max(1, min(int(zero[key]), params))
        self.steps_muon = isinstance(optimizer, Muon)
        if self.steps_muon:
            optimizer, lr_scheduler = deepspeed_muon(optimizer, lr_scheduler)
        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=device_rank), config=self.config, model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False,
        )
        return engine, deepspeed_optimizer

    @override
    def _format_config(self) -> None:
        super()._format_config()
        if self.precision_dtypes is not None and self.precision_plugin.precision != "32-true":
            self.config["communication_data_type"] = _DEEPSPEED_DTYPE[self.precision_dtypes.reduce]

    @property
    def sharding(self) -> Sharding:
        zero = self.config["zero_optimization"]
        return zero_sharding(self.stage, contiguous_gradients=zero["contiguous_gradients"],
                             overlap_comm=zero["overlap_comm"], reduce_bucket_size=zero["reduce_bucket_size"])

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state, read from DeepSpeed's
        own partitioned buffers (see ``litscale.callbacks.memory``)."""
        return zero_memory_bytes(self.deepspeed_engine, self.stage)


def skip_shared_memory_all_reduce_build() -> None:
    """Start DeepSpeed's CPU communication backend without its shared-memory all-reduce op.

    NOTE: on CPU, DeepSpeed's ``TorchBackend`` JIT-compiles that C++ op at every process-group
    start (``deepspeed.comm.torch.build_shm_op``): 10 s to a minute of each run's start, under a
    file lock in the torch extensions cache that a compile killed midway leaves behind, after
    which every later DeepSpeed run on the machine waits on it for ever (seen: ranks in
    ``FileBaton.wait`` for 20 minutes). Only ``inference_all_reduce`` uses the op; training's
    collectives are torch.distributed's. Its own switch is the op's compatibility probe, so the
    builder function is replaced."""
    # NOTE: by import_module: ``deepspeed.comm``'s attribute ``torch`` is the torch package.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def restore_torch_linear() -> None:
    """Put torch's ``torch.nn.functional.linear`` back where DeepSpeed left its own.

    NOTE: ZeRO-3's ``zero.Init`` (which Lightning enters around ``configure_model``) swaps
    ``F.linear`` for DeepSpeed's memory-efficient autograd function and leaves it swapped after
    the run ("This will persist unless manually reset", its log says). Every later model in the
    process then sums a bias's gradient in another order: on the test suite's reused ranks, runs
    after a ZeRO-3 one differed in the last bit from the same runs in a new process (and so would
    a job run in the same process after a ZeRO-3 job of a sweep)."""
    import sys

    partition = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(partition, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None and torch.nn.functional.linear is not original:
        torch.nn.functional.linear = original


def forget_deepspeed_groups() -> None:
    """Drop the process groups DeepSpeed keeps for the rest of the process.

    NOTE: DeepSpeed clones the world group once per process (``deepspeed.utils.groups``, on the
    first engine's broadcast) and forgets it only when the world is destroyed through
    ``deepspeed.comm``, which a Lightning run does not use. The run's process group is
    destroyed at its end, so a later DeepSpeed run in the same process (the next one-device job
    of a sweep, which runs in the sweep's process) broadcast on the dead clone: "Group ... is
    not registered". Every rank tears down, so every rank clones anew."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups._release_process_group_references()  # what deepspeed.comm's destroy would do


def _flat(tensors: Any) -> list[torch.Tensor]:
    """Tensors from DeepSpeed's containers (lists, dicts of lists, None)."""
    if tensors is None:
        return []
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, dict):
        tensors = list(tensors.values())
    return [t for item in tensors for t in _flat(item)]


def zero_memory_bytes(engine: Any, stage: int) -> dict[str, int]:
    """Bytes per rank in a DeepSpeed engine. The module's parameters are DeepSpeed's own
    16-bit (or fp32) groups: full at stages 1-2, and at stage 3 empty placeholders whose
    partition is ``ds_tensor``. Gradients are the module's ``.grad`` (stage 1 keeps them
    whole until the step) plus the reduced partitions; the optimizer holds the fp32 master
    partition and the wrapped optimizer's state."""
    from litscale.measure.tensor_bytes import optimizer_state_tensors, storage_bytes

    zero = engine.optimizer
    params = list(engine.module.parameters())
    if stage == 3:
        param_tensors = [p.ds_tensor for p in params]
        grad_tensors = _flat(getattr(zero, "averaged_gradients", None)) + _flat(
            getattr(zero, "grad_partitions_flat_buffer", None))
        master = _flat(zero.fp32_partitioned_groups_flat)
    else:
        param_tensors = params
        grad_tensors = [p.grad for p in params] + _flat(getattr(zero, "averaged_gradients", None)) \
            + _flat(getattr(zero, "grads_in_partition", None))
        master = _flat(zero.single_partition_of_fp32_groups)
    return {
        "memory/params_bytes": storage_bytes(param_tensors),
        "memory/grads_bytes": storage_bytes(grad_tensors),
        "memory/optimizer_bytes": storage_bytes(master + optimizer_state_tensors(zero.optimizer)),
        "memory/optimizer_master_bytes": storage_bytes(master),  # part of optimizer_bytes
    }
