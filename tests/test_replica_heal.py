"""A replica group that heals while the others are in the middle of a step.

The step's quorum runs in torchft's thread beside the forward and backward, and the state a
live group sends is read there. Two groups in this process (threads, each with its own torchft
``Manager`` built as a rank builds it, one lighthouse, real gloo groups and HTTP transfers)
are driven through ``ReplicaFaultTolerance``'s hooks as Lightning calls them, with forwards
that wait for the test between reading their weights and using them. Every figure is checked
against plain SGD on the same batches, computed here.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

WAIT_S = 60.0  # for the other group, at each meeting the test sets up (the machine may be loaded)
LR = 0.1


class GatedLinear(torch.nn.Module):
    """A linear layer whose forward can wait (``gate``) between reading its weights and using
    them, keeps what it saw, and counts the state exports (``state_dict()``, in whose hook
    FSDP2 reshards the parameters a forward is using) that land inside a forward."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = copy.deepcopy(linear)
        self.gate = None  # called in the middle of the next forward, then cleared
        self.in_forward = False
        self.exports_in_forward = 0
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weights as a forward began, weights it used)
        self.register_state_dict_pre_hook(self._count_export)

    def _count_export(self, *args, **kwargs) -> None:
        self.exports_in_forward += self.in_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.in_forward = True
        try:
            began = flat(self)
            if self.gate is not None:
                gate, self.gate = self.gate, None
                gate()
            self.seen.append((began, flat(self)))
            return self.linear(x)
        finally:
            self.in_forward = False

    def log_dict(self, *args, **kwargs) -> None:
        """What the callback logs each step (a LightningModule's; nothing to log to here)."""

    def lr_scheduler_step(self, scheduler, metric) -> None:
        scheduler.step()


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


def loss_of(linear, batch) -> torch.Tensor:
    x, y = batch
    return (linear(x) - y).pow(2).mean()


def trainer_of(optimizer) -> SimpleNamespace:
    """What the callback reads of Lightning's trainer on one rank of a one-rank group."""
    total = SimpleNamespace(ready=0, completed=0)
    loop = SimpleNamespace(automatic_optimization=SimpleNamespace(optim_progress=SimpleNamespace(
        optimizer=SimpleNamespace(step=SimpleNamespace(total=total)))), _batches_that_stepped=0,
        _should_accumulate=lambda: False)  # every batch ends a step
    return SimpleNamespace(global_rank=0, world_size=1, optimizers=[optimizer], lr_scheduler_configs=[],
                           global_step=0, should_stop=False, fit_loop=SimpleNamespace(epoch_loop=loop),
                           train_dataloader=None, accumulate_grad_batches=1, num_training_batches=100,
                           log_every_n_steps=1)


def reference(start: torch.nn.Linear, batches: list[list]) -> list[torch.Tensor]:
    """Plain SGD, by hand: the weights after steps 0, 1 and 2 as the test's story has them.
    Steps 0 and 1 average both groups' gradients; at step 2 group 1 is healing, so the mean is
    group 0's alone."""
    linear, after = copy.deepcopy(start), [flat(start)]
    for step, groups in ((0, (0, 1)), (1, (0, 1)), (2, (0,))):
        grads = []
        for group in groups:
            linear.zero_grad()
            loss_of(linear, batches[group][step]).backward()
            grads.append([p.grad.clone() for p in linear.parameters()])
        with torch.no_grad():
            for index, param in enumerate(linear.parameters()):
                param -= LR * sum(g[index] for g in grads) / len(grads)
        after.append(flat(linear))
    return after  # W0, W1, W2, W3


