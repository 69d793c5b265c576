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


# --- gradients of the wrong size -----------------------------------------------------------------


def _scaled_loss(factor: float):
    """A strategy's ``backward(closure_loss, ...)`` on the loss times ``factor``: every
    gradient of the step scaled by it (a loss divided twice, a mean taken over the wrong count)."""

    def wrap(original):
        def backward(self, closure_loss, *args, **kwargs):
            return original(self, closure_loss * factor, *args, **kwargs)

        return backward

    return wrap


def _scaled_loss_under_context_parallel(original):
    """FSDP's backward on each rank's loss divided by the context-parallel size, as if a rank's
    loss were its share of the sequence's sum (it is already the mean over its own tokens)."""

    def backward(self, closure_loss, *args, **kwargs):
        return original(self, closure_loss / self.context_parallel_size, *args, **kwargs)

    return backward


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


def _engine_divides_again(original):
    """ZeRO's backward through DeepSpeed's engine with the engine's own division by
    ``gradient_accumulation_steps`` left on, after Lightning's loop divided the loss already
    (the accumulation defect ZeRO had: the gradient ``accumulate_grad_batches`` times too small)."""

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy.backward(self, closure_loss, optimizer, *args, **kwargs)

    return backward


def _pipeline_mean_taken_twice(original):
    """The pipeline's gradients divided by the number of micro-batches before they are handed
    back, though torch's schedule already averages them over the micro-batches."""

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        self._stashed = [(param, grad / self.microbatches) for param, grad in getattr(self, "_stashed", [])]
        return original(self, closure_loss, optimizer, *args, **kwargs)

    return backward


def _experts_divided_by_expert_data_ranks(original):
    """The experts' gradient divided by their expert-data ranks only (FSDP's own mean), not by
    every data rank: each rank's expert gradient already sums its expert-parallel peers' tokens,
    so it comes out ``expert_parallel_size`` times too large."""

    def apply_expert_parallel(module, expert_mesh, expert_data_mesh, **options):
        from litscale.parallel.declarations import find_expert_modules

        original(module, expert_mesh, expert_data_mesh, **options)
        if expert_mesh.size() > 1:
            for experts in find_expert_modules(module):
                experts.set_gradient_divide_factor(expert_data_mesh.size())

    return apply_expert_parallel


def _replica_groups_summed(original):
    """The gradients reduced over the replica groups with a sum, not torchft's mean."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        import torch
        from torch.distributed import ReduceOp

        from litscale.reliability.replica_groups import _local

        grads = [_local(p.grad) for p in pl_module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)

    return on_before_optimizer_step


def _overlapped_sum_not_mean(original):
    """A one-process replica group's gradients, summed over the groups bucket by bucket during
    backward, taken for their mean (not divided by the groups)."""

    def finish(self, participants):
        return original(self, 1)

    return finish


def _average_not_divided(original):
    """Local SGD's synchronisation all-reduces each fragment's parameters without dividing them
    by the world size first (``average_parameters`` divides before its all-reduce; this one
    forgot): the replicas' sum taken for their mean."""

    def start(self, params, fragment, *, due):
        import torch.distributed as dist
        from torch.nn.utils import parameters_to_vector

        from litscale.strategies.streaming import InFlight

        if self.outer_dtype != "fp32":
            return original(self, params, fragment, due=due)
        flat = parameters_to_vector(self._members(params, fragment))
        self._count(flat.numel() * flat.element_size())
        return InFlight(fragment, due, quantized=False, works=[dist.all_reduce(flat, group=self.group, async_op=True)],
                        decode=lambda: flat)

    return start


def _proximal_term_without_its_half(original):
    """FedProx's proximal term written without its 1/2: its gradient ``2 mu (w - w_global)``."""

    def proximal_term(params, anchor, mu):
        return 2 * original(params, anchor, mu)

    return proximal_term


def _norm_all_reduced_twice(original):
    """The gradient norm across the mesh with its all-reduce issued twice: the summed squares
    counted ``world size`` times, so the logged norm (and what clipping divides by) is
    ``sqrt(world size)`` times too large. (Planted as that effect on the original's result,
    rather than a copy of its body with the second call.)"""

    def gradient_norm_across_mesh(parameters, *, ranks_per_stage):
        import torch.distributed as dist

        norm = original(parameters, ranks_per_stage=ranks_per_stage)
        return norm * dist.get_world_size() ** 0.5 if dist.is_initialized() else norm

    return gradient_norm_across_mesh


