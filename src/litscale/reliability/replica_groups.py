"""``fault_tolerance=replicas``: replica groups that keep training when one of them dies.

The job's ranks form ``groups`` replica groups of ``trainer.devices`` ranks each. Inside a
group the strategy (``single``, ``ddp`` or ``fsdp``) works as ever; across groups, torchft's
``Manager`` averages each step's gradients over the groups that are alive (rank ``r`` of a group
with rank ``r`` of the others: with FSDP, the groups are HSDP's outer replicate axis), and a group that died is
started again by its own elastic agent (``litscale.app.replica_launch``) and rejoins at the
next step boundary with a live group's weights, optimizer and scheduler state, sent over
torchft's HTTP transport: no checkpoint is read, and nobody else restarts.

Per step (``ReplicaFaultTolerance``, a callback), the quorum out of the step's way:

- at the step's first micro batch, the quorum with the lighthouse (the groups alive now) is
  started in torchft's own thread and runs beside the forward and backward (torchft's
  ``use_async_quorum``); a live group's state for a group that is behind is read in that
  thread from tensors no forward or backward writes (below), never by a ``state_dict()`` call
  there (a module's state-dict hooks, FSDP2's resharding among them, would run in the middle
  of the forward: the race torchtitan's users hit, pytorch/torchtitan#4754);
- by the end of backward, before clipping: the sum over the groups in the quorum (torchft's
  fault-tolerant all-reduce: a peer lost mid-step fails the step instead of hanging it) of the
  gradients (a group of one process starts it bucket by bucket during the backward, as DDP
  does: ``group_sums``) and of what each group counted on its own share of the batch: the loss the module
  logs, a mixture of experts' router load (the bias update after the step reads it) and
  BatchNorm's running statistics (the first group's, as DDP keeps rank 0's);
- the optimizer steps only if every rank of the group says the step is good
  (``Manager.should_commit``); a group that was behind takes the live group's state there,
  between its backward and its optimizer step (torchft applies a heal there; litscale's first
  quorum, below, is the one other place), sat out
  the step's sum (torchft counts only the groups at the newest step) and steps with the
  others' mean; a failed step is dropped and retried with the next batch, so Lightning's step
  counter follows the steps committed.

The first quorum alone is waited for, before the first batch is drawn: a group that starts
again heals then and starts its sampler where the live groups are, and sits that one step out
(and at a job's start every group takes group 0's weights in it, torchft's ``init_sync``).

What a lost group costs: its share of each global batch until it is back (the step's batch
shrinks from ``groups`` to the live groups' share; the learning rate stays the full batch's),
the step in flight when it died, and the survivors' wait for the lighthouse to drop it (2 s
after its last heartbeat, ``replica_launch.HEARTBEAT_TIMEOUT_MS``). A rejoining group reads
on from the step it rejoins at; a group that falls out of one quorum while alive (later than
``fault_tolerance.straggler_timeout_s``) heals in the middle of its epoch and reads on from its
own place in the order, which the sampler cannot move once an epoch is under way; one that
comes back after the others have finished the run stops there (``_run_ended_without_this_group``).
Each group writes one line per step to
``<run dir>/replicas/<group>/steps.jsonl`` (step, time, groups in the quorum, committed) and
one per start: the record the job's summary, the tests and
``experiments/reliability/replica_loss.py`` read.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from litscale.constraints import AtLeastTwo, NonNegativeInt, PositiveFloat, PositiveInt
from litscale.extras import TORCHFT, Requirement
from litscale.health.launcher import leave_behind_on_failure
from litscale.loggers import is_logging_step
from litscale.reliability.determinism import running_statistics
from litscale.reliability.group_sums import OverlappedGradientSum, sum_over_groups

# Written beside the groups' dirs once a group has finished the run.
FINISHED_MARKER = "finished"


@dataclass(kw_only=True, slots=True)
class ReplicaGroups:
    """``fault_tolerance=replicas``, the group's ``_target_``: how many replica groups train
    together and how long they wait for each other, typed once and read as one object by the
    launcher (``litscale.app.replica_launch``) and by each rank's ``ReplicaFaultTolerance``."""

    requires: ClassVar[tuple[Requirement, ...]] = (TORCHFT,)  # the lighthouse, manager and cross-group all-reduce

    groups: AtLeastTwo = 3
    """Replica groups of ``trainer.devices`` ranks each; the global batch is micro x devices x groups x accumulation."""
    min_replicas: PositiveInt = 1
    """Fewest groups a step commits with."""
    max_restarts: NonNegativeInt = 3
    """Times each group is started again after one of its ranks dies."""
    lighthouse: str | None = None
    """``host:port`` of a running torchft lighthouse; None: the job's process hosts one."""
    timeout_s: PositiveFloat = 10.0
    """A cross-group all-reduce, commit vote or state transfer (a peer lost mid-step fails it)."""
    straggler_timeout_s: PositiveFloat = 30.0
    """A step's wait for a group that is alive (heartbeating) but late; a dead one is left out after 2 s."""
    quorum_timeout_s: PositiveFloat = 60.0
    """How long a (re)starting group waits for the others to agree on a quorum."""