def test_a_group_healing_during_the_others_forward_takes_their_state_at_the_step_boundary(tmp_path):
    """Group 1 drops step 1 (an error it reports after the step's sum), so at step 2 it is
    behind and heals from group 0. The test holds group 0 inside its step-2 forward until group
    1's heal has arrived (group 1 asks for the quorum only once group 0 is in that forward), and
    group 1 inside its own step-2 forward until then too:

    - the quorum never holds a step's start (group 0 reaches its forward before the quorum can
      form; with a quorum waited for at the step's start, the two wait for each other until the
      test's timeout);
    - no state export runs a module's ``state_dict()`` inside a forward (torchtitan's race, where
      FSDP2's state-dict hook resharded the forward's parameters);
    - each forward used the weights its group held when the step began, unchanged while it ran:
      group 0 its W2, group 1 its own W1, the heal not yet applied;
    - at the step boundary both hold plain SGD's W3, and group 0's step-2 loss is that of W2.
    """
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    from litscale.reliability.replica_groups import (
        ReplicaFaultTolerance,
        ReplicaGroup,
        ReplicaGroups,
    )

    torch.manual_seed(0)
    start = torch.nn.Linear(3, 2)
    batches = [[(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3)] for _ in range(2)]
    expected = reference(start, batches)

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, quorum_tick_ms=5)
    meeting = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    settings = ReplicaGroups(groups=2, min_replicas=1, timeout_s=30.0, quorum_timeout_s=60.0)
    modules = [GatedLinear(start) for _ in range(2)]
    optimizers = [torch.optim.SGD(module.parameters(), lr=LR) for module in modules]
    trainers = [trainer_of(optimizer) for optimizer in optimizers]
    callbacks = [ReplicaFaultTolerance(run_dir=str(tmp_path / str(group)), replicas=settings,
                                       group=ReplicaGroup(group=group, groups=2, lighthouse=lighthouse.address(),
                                                          start_store=f"127.0.0.1:{meeting.port}"))
                 for group in range(2)]
    in_forward, quorum_started, losses = threading.Event(), threading.Event(), {}

    def wait(event: threading.Event, what: str) -> None:
        assert event.wait(WAIT_S), f"{what} within {WAIT_S:.0f} s"

    def group_0_forward() -> None:  # in group 0's step-2 forward: wait for group 1's heal to arrive
        in_forward.set()
        wait(quorum_started, "group 1 asked for the step-2 quorum")
        callbacks[1].manager.wait_quorum()

    def one_step(group: int, step: int) -> None:
        """One optimizer step of one group, its hooks in Lightning's order (the closure is
        forward, backward and the work before the optimizer step; the gated step runs it)."""
        callback, module, optimizer, trainer = callbacks[group], modules[group], optimizers[group], trainers[group]
        batch = batches[group][step]
        if step == 2 and group == 0:
            module.gate = group_0_forward
        if step == 2 and group == 1:
            wait(in_forward, "group 0 reached its step-2 forward (the quorum must not hold a step's start)")
            module.gate = callback.manager.wait_quorum  # its own heal arrives while its forward waits
        callback.on_train_batch_start(trainer, module, batch, step)
        if step == 2 and group == 1:
            quorum_started.set()

        def closure() -> torch.Tensor:
            loss = loss_of(module, batch)
            loss.backward()
            callback.on_before_optimizer_step(trainer, module, optimizer)
            if step == 1 and group == 1:  # after the sum: group 0 commits step 1, group 1 does not
                callback.manager.report_error(RuntimeError("group 1 drops step 1"))
            losses[group, step] = loss.detach()
            return loss

        optimizer.step(closure)
        callback.on_train_batch_end(trainer, module, None, batch, step)
        optimizer.zero_grad()

    def train(group: int) -> list[torch.Tensor]:
        callback, module, trainer = callbacks[group], modules[group], trainers[group]
        callback.start_manager(trainer, module, store_addr="127.0.0.1", store_port=stores[group].port)
        try:
            callback.on_train_start(trainer, module)
            after = [flat(module)]
            for step in range(3):
                one_step(group, step)
                after.append(flat(module))
            return after
        finally:
            callback.teardown(trainer, module, "fit")

    try:
        with ThreadPoolExecutor(2) as pool:
            group_0, group_1 = pool.map(train, (0, 1))
    finally:
        lighthouse.shutdown()

    w0, w1, w2, w3 = expected
    (began_0, used_0), (began_1, used_1) = modules[0].seen[2], modules[1].seen[2]
    torch.testing.assert_close(began_0, w2, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(used_0, w2, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(began_1, w1, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(used_1, w1, rtol=1.3e-6, atol=1e-5)  # the heal waits for the step's boundary
    torch.testing.assert_close(losses[0, 2], loss_of(lambda x: x @ w2[:6].view(2, 3).T + w2[6:], batches[0][2]),
                               rtol=1.3e-6, atol=1e-5)
    for weights, want in zip(group_0, expected, strict=True):  # group 0: plain SGD every step
        torch.testing.assert_close(weights, want, rtol=1.3e-6, atol=1e-5)
    for weights, want in zip(group_1, (w0, w1, w1, w3), strict=True):  # group 1: step 1 dropped, then healed
        torch.testing.assert_close(weights, want, rtol=1.3e-6, atol=1e-5)
    assert [callback.committed for callback in callbacks] == [True, True]
    assert [module.exports_in_forward for module in modules] == [0, 0]
    assert [trainer.fit_loop.epoch_loop._batches_that_stepped for trainer in trainers] == [3, 3]


class ResumeRecorder:
    """A sampler that records where ``_skip_samples`` puts it."""

    def __init__(self) -> None:
        self.resumed_at: list[tuple[int, int]] = []

    def resume_at(self, epoch: int, position: int) -> None:
        self.resumed_at.append((epoch, position))


def test_a_restarted_group_rejoins_beside_a_live_group_and_both_count_the_same_groups(tmp_path, monkeypatch):
    """Group 0 trains alone (SGD with momentum, so the optimizer's state travels too); group 1
    starts later, from other weights, as a restarted group does: its first quorum, waited for,
    heals it from group 0 and moves its sampler to the step it rejoins at, ``r``, while group 0's
    quorums run beside its steps. At ``r`` group 1 sits out (torchft counts only the groups at
    the newest step, group 0 alone, in both groups), then both train together: each step of
    both equals plain SGD with momentum over the groups stepping. On the old first quorum
    (torchft's synchronous mode) group 1 counted 2 groups where group 0 counted 1, summed its
    own gradient in, and the two groups' weights parted at ``r``."""
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    from litscale.reliability.replica_groups import (
        ReplicaFaultTolerance,
        ReplicaGroup,
        ReplicaGroups,
    )

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # neither waits for the other at its start
    torch.manual_seed(0)
    starts = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]  # a restarted group's own fresh weights

    def batch_of(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * group + step)
        return torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, quorum_tick_ms=5)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    settings = ReplicaGroups(groups=2, min_replicas=1, timeout_s=30.0, quorum_timeout_s=60.0)
    modules = [GatedLinear(start) for start in starts]
    optimizers = [torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9) for module in modules]
    trainers = [trainer_of(optimizer) for optimizer in optimizers]
    samplers = [ResumeRecorder(), ResumeRecorder()]
    for trainer, sampler in zip(trainers, samplers, strict=True):
        trainer.train_dataloader = SimpleNamespace(sampler=sampler, batch_size=4)
    callbacks = [ReplicaFaultTolerance(run_dir=str(tmp_path / str(group)), replicas=settings,
                                       group=ReplicaGroup(group=group, groups=2, lighthouse=lighthouse.address(),
                                                          start_store="unused:0"))
                 for group in range(2)]
    group_0_stepped, rejoined, record = threading.Event(), threading.Event(), {}

    def one_step(group: int, step: int) -> None:
        callback, module, optimizer, trainer = callbacks[group], modules[group], optimizers[group], trainers[group]
        batch = batch_of(group, step)
        callback.on_train_batch_start(trainer, module, batch, step)

        def closure() -> torch.Tensor:
            loss = loss_of(module, batch)
            loss.backward()
            callback.on_before_optimizer_step(trainer, module, optimizer)
            return loss

        optimizer.step(closure)
        callback.on_train_batch_end(trainer, module, None, batch, step)
        optimizer.zero_grad()
        record[group, step] = (flat(module), callback.participants, callback.committed)

    def train(group: int) -> None:
        callback, module, trainer = callbacks[group], modules[group], trainers[group]
        if group == 1:
            assert group_0_stepped.wait(WAIT_S), "group 0 trained 2 steps alone"
        callback.start_manager(trainer, module, store_addr="127.0.0.1", store_port=stores[group].port)
        try:
            callback.on_train_start(trainer, module)
            if group == 1:
                record["rejoined at"] = callback.manager.current_step()
                rejoined.set()
                for step in range(record["rejoined at"], record["rejoined at"] + 2):
                    one_step(1, step)
                return
            step = 0
            while not (rejoined.is_set() and step >= record["rejoined at"] + 2):
                assert step < 200, "group 1 never rejoined"
                one_step(0, step)
                step += 1
                if step == 2:
                    group_0_stepped.set()
        finally:
            callback.teardown(trainer, module, "fit")

    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(train, (0, 1)))
    finally:
        lighthouse.shutdown()

    rejoined_at = record["rejoined at"]
    assert rejoined_at >= 2
    assert samplers[1].resumed_at == [(0, 4 * rejoined_at)]  # group 1 reads on from step r's samples
    # Plain SGD with momentum: group 0 alone up to and with step r, both groups after it.
    linear = copy.deepcopy(starts[0])
    optimizer = torch.optim.SGD(linear.parameters(), lr=LR, momentum=0.9)
    for step in range(rejoined_at + 2):
        stepping = (0,) if step <= rejoined_at else (0, 1)
        grads = []
        for group in stepping:
            linear.zero_grad()
            loss_of(linear, batch_of(group, step)).backward()
            grads.append([p.grad.clone() for p in linear.parameters()])
        for index, param in enumerate(linear.parameters()):
            param.grad = sum(g[index] for g in grads) / len(grads)
        optimizer.step()
        expected = flat(linear)
        torch.testing.assert_close(record[0, step][0], expected, rtol=1.3e-6, atol=1e-5)
        assert record[0, step][1:] == (len(stepping), True), (step, record[0, step][1:])
        if step >= rejoined_at:
            torch.testing.assert_close(record[1, step][0], expected, rtol=1.3e-6, atol=1e-5)
            assert record[1, step][1:] == (len(stepping), True), (step, record[1, step][1:])