# --- mixture of experts, batch norm, learning rates ------------------------------------------------


def _load_not_summed_over_ranks(original):
    """The routers' load handed to the bias update without its all-reduce over the ranks: each
    rank moves its experts' biases by its own tokens, and the ranks drift apart."""

    def summed_over_ranks(load):
        return load

    return summed_over_ranks


def _balance_loss_dropped(original):
    """The training step takes the MoE balance loss from the network and returns the language
    model's loss without it."""

    def training_step(self, batch, batch_idx):
        from litscale.modules import TaskModule

        loss = TaskModule.training_step(self, batch, batch_idx)
        take_auxiliary = getattr(self.net, "auxiliary_loss", None)
        if take_auxiliary is not None:
            take_auxiliary()
        return loss

    return training_step


def _statistics_not_carried(original):
    """Layout-invariant mode's chunks' mean running statistics never copied into the network."""

    def carry_statistics(self, net, means):
        return None

    return carry_statistics


def _lr_scaled_twice(original):
    """The LR-scaling rule applied again to the LR it had already scaled."""

    def setup(self, trainer, pl_module, stage):
        from litscale.optim.lr_scaling import scaled_lr

        original(self, trainer, pl_module, stage)
        if self.lr is not None:
            self.lr = scaled_lr(self.lr, global_batch=self.global_batch, base_batch_size=self.base_batch_size,
                                rule=self.rule)
            pl_module.optimizer_factory.lr = self.lr

    return setup


def _router_as_hidden(original):
    """µP's roles with a router (a matrix whose fan-in alone grows) taken for a hidden matrix:
    its init multiplier ``1/sqrt(m)``, not a readout's ``1/m``."""

    def role(param, fan_in, fan_out, outputs):
        found = original(param, fan_in, fan_out, outputs)
        return "hidden" if found == "readout" else found

    return role


def _attention_counted_whole(original):
    """A packed row's attention counted over the whole row (``T ** 2`` pairs), its documents'
    lengths ignored: MFU and the planner overcount a packed run's FLOPs."""

    def counted(net, example, tokens_per_sample, attended_length=None):
        return original(net, example, tokens_per_sample)

    return counted


# --- moves, resumes, data, exports, compression, saves ----------------------------------------------


def _moments_rotated(original):
    """A DeepSpeed checkpoint read as a file with each parameter's moments keyed one position
    on: every parameter takes its neighbour's Adam moments."""

    def deepspeed_as_file_checkpoint(path):
        checkpoint = original(path)
        state = checkpoint["optimizer_states"][0]["state"]
        positions = sorted(state)
        checkpoint["optimizer_states"][0]["state"] = {
            position: state[positions[(index + 1) % len(positions)]] for index, position in enumerate(positions)}
        return checkpoint

    return deepspeed_as_file_checkpoint


def _resume_one_micro_batch_behind(original):
    """A resume that starts each rank one micro batch before where the checkpoint stopped (the
    batch in flight at the save counted as not trained): that batch is trained twice."""

    def resume_point(self, num_replicas):
        point = original(self, num_replicas)
        if point is None or point[1] == 0:
            return point
        return point[0], point[1] - self.batch_size

    return resume_point


def _behind_group_trains_on(original):
    """A replica group that fell behind never asks whether the run has ended without it: back
    after the others finished, it trains the last steps alone in a quorum of itself."""

    def ended(self):
        original(self)  # read, as ever, then ignored
        self._ended_without_us = None
        return False

    return ended


def _groups_ranks_overlap(original):
    """A replica group's ranks numbered from the group's index, not from its first rank over
    the groups (group ``g``'s rank ``r`` is ``g + r``): neighbouring groups draw the same
    samples, and some samples are drawn by no rank."""

    def train_replicas(self):
        num_replicas, rank = self.replicas()
        group, groups = self.replica_group
        return num_replicas * groups, group + rank

    return train_replicas


def _rng_restored_at_load(original):
    """The RNG state restored as soon as the checkpoint is loaded, not before the first resumed
    batch: the loader's iterators then draw from it, and the dropout masks are not the
    uninterrupted run's."""

    def load_state_dict(self, state_dict):
        from litscale.callbacks.rng_state import restore_rng_state

        original(self, state_dict)
        if self._pending is not None:
            restore_rng_state(self._pending)
            self._pending = None

    return load_state_dict