@dataclass(frozen=True)
class ReplicaGroup:
    """Which replica group a rank is of, and where the job's groups meet: handed to each
    group's ranks by the launcher (in the run spec), never read from the environment."""

    group: int
    groups: int
    lighthouse: str  # host:port of the torchft lighthouse
    start_store: str  # host:port of the store where the groups' first start meets (``_wait_for_every_group``)


def steps_log_path(group_dir: str) -> str:
    """A group's step record: one line per step (and one per start), in the group's own dir."""
    return os.path.join(group_dir, "steps.jsonl")


def finished_marker(group_dir: str) -> str:
    """The file a group writes when it has finished the run (a group started again after it
    then stops before its first step)."""
    return os.path.join(os.path.dirname(group_dir), FINISHED_MARKER)


class ReplicaFaultTolerance(Callback):
    """Averages gradients over the live replica groups and heals a group that rejoins.

    Args:
        run_dir: The group's own dir, ``<run dir>/replicas/<group>`` (its step record goes there).
        replicas: The job's ``fault_tolerance=replicas`` settings.
        group: This rank's group and where the groups meet (the launcher's ``ReplicaGroup``);
            None outside a replica launch (its set-up then refuses to fit).
    """

    def __init__(self, *, run_dir: str, replicas: ReplicaGroups | None = None,
                 group: ReplicaGroup | None = None) -> None:
        replicas = replicas or ReplicaGroups()
        self.identity = group
        self.group, self.groups = (group.group, group.groups) if group is not None else (0, 1)
        self.run_dir = run_dir
        self.min_replicas = replicas.min_replicas
        self.timeout = timedelta(seconds=replicas.timeout_s)
        self.quorum_timeout = timedelta(seconds=replicas.quorum_timeout_s)
        self.manager: Any = None
        self.participants = self.groups
        self.committed = True
        self._record: Any = None
        self._step_open = False  # a quorum was started for the step now running
        self._stepped = False  # the optimizer was asked to step in this batch (commit or not)
        self._healed_at: int | None = None  # the step a heal just set, until it is announced
        self._announced = self.groups  # the groups stepping, as last said
        self._tensors: dict[str, Any] = {}  # the module's own tensors, by state-dict name (``_hold_tensors``)
        self._statistics_at_start: dict[str, Any] = {}  # BatchNorm's statistics as the step began
        self._shared = False  # this step's sum set the statistics every group holds
        self._timings: dict[str, float] = {}  # this step's waits on the groups, in its record
        self._overlapped: OverlappedGradientSum | None = None  # a one-process group's sum in backward
        self._final_step = -1  # the run's last step (trainer.max_steps; -1: the epochs decide)
        self._ended_without_us: int | None = None  # the step another group finished the run at
        # This group's ranks agree on a flag in their own process group (``setup``: its size).
        self._agree: Any = functools.partial(_any_rank, 1, None)

    # -- set-up -------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.identity is None:
            raise RuntimeError("ReplicaFaultTolerance runs on ranks the replica launcher started (no group handed in)")
        if not pl_module.automatic_optimization:
            raise ValueError("fault_tolerance=replicas gates the optimizer step of automatic optimization; "
                             f"{type(pl_module).__name__} optimizes manually")
        _quiet_torchft()
        self._final_step = trainer.max_steps
        self._agree = functools.partial(_any_rank, trainer.world_size, trainer.strategy.root_device)
        self.start_manager(trainer, pl_module, store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                           store_port=int(os.environ["MASTER_PORT"]))
        if trainer.global_rank == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            self._record = open(steps_log_path(self.run_dir), "a", buffering=1)  # noqa: SIM115

    def start_manager(self, trainer: Any, pl_module: Any, *, store_addr: str, store_port: int) -> None:
        """This rank's torchft ``Manager``: its group's store at ``store_addr:store_port`` (the
        group's rank 0 serves the group's quorum and commit votes from it)."""
        from torchft import Manager, ProcessGroupGloo

        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=self.timeout),
            load_state_dict=lambda state: self._load(trainer, pl_module, state),
            state_dict=lambda: self._export(trainer),
            min_replica_size=self.min_replicas,
            # Each step's quorum runs in torchft's thread beside the forward and backward; the
            # first is waited for (``_quorum_before_first_batch``).
            use_async_quorum=True,
            timeout=self.timeout,
            quorum_timeout=self.quorum_timeout,
            connect_timeout=self.quorum_timeout,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=self.identity.lighthouse,
            replica_id=f"group_{self.group}",
        )
        if trainer.world_size == 1:
            self.manager._client = _OwnVote(self.manager._client)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for optimizer in trainer.optimizers:
            _gate_step(optimizer, self)
        _gate_schedule(pl_module, self)
        self._hold_tensors(pl_module)
        self._overlap_sums(trainer, pl_module)
        if os.path.exists(finished_marker(self.run_dir)):  # started again after another group finished the run
            trainer.should_stop = True
            self._write(step=trainer.global_step, started=True, stopped_as_finished=True)
            return
        if trainer.global_step:  # resumed from a checkpoint (ckpt_path): every group resumes the same one
            self.manager.load_state_dict({"step": trainer.global_step, "batches_committed": 0})
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and trainer.global_rank == 0:
            self._wait_for_every_group()
        self._quorum_before_first_batch(trainer)
        self._write(step=trainer.global_step, started=True, groups=self.participants)

    def _hold_tensors(self, pl_module: LightningModule) -> None:
        """The module's tensors (parameters as the objects they are, buffers), by state-dict
        name, taken here on the training thread once, for the state a live group sends: the
        quorum's thread reads them from here, never through ``state_dict()``.

        NOTE: a ``state_dict()`` call in the quorum's thread would run the module's state-dict
        hooks in the middle of a forward (FSDP2's reshards the parameters the forward is using:
        pytorch/torchtitan#4754). The objects stay the module's for the whole fit (the optimizer
        and a heal write into them; FSDP2 keeps its sharded parameters, and a shard is read at
        the send, ``_local``), so they are taken once: a ``state_dict()`` every step cost
        0.5-1.4 ms of a GPT-nano CPU step (measured on a loaded machine)."""
        self._tensors = pl_module.state_dict(keep_vars=True)
        self._statistics_at_start = {name: tensor.detach().clone()
                                     for name, tensor in running_statistics(pl_module).items()}

    def _overlap_sums(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A group of one process sums its gradients over the groups during backward, as DDP
        does (``group_sums``); a group of several ranks after its own reduction."""
        from torch.distributed.tensor import DTensor

        parameters = [p for p in pl_module.parameters() if p.requires_grad]
        if trainer.world_size == 1 and not any(isinstance(p, DTensor) for p in parameters):
            self._overlapped = OverlappedGradientSum(self.manager, parameters)

    # -- each step ------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # Lightning's loop counts the batch before this hook, so it knows whether it ends a step.
        if self._overlapped is not None and not trainer.fit_loop.epoch_loop._should_accumulate():
            self._overlapped.arm()  # this micro batch's backward ends the step
        if self._step_open:
            return
        # BatchNorm's statistics are the only state a forward writes: a live group sends them as
        # the step began (a heal keeps the sum's instead when it lands after it, ``_load``).
        for name in self._statistics_at_start:
            self._statistics_at_start[name] = self._tensors[name].detach().clone()
        self._shared = False
        self.manager.start_quorum()  # in torchft's thread: nothing here waits for the groups
        self._step_open = True

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        """The step's one sum over the groups of the quorum (in one buffer per dtype): the
        gradients, averaged, and what each group counted on its own share of the global batch,
        made the global batch's, inside the step, so that a peer lost now drops the step:

        - the micro batches' losses the module logs at this step (``TaskModule.window_losses``):
          averaged, so ``train/loss`` is the global batch's, as under DDP;
        - a mixture of experts' router load (``MoELayer.counted_load``): summed, so the bias
          update after the step reads the load of the global batch, as one process counts it;
        - BatchNorm's running statistics: the first group's of the quorum (group 0 while it is
          alive), as DDP broadcasts rank 0's buffers before each step's forward (the forward
          normalises each group's own micro batch, as DDP's does each rank's): every group holds
          the same statistics, those of DDP over all the groups' ranks.

        What each group counted goes in float32, whatever the gradients' dtype (counts stay
        exact). A sum that failed leaves each group its own statistics (the step is dropped, and
        a group's own statistics are overwritten by the next step's). A group that is healing
        sends zeros (torchft: it sits the step out) and takes the others' mean."""
        started = time.perf_counter()
        first = self.manager.participating_rank() == 0  # waits for the quorum, if it is not in yet
        waited = time.perf_counter()
        grads = [] if self._overlapped is not None else [  # a one-process group's are summed apart
            _local(p.grad) for p in pl_module.parameters() if p.grad is not None]
        losses = getattr(pl_module, "window_losses", [])
        loads = [load for module in pl_module.modules()
                 if (load := getattr(module, "counted_load", _nothing)()) is not None]
        norms = list(running_statistics(pl_module).values())
        counted = [*(t.detach().float() for t in (*losses, *loads)),
                   *(t.detach().float() if first else torch.zeros(t.shape, device=t.device) for t in norms)]
        if self._overlapped is not None:
            self._overlapped.start_rest()  # after the buckets backward started, in one order everywhere
        summed = sum_over_groups(self.manager, [*grads, *counted])
        participants = self.manager.num_participants()
        if self._overlapped is not None:
            self._overlapped.finish(participants)
        self._timings = {"quorum_wait_s": waited - started, "reduce_s": time.perf_counter() - waited}
        if not summed:
            return
        for grad, total in zip(grads, summed, strict=False):
            grad.copy_(total).div_(participants)
        if not counted or self.manager.errored() is not None:
            return
        totals = summed[len(grads):]
        losses[:] = [total / participants for total in totals[:len(losses)]]
        with torch.no_grad():
            for tensor, total in zip((*loads, *norms), totals[len(losses):], strict=True):
                tensor.copy_(total)
        self._shared = True

    def commit(self) -> bool:
        """Whether the optimizer may step (every rank of the group agrees, and no collective of
        the step failed: a lost peer fails the sum in every group); called by the gated
        ``optimizer.step``. A group that is behind takes a live group's state in it (``_load``).

        NOTE: torchft's vote is its own round trip to the group's manager, after the step's sum
        (it reports that sum's errors), and torchft offers no way to send it with the sum."""
        self.participants = self.manager.num_participants()
        if self.participants < self.groups and self._run_ended_without_this_group():
            self.committed, self._stepped = False, True
            return False
        started = time.perf_counter()
        self.committed = self.manager.should_commit()
        self._timings["commit_s"] = time.perf_counter() - started
        self._stepped = True
        return self.committed

    def _run_ended_without_this_group(self) -> bool:
        """Whether another group has finished the run while this one steps with fewer groups:
        the others went on without it (it stalled past ``fault_tolerance.timeout_s`` and its
        heartbeat lapsed) and ended the run, so a quorum of this group alone is no live group's,
        and training on would make the job's last steps its own, on its share of the batch.

        Asked only in a step with fewer groups (a step of every group reads nothing), from the
        other groups' step records and the finished marker; the group's ranks agree on it in
        their own process group, since each reads the files at its own moment."""
        step = step_the_run_ended_at(self.run_dir, self.groups, self._final_step)
        if self._agree(step is not None):
            self._ended_without_us = step if step is not None else self._final_step
        return self._ended_without_us is not None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._stepped:
            return  # inside an accumulation: the step is not over
        self._stepped = self._step_open = False
        if self._ended_without_us is not None:
            trainer.should_stop = True
            rank_zero_info(f"litscale: fault tolerance: replica group {self.group} fell behind at step "
                           f"{trainer.global_step} and the other groups finished the run (step "
                           f"{self._ended_without_us}) without it; it stops there instead of training on alone")
            self._write(step=trainer.global_step, stopped_as_finished=True, behind_the_finished_run=True)
            return
        _set_global_step(trainer, self.manager.current_step())
        if not self.committed:  # the routers' counts of a dropped step go with it (no bias update)
            for module in pl_module.modules():
                getattr(module, "take_statistics", _nothing)()
        self._announce(trainer)
        # NOTE: logged only at the steps whose values the loggers write, asked as Lightning asks
        # right after this hook (its ``_batches_that_stepped + 1``, which ``_set_global_step`` has
        # just set to the steps committed): a value logged at every step cost 1.0-1.5 ms of a 40
        # ms GPT-nano step (experiments/reliability/overhead.py) and was overwritten unread.
        # Every step's groups and commit are in the step record below.
        if is_logging_step(trainer, trainer.fit_loop.epoch_loop._batches_that_stepped + 1):
            pl_module.log_dict({"fault_tolerance/groups": float(self.participants),
                                "fault_tolerance/committed": float(self.committed)}, on_step=True)
        self._write(step=trainer.global_step, groups=self.participants, committed=self.committed,
                    **{name: round(seconds, 6) for name, seconds in self._timings.items()})

    def _write(self, **row: Any) -> None:
        if self._record is not None:
            self._record.write(json.dumps({**row, "time": time.time()}) + "\n")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # NOTE: Lightning calls no callback's teardown after an exception. Even shut down, the
        # manager's quorum thread may still wait on the group's lost rank (up to
        # ``quorum_timeout_s``; torchft cannot cancel it), and Python joins it at exit: the rank
        # then lived until the agent killed it 30 s later, and its group's restart and every
        # other group's quorum (this group still heartbeats) waited as long.
        self.teardown(trainer, pl_module, "fit")
        leave_behind_on_failure("torchft's quorum thread")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._overlapped is not None:
            self._overlapped.remove()
            self._overlapped = None
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        if self._record is not None:
            self._record.close()
            self._record = None

    def _wait_for_every_group(self) -> None:
        """At the job's start, every group before the first quorum.

        NOTE: the lighthouse forms a first quorum from the groups that heartbeat by then, and the
        groups' processes start seconds apart (a group still importing has not begun to): the
        first steps would run with fewer groups, then heal the latecomers."""
        from torch.distributed import TCPStore

        host, port = self.identity.start_store.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=self.quorum_timeout)
        store.add("started", 1)
        deadline = time.monotonic() + self.quorum_timeout.total_seconds()
        while store.add("started", 0) < self.groups and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- quorum and healing ---------------------------------------------------------------------
    def _quorum_before_first_batch(self, trainer: Trainer) -> None:
        """The first quorum, waited for: a group that is behind (a restarted one) takes a live
        group's state in it and starts its sampler where the live groups are; it sits that step
        out (torchft counts only the groups at the newest step) and steps with the others' mean,
        so its share of that one step is not trained on, and no sample is trained twice.

        NOTE: waited for because the sampler must move before the first batch is drawn, and at a
        job's start every group takes group 0's weights here (torchft's ``init_sync``), all at
        step 0 and so all stepping. Once per start, so its cost is not a step's."""
        _quorum_now(self.manager)
        self.participants = self.manager.num_participants()
        if self._healed_at:
            _skip_samples(trainer, self._healed_at)
        self._step_open = True
        self._announce(trainer)

    def _announce(self, trainer: Trainer) -> None:
        """One line when a group rejoined, or when the groups stepping changed."""
        healed, self._healed_at = self._healed_at, None
        if healed:
            # NOTE: a heal later in a run (a failed transfer retried, a group that fell out of a
            # quorum) cannot move the sampler, whose epoch is under way: that group reads on
            # from its own position.
            rank_zero_info(f"litscale: fault tolerance: replica group {self.group} rejoined at step {healed} "
                           f"with a live group's state ({self.participants} of {self.groups} groups stepping)")
        elif self.participants != self._announced:
            rank_zero_info(f"litscale: fault tolerance: replica group {self.group}, step {trainer.global_step}: "
                           f"{self.participants} of {self.groups} groups stepping (global batch "
                           f"{self.participants}/{self.groups} of the configured one)")
        self._announced = self.participants

    def _export(self, trainer: Trainer) -> dict[str, Any]:
        """What a rejoining group's rank takes from the same rank of a live group: this rank's
        shards as plain tensors (the groups share one layout, so shards match rank for rank).

        Called in torchft's quorum thread while the training thread may be in a forward: it
        reads only what no forward or backward writes (``_hold_tensors``; BatchNorm's statistics
        as the step began). Nothing writes the parameters, the optimizer or the schedulers
        before this step's ``should_commit``, which waits for the transfer to end."""
        with torch.no_grad():
            module = {name: self._statistics_at_start[name] if name in self._statistics_at_start
                      else _local(tensor).detach() for name, tensor in self._tensors.items()}
        return {"module": module,
                "optimizers": [_local_tree(optimizer.state_dict()) for optimizer in trainer.optimizers],
                "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]}

    def _load(self, trainer: Trainer, pl_module: LightningModule, state: dict[str, Any]) -> None:
        """A live group's state into this rank, on the training thread: in the first quorum,
        before any batch, or in ``should_commit``, between backward and the optimizer step.

        BatchNorm's statistics sent are those the step began with; where this step's sum has
        already set the ones every group holds, those are kept."""
        kept = set(running_statistics(pl_module)) if self._shared else set()
        with torch.no_grad():
            for name, tensor in pl_module.state_dict().items():  # into the parameters' own storage
                if name not in kept:
                    _local(tensor).copy_(state["module"][name])
        for optimizer, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(_as_parameters_are(optimizer, saved))
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        step = self.manager.current_step()
        _set_global_step(trainer, step)
        self._healed_at = step


def _quorum_now(manager: Any) -> None:
    """A quorum waited for, with the state of a heal applied before this returns (on the
    training thread, before any batch), on a manager whose quorums run in its thread.

    NOTE: torchft applies the heal of an asynchronous quorum in ``should_commit``. Its
    synchronous mode applies it at once, through the same two private calls as here
    (``Manager.start_quorum``), but then also counts a group that is behind as stepping, where
    groups whose quorums are asynchronous count only the groups at the newest step: a group
    restarted beside two live ones divided the step's sum by 3 and they by 2, and their weights
    parted. The quorum stays asynchronous here (every group counts the same groups) and only its
    heal is applied at once; torchft has no public call for that."""
    for name in ("_healing", "_apply_pending_state_dict"):
        if not hasattr(manager, name):
            raise RuntimeError(f"torchft's Manager no longer has {name}: litscale's replica groups cannot apply "
                               "a heal before their first batch with this torchft")
    manager.start_quorum()
    manager.wait_quorum()
    if manager._healing:
        manager._apply_pending_state_dict()
        manager._healing = False


def step_the_run_ended_at(group_dir: str, groups: int, final_step: int) -> int | None:
    """The step at which another group of the job finished the run, from the groups' dirs
    (siblings of ``group_dir``, ``<run dir>/replicas/<group>``): a committed row at the run's
    ``final_step`` in another group's step record (written the moment it steps), else the
    finished marker (written once that group's ranks have ended; the only sign where the epochs
    end the run, ``final_step`` -1); None while the run goes on."""
    replicas, own = os.path.split(group_dir)
    if final_step > 0:
        for other in (str(group) for group in range(groups) if str(group) != own):
            step = _last_committed_step(steps_log_path(os.path.join(replicas, other)))
            if step is not None and step >= final_step:
                return step
    return final_step if os.path.exists(finished_marker(group_dir)) else None


def _last_committed_step(path: str, tail_bytes: int = 4096) -> int | None:
    """The newest committed step in a step record, read from its end (a long run's record is
    megabytes); a line cut by the seek or still being written is skipped."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - tail_bytes))
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("committed"):
            return int(row["step"])
    return None


def _any_rank(world_size: int, device: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of this group (its ranks' own process group)."""
    if world_size == 1:
        return flag
    import torch.distributed as dist

    found = torch.tensor([int(flag)], device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())


def _nothing() -> None:
    """What a module without router counts answers (``getattr``'s default above)."""
    return None


def _local(tensor: Any) -> Any:
    """A DTensor's shard on this rank (FSDP's parameters and gradients); any other value as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _local_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_local_tree(item) for item in value]
    return _local(value)


def _as_parameters_are(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """A received optimizer state with each state tensor shaped like its parameter's shard made
    a DTensor like the parameter again (the optimizer steps DTensor parameters with DTensor state)."""
    from torch.distributed.tensor import DTensor

    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entries in saved["state"].items():
        parameter = parameters[int(index)]
        if isinstance(parameter, DTensor):
            entries = {key: DTensor.from_local(value, parameter.device_mesh, parameter.placements, run_check=False,
                                               shape=parameter.shape, stride=parameter.stride())
                       if torch.is_tensor(value) and value.shape == parameter.to_local().shape else value
                       for key, value in entries.items()}
        state[index] = entries
    return {**saved, "state": state}


class _OwnVote:
    """The group's manager client, but for the commit vote of a group of one rank, which is
    that rank's own: torchft's manager server ANDs the votes of the group's ranks and keeps
    nothing else of them, so with one rank its answer is the vote sent, after a round trip of
    0.5 ms a step (of a 22 ms Llama-tiny step on 2 CPU cores: a quarter of what the groups cost
    it over DDP, ``experiments/reliability/overhead.py``). Everything else (the quorum, asked
    from torchft's own thread) goes to the client. NOTE: torchft 0.2.0's ``Manager.should_commit``
    asks ``self._client.should_commit(rank, step, vote, timeout=...)``; the pin in
    pyproject.toml's ``ft`` extra holds that call."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: Any = None) -> bool:
        return should_commit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _quiet_torchft() -> None:
    """torchft logs every failed collective with its traceback, its state server every request,
    and torch warns about every state received; what these mean for the run is said in one
    line instead (``ReplicaFaultTolerance._quorum``)."""
    import http.server
    import warnings

    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    http.server.BaseHTTPRequestHandler.log_request = lambda *args, **kwargs: None  # errors still logged
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _gate_step(optimizer: torch.optim.Optimizer, replicas: ReplicaFaultTolerance) -> None:
    """``optimizer.step`` runs Lightning's closure (forward, backward, the cross-group average,
    clipping) and then steps only if the step commits.

    NOTE: patched on the instance, around whatever ``step`` is there (an LR scheduler wraps
    it too): Lightning offers no hook between its closure and the optimizer's update."""
    wrapped = optimizer.step

    @functools.wraps(wrapped)  # keeps the LR scheduler's mark on it (no warning at its step)
    def step(closure: Any = None, **kwargs: Any) -> Any:
        loss = closure() if closure is not None else None
        if replicas.commit():
            wrapped(**kwargs)
        return loss

    optimizer.step = step  # type: ignore[method-assign]


def _gate_schedule(pl_module: LightningModule, replicas: ReplicaFaultTolerance) -> None:
    """The LR schedule advances with the steps committed, as the optimizer does.

    NOTE: patched on the module (Lightning steps every scheduler through
    ``LightningModule.lr_scheduler_step``), not on the scheduler, whose ``state_dict`` is its
    ``__dict__`` and would carry the patch into checkpoints."""
    wrapped = pl_module.lr_scheduler_step

    def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
        if replicas.committed:
            wrapped(scheduler, metric)

    pl_module.lr_scheduler_step = lr_scheduler_step


def _set_global_step(trainer: Trainer, step: int) -> None:
    """Lightning's step counter set to the steps committed (a dropped step does not count)."""
    loop = trainer.fit_loop.epoch_loop
    progress = loop.automatic_optimization.optim_progress.optimizer.step
    progress.total.ready = progress.total.completed = step
    loop._batches_that_stepped = step


def _skip_samples(trainer: Trainer, steps: int) -> None:
    """A rejoining group's sampler starts where the live groups are: ``steps`` optimizer steps in.

    NOTE: an epoch whose batches do not fill its last accumulation window still steps on what
    it has (Lightning steps at an epoch's last batch), so an epoch is ``ceil(batches /
    accumulation)`` steps, not ``batches // accumulation``: counting whole windows put a group
    that rejoined past such an epoch on another step's samples."""
    loader = trainer.train_dataloader
    sampler = getattr(loader, "sampler", None)
    if not hasattr(sampler, "resume_at"):
        return
    accumulation = trainer.accumulate_grad_batches
    steps_per_epoch = math.ceil(trainer.num_training_batches / accumulation)
    epoch, into = divmod(steps, steps_per_epoch)
    sampler.resume_at(epoch, into * accumulation * loader.batch_size)