def _export_of_the_local_shard(original):
    """A DTensor network exported as each rank's local shards (``to_local``), not gathered whole."""

    def rank_state_dict(trainer, module, **options):
        from torch.distributed.tensor import DTensor

        net = getattr(module, "net", module)
        if not any(isinstance(p, DTensor) for p in net.parameters()):
            return original(trainer, module, **options)
        return {name: (value.to_local() if isinstance(value, DTensor) else value).detach().cpu().clone()
                for name, value in net.state_dict().items()}

    return rank_state_dict


def _residual_dropped(original):
    """Error feedback skipped: the residual of earlier steps neither added nor kept."""

    def encode(state, bucket):
        keep, state.error_feedback = state.error_feedback, False
        try:
            return original(state, bucket)
        finally:
            state.error_feedback = keep

    return encode


def _published_before_its_last_file(original):
    """A sharded save made visible once its shards are written: the staged directory is swapped
    in, then rank 0 writes the checkpoint's last file (``meta.pt``) into the published one."""

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        import os

        import torch

        from litscale.checkpoint import strategy_checkpointing
        from litscale.checkpoint.atomic import staging_path

        path = os.path.abspath(str(filepath))
        staging, save, publish, published = staging_path(path), torch.save, strategy_checkpointing.publish, []

        def save_into_published(obj, file, *args, **kwargs):
            if isinstance(file, str | os.PathLike) and os.path.dirname(os.path.abspath(file)) == staging:
                publish(staging, path)
                published.append(path)
                file = os.path.join(path, os.path.basename(file))
            return save(obj, file, *args, **kwargs)

        def publish_once(staged, target, **options):
            if not published:
                publish(staged, target, **options)

        torch.save, strategy_checkpointing.publish = save_into_published, publish_once
        try:
            return original(self, checkpoint, filepath, storage_options)
        finally:
            torch.save, strategy_checkpointing.publish = save, publish

    return save_checkpoint


# --- the catalog --------------------------------------------------------------------------------

PARITY = "tests/test_parity.py::test_strategy_matches_one_process_step_by_step"
COMBINATIONS = "tests/test_combinations.py::test_a_sample_of_accepted_combinations_trains_and_matches_one_process"

_ROWS = [
    # A gradient of the wrong size, strategy by strategy.
    Mutant("ddp-sum-not-mean", "DDP sums the ranks' gradients instead of averaging them (every gradient x 2 on 2 "
           "ranks)", "litscale.strategies.ddp:DDPStrategy._register_ddp_hooks", _ddp_summed_not_averaged,
           (f"{PARITY}[ddp-2ranks-sgd]",)),
    Mutant("combination-ddp-gradient-halved", "under DDP every gradient is half what it should be: the combination "
           "sample, with its defaults (AdamW, norm clipping)", "litscale.strategies.ddp:DDPStrategy.backward",
           _scaled_loss(0.5), (COMBINATIONS,)),
    Mutant("fsdp-gradient-halved", "under FSDP every gradient is half what it should be",
           "litscale.strategies.fsdp:FSDPStrategy.backward", _scaled_loss(0.5),
           (f"{PARITY}[fsdp_reshard-2ranks-sgd]",)),
    Mutant("zero1-gradient-summed", "under ZeRO-1 each rank's loss is multiplied by the world size (a sum over the "
           "ranks' micro batches taken for their mean): every gradient x 2",
           "litscale.strategies.deepspeed_zero:DeepSpeedZeroStrategy.backward", _scaled_loss(2.0),
           (f"{PARITY}[zero1-2ranks-sgd]",)),
    Mutant("zero2-gradient-halved", "under ZeRO-2 each rank's loss is divided by the world size again: every "
           "gradient / 2", "litscale.strategies.deepspeed_zero:DeepSpeedZeroStrategy.backward", _scaled_loss(0.5),
           (f"{PARITY}[zero2-2ranks-sgd]",)),
    Mutant("zero3-gradient-halved", "under ZeRO-3 each rank's loss is divided by the world size again: every "
           "gradient / 2", "litscale.strategies.deepspeed_zero:DeepSpeedZeroStrategy.backward", _scaled_loss(0.5),
           (f"{PARITY}[zero3-2ranks-sgd]",)),
    Mutant("tp-loss-averaged-over-tensor-ranks", "under tensor parallel the loss is divided by the tensor-parallel "
           "size, as if the TP ranks held distinct samples: every gradient / 2",
           "litscale.strategies.tensor_parallel:TensorParallelStrategy.backward", _scaled_loss(0.5),
           (f"{PARITY}[tp-2ranks-sgd]",)),
    Mutant("pp-micro-batch-mean-taken-twice", "the pipeline's gradients are divided by the number of micro-batches, "
           "which torch's schedule already averages over (every gradient / 4)",
           "litscale.strategies.pipeline:PipelineParallelStrategy.backward", _pipeline_mean_taken_twice,
           (f"{PARITY}[pp2_1f1b-2ranks-sgd]",)),
    Mutant("cp-loss-divided-by-context-ranks", "under context parallel each rank's loss, already the mean over its "
           "tokens, is divided by the context-parallel size: every gradient / 2",
           "litscale.strategies.fsdp:FSDPStrategy.backward", _scaled_loss_under_context_parallel,
           (f"{PARITY}[llama_cp2-2ranks-sgd]",)),
    Mutant("ep-experts-divided-by-expert-data-ranks", "under expert parallel the experts' gradient is divided by the "
           "expert-data ranks only (FSDP's mean), not by every data rank: the experts' gradients x 2 at EP 2",
           "litscale.strategies.expert_parallel:apply_expert_parallel", _experts_divided_by_expert_data_ranks,
           (f"{PARITY}[moe_fsdp_ep2-2ranks-sgd]",)),
    Mutant("replica-groups-sum-not-mean", "fault_tolerance=replicas reduces the gradients over the replica groups "
           "with a sum, not a mean (every gradient x the groups)",
           "litscale.reliability.replica_groups:ReplicaFaultTolerance.on_before_optimizer_step", _replica_groups_summed,
           ("tests/test_fault_tolerance.py::test_the_groups_average_their_gradients_over_the_quorum",)),
    Mutant("replica-groups-overlapped-sum-not-mean", "a replica group of one process takes its gradients' sum over "
           "the groups, started during backward, for their mean (every gradient x the groups)",
           "litscale.reliability.group_sums:OverlappedGradientSum.finish", _overlapped_sum_not_mean,
           ("tests/test_fault_tolerance.py::"
            "test_a_one_process_group_sums_its_gradients_during_backward_and_holds_the_groups_mean",)),
    Mutant("local-sgd-sum-not-mean", "local SGD's synchronisation takes the replicas' summed parameters for their "
           "mean (its all-reduce not divided by the world size: x 2 on 2 ranks)",
           "litscale.strategies.streaming:StreamingState._start", _average_not_divided,
           (f"{PARITY}[local_sgd_4-2ranks-sgd]",)),
    Mutant("fedprox-proximal-gradient-doubled", "FedProx's proximal term lacks its 1/2: its gradient is "
           "2 mu (w - w_global)", "litscale.strategies.federated:proximal_term", _proximal_term_without_its_half,
           (f"{PARITY}[fedprox_4-2ranks-sgd]",)),
    Mutant("zero-accumulation-divided-twice", "under ZeRO with gradient accumulation DeepSpeed's engine divides the "
           "loss by the accumulation again, after Lightning's loop did (the gradient / 2 at accumulation 2)",
           "litscale.strategies.deepspeed_zero:DeepSpeedZeroStrategy.backward", _engine_divides_again,
           (f"{PARITY}[zero2_accumulated-2ranks-sgd]",)),
    # A collective missing or doubled.
    Mutant("gradient-norm-all-reduced-twice", "the gradient norm across the mesh all-reduces its sum of squares "
           "twice: the logged train/grad_norm (and clipping's divisor) sqrt(2) too large on 2 ranks",
           "litscale.parallel.gradient_norm:gradient_norm_across_mesh", _norm_all_reduced_twice,
           (f"{PARITY}[fsdp_reshard-2ranks-sgd]",)),
    Mutant("moe-load-not-all-reduced", "the MoE bias update reads each rank's own routing counts: the load's "
           "all-reduce over the ranks is missing", "litscale.callbacks.moe:summed_over_ranks",
           _load_not_summed_over_ranks,
           ("tests/test_moe.py::test_callback_updates_bias_from_counts_summed_over_ranks",)),
    # Mixture of experts, batch norm, learning rates.
    Mutant("moe-balance-loss-dropped", "the training step drops the MoE load-balancing loss",
           "litscale.modules:CausalLMModule.training_step", _balance_loss_dropped,
           ("tests/test_moe.py::test_causal_lm_module_adds_the_aux_loss_once",)),
    Mutant("batch-norm-statistics-not-carried", "determinism=layout_invariant never carries the chunks' mean "
           "running statistics into the network's batch norms",
           "litscale.reliability.determinism:LayoutInvariance._carry_statistics", _statistics_not_carried,
           ("tests/test_determinism.py::test_batch_norm_statistics_after_a_step_are_the_mean_of_the_chunks",)),
    Mutant("lr-scaled-twice", "the LR-scaling rule is applied twice (x 4 instead of x 2 at twice the base batch)",
           "litscale.optim.lr_scaling:LRScaling.setup", _lr_scaled_twice,
           ("tests/test_lr_scaling.py::test_resume_at_another_global_batch_rescales_the_restored_schedule",)),
    Mutant("mup-router-taken-for-hidden", "µP takes a router (only its fan-in grows) for a hidden matrix: its init "
           "multiplier 1/sqrt(m), not 1/m", "litscale.optim.mup:WidthScaling._role", _router_as_hidden,
           ("tests/test_mup.py::test_a_router_is_a_readout_and_experts_are_hidden",)),
    Mutant("packed-attention-counted-whole", "MFU and the planner count a packed row's attention over the whole "
           "row (T^2 query-key pairs), not over its documents (the sum of their squared lengths)",
           "litscale.measure.flops:flops_per_sample", _attention_counted_whole,
           ("tests/test_packed_flops.py::test_a_packed_rows_attention_is_counted_over_its_documents",)),
    # Moves, resumes, data, exports, compression, saves.
    Mutant("deepspeed-move-moments-rotated", "a ZeRO checkpoint moved to another strategy gives each parameter its "
           "neighbour's Adam moments", "litscale.checkpoint.deepspeed:deepspeed_as_file_checkpoint", _moments_rotated,
           ("tests/test_deepspeed_moves.py::test_every_parameter_and_moment_is_put_back_whole_from_its_fragments",)),
    Mutant("resume-one-micro-batch-behind", "a resume restarts each rank one micro batch before where the checkpoint "
           "stopped: that batch is trained twice", "litscale.data.base:ShardedDataModule._resume_point",
           _resume_one_micro_batch_behind,
           ("tests/test_tokens.py::test_resume_inside_an_epoch_continues_where_it_stopped",)),
    Mutant("sample-drawn-twice-across-groups", "replica groups number their ranks from the group's index: two ranks "
           "draw the same samples", "litscale.data.base:ShardedDataModule.train_replicas", _groups_ranks_overlap,
           ("tests/test_fault_tolerance.py::test_the_groups_together_read_what_one_job_of_all_their_ranks_reads",)),
    Mutant("behind-group-trains-on-alone", "a replica group that stalled past the groups' timeout and comes back "
           "after the others finished the run trains its last steps alone (and may be the job's summary)",
           "litscale.reliability.replica_groups:ReplicaFaultTolerance._run_ended_without_this_group",
           _behind_group_trains_on,
           ("tests/test_fault_tolerance.py::test_a_group_that_fell_behind_stops_once_another_group_has_finished_the_run",)),
    Mutant("rng-restored-at-load", "the RNG state is restored when the checkpoint is loaded, and the loader draws "
           "from it before the first resumed batch", "litscale.callbacks.rng_state:RNGStateCallback.load_state_dict",
           _rng_restored_at_load,
           ("tests/test_reliability.py::test_stop_signal_saves_checkpoint_and_auto_resume_reproduces_losses"
            "[ddp-sigterm]",)),
    Mutant("tp-export-of-local-shards", "the export of a tensor-parallel network writes each rank's local shard, not "
           "the gathered tensor", "litscale.checkpoint.export:_rank_state_dict", _export_of_the_local_shard,
           ("tests/test_tensor_parallel.py::test_strategy_tp2_fits_like_single_process_and_checkpoint_loads_unsharded",)),
    Mutant("compression-residual-dropped", "gradient compression with error feedback drops the residual",
           "litscale.compression.allgather:encode_with_error_feedback", _residual_dropped,
           ("tests/test_compression.py::test_error_feedback_loses_nothing_over_two_steps[topk]",)),
    Mutant("published-before-its-last-file", "a sharded checkpoint is published when its shards are written, before "
           "its last file (meta.pt)", "litscale.checkpoint.strategy_checkpointing:StrategyCheckpointing.save_checkpoint",
           _published_before_its_last_file,
           ("tests/test_atomic_checkpoints.py::test_a_save_is_published_only_after_its_last_file",)),
]
MUTANTS = {mutant.name: mutant for mutant in _ROWS}
