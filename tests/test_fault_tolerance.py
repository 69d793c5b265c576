"""``fault_tolerance=replicas``: replica groups that train on while one of them restarts.

Refusals are checked against the exact line a user sees; the step record's arithmetic against
records written by hand; the groups' data against one data-parallel job of all their ranks, and
a rejoining group's against one process's steps; what the groups reduce beside the gradients
(the logged loss, a mixture of experts' load, BatchNorm's statistics) against one process or
DDP's rank 0, with the groups as threads of an in-process quorum. End to end (``full``): 2 MoE
groups against one process, 2 ResNet groups against DDP over 2 ranks.
End to end (``soak``, beyond CI's time on 2 cores: 80-200 s each): 3 groups of 1 rank without
a fault match one process with the same global batch; 3 groups of 1 rank train 90 steps while
group 2 is SIGKILLed at step 20; 2 FSDP groups; a killed rank in a DDP group of two.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from helpers.cli import explain, final_weights, run_in_own_group
from helpers.configs import compose_job

from litscale.app.checks.validation import validate
from litscale.app.replica_launch import (
    _group_record,
    _spec_of_group,
    costs,
    describe,
    group_dir,
    job_throughput,
)
from litscale.errors import ConfigError
from litscale.reliability.replica_groups import ReplicaGroup, steps_log_path

RUN = ["trainer.accelerator=cpu", "data.batch_size=8", "data.seq_len=32", "data.max_bytes=400000",
       "trainer.limit_val_batches=6", "trainer.enable_progress_bar=false"]
# One process with the 3 groups' global batch, validated on the same 48 held-out samples.
ONE_PROCESS = ["strategy=single", "trainer.devices=1", *RUN[:1], "data.batch_size=24", *RUN[2:4],
               "trainer.limit_val_batches=2", *RUN[5:], "logger=csv"]


def refusal(tmp_path: Path, *overrides: str) -> str:
    cfg, choices = compose_job(["fault_tolerance=replicas", *RUN, *overrides], tmp_path)
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices, this_machine=False)
    return str(error.value)


@pytest.mark.slow  # a Hydra composition and a validation each: 1-3 s
@pytest.mark.parametrize(("overrides", "line"), [
    (("strategy=tensor_parallel", "trainer.devices=2"),
     "fault_tolerance=replicas is not supported with strategy=tensor_parallel: averaging its ranks' gradients "
     "across groups before the update is not proven to train right (parity with one process); allowed: "
     "fault_tolerance=none, or strategy=single, ddp or fsdp inside each group"),
    (("strategy=local_sgd", "trainer.devices=2"),
     "fault_tolerance=replicas is not supported with strategy=local_sgd: averaging its ranks' gradients "
     "across groups before the update is not proven to train right (parity with one process); allowed: "
     "fault_tolerance=none, or strategy=single, ddp or fsdp inside each group"),
    (("strategy=ddp", "compression=powersgd", "trainer.devices=2"),
     "compression=powersgd is not supported with fault_tolerance=replicas: the groups average the gradients "
     "uncompressed, so the compression would stop at a group's edge; allowed: compression=none, or "
     "fault_tolerance=none"),
    (("fault_tolerance.groups=1",), "fault_tolerance.groups=1"),
    (("fault_tolerance.min_replicas=4",),
     "fault_tolerance.min_replicas=4 is more than the 3 groups (fault_tolerance.groups); allowed: 1 to 3"),
    (("strategy=ddp", "trainer.num_nodes=2", "trainer.devices=1"),
     "fault_tolerance=replicas starts its groups' ranks on this machine itself; trainer.num_nodes=2 is not "
     "supported; allowed: trainer.num_nodes=1 with litscale's own launcher (python train.py, no torchrun or srun)"),
])
def test_a_replica_setting_that_cannot_train_right_is_refused_in_one_line(tmp_path, overrides, line):
    message = refusal(tmp_path, *overrides)
    assert "\n" not in message
    assert message == line if " " in line else message.startswith(line + " "), message


@pytest.mark.slow  # a Hydra composition and a validation: 1-3 s
@pytest.mark.slow  # a Hydra composition: 1-3 s
def test_the_groups_ranks_together_must_fit_the_machine(tmp_path):
    from litscale.app.checks.fault_tolerance import check_every_group_fits
    from litscale.measure.flops import cores
    from litscale.parallel.layout import MeshSizes, RunLayout

    cfg, _ = compose_job(["fault_tolerance=replicas", "strategy=ddp", f"trainer.devices={cores()}", *RUN], tmp_path)
    layout = RunLayout(processes_per_node=cores(), mesh=MeshSizes(data_replicate=cores()), replica_groups=3)
    with pytest.raises(ConfigError) as error:
        check_every_group_fits(cfg, layout, "fault_tolerance=replicas")
    assert str(error.value) == (
        f"fault_tolerance=replicas runs 3 groups x trainer.devices={cores()} = {3 * cores()} ranks, more than this "
        f"machine's {cores()} CPU cores; allowed: fault_tolerance.groups x trainer.devices <= {cores()}, or add "
        "launcher.oversubscribe=true (CPU ranks of one thread each)")
    cfg.launcher.oversubscribe = True
    check_every_group_fits(cfg, layout, "fault_tolerance=replicas")  # asked for: accepted


@pytest.mark.slow  # a Hydra composition and a validation: 1-3 s
def test_the_layout_counts_every_group_in_the_global_batch(tmp_path):
    cfg, choices = compose_job(["fault_tolerance=replicas", "strategy=ddp", "trainer.devices=2", *RUN], tmp_path)
    layout = validate(cfg, choices=choices, this_machine=False)
    assert (layout.replica_groups, layout.global_batch) == (3, 8 * 2 * 3)
    assert "x replica groups 3 = global 48" in layout.describe()


def test_the_groups_together_read_what_one_job_of_all_their_ranks_reads():
    import torch
    from torch.utils.data import TensorDataset

    from litscale.data.base import ShardedDataModule

    dataset = TensorDataset(torch.arange(96))
    ranks_per_group, groups = 2, 3

    def order(num_replicas: int, rank: int, group: tuple[int, int]) -> list[int]:
        module = ShardedDataModule(batch_size=4)
        module.train_dataset = dataset
        module.replica_group = group
        module.replicas = lambda: (num_replicas, rank)  # what the strategy inside a group says
        return list(module.train_sampler())

    one_job = [order(ranks_per_group * groups, rank, (0, 1)) for rank in range(ranks_per_group * groups)]
    by_groups = [order(ranks_per_group, rank, (group, groups)) for group in range(groups)
                 for rank in range(ranks_per_group)]
    assert by_groups == one_job and len({i for part in one_job for i in part}) == 96


def test_the_groups_average_their_gradients_over_the_quorum():
    """Two replica groups in this process, each with its own torchft ``Manager`` (threads, one
    lighthouse, real gloo groups): after the callback's cross-group step, each group holds the
    mean of the two groups' gradients, as one data-parallel job of both would (a sum was the
    defect ``make mutants`` plants: the end-to-end checks are ``soak`` and use AdamW with
    clipping, which a gradient's scale cannot reach)."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    from litscale.reliability.replica_groups import ReplicaFaultTolerance

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    gradients = {0: [torch.tensor([1.0, -2.0]), torch.tensor([[0.5]])],
                 1: [torch.tensor([3.0, 4.0]), torch.tensor([[-1.5]])]}

    def group(index: int) -> list[torch.Tensor]:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), load_state_dict=lambda state: None,
                          state_dict=lambda: {}, min_replica_size=2, use_async_quorum=False,
                          timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=30),
                          connect_timeout=timedelta(seconds=30), rank=0, world_size=1, store_addr="127.0.0.1",
                          store_port=store.port, lighthouse_addr=lighthouse.address(), replica_id=f"group_{index}")
        try:
            module = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros_like(g)) for g in gradients[index])
            for param, grad in zip(module, gradients[index], strict=True):
                param.grad = grad.clone()
            callback = ReplicaFaultTolerance(run_dir="unused")
            callback.manager = manager
            manager.start_quorum()
            callback.on_before_optimizer_step(None, module, None)
            return [param.grad for param in module]
        finally:
            manager.shutdown(wait=False)

    try:
        with ThreadPoolExecutor(2) as pool:
            averaged = list(pool.map(group, (0, 1)))
    finally:
        lighthouse.shutdown()
    expected = [(a + b) / 2 for a, b in zip(gradients[0], gradients[1], strict=True)]
    for grads in averaged:
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_failing_rank_shuts_its_manager_down_and_does_not_wait_for_its_quorum_thread(monkeypatch):
    """Lightning calls no callback's teardown after an exception: the callback's
    ``on_exception`` shuts torchft's manager down and says its quorum thread is not to be
    waited for (``litscale.app.launch`` then exits the rank once its error is recorded). Without
    it, a killed rank's live peer lived 30 s more: its group's restart and every other group's
    quorum waited as long (the ``soak`` test of a rank killed in a DDP group of two)."""
    from litscale.health import launcher
    from litscale.reliability.replica_groups import ReplicaFaultTolerance

    class Manager:
        waited = None

        def shutdown(self, wait: bool = True) -> None:
            Manager.waited = wait

    monkeypatch.setattr(launcher, "_unstoppable", None)
    callback = ReplicaFaultTolerance(run_dir="unused")
    callback.manager = Manager()
    callback.on_exception(None, None, RuntimeError("Connection closed by peer"))
    assert (Manager.waited, callback.manager, launcher.left_behind_on_failure()) == (
        False, None, "torchft's quorum thread")


def test_each_group_writes_under_its_own_dir(tmp_path):
    from litscale.app.run import RunSpec
    from litscale.parallel.layout import RunLayout

    run_dir = str(tmp_path / "run")
    spec = RunSpec(config={"paths": {"output_dir": run_dir, "root_dir": str(tmp_path)},
                           "callbacks": {"model_checkpoint": {"dirpath": f"{run_dir}/checkpoints"}},
                           "logger": {"csv": {"save_dir": run_dir, "name": "csv"}}, "name": "run"},
                   layout=RunLayout())
    identity = ReplicaGroup(group=2, groups=3, lighthouse="127.0.0.1:1", start_store="127.0.0.1:2")
    group_spec = _spec_of_group(spec, run_dir, identity)
    assert group_spec.replica_group == identity  # the group's identity is handed in, not put in the environment
    moved = group_spec.config
    assert moved["paths"] == {"output_dir": f"{run_dir}/replicas/2", "root_dir": str(tmp_path)}
    assert moved["callbacks"]["model_checkpoint"]["dirpath"] == f"{run_dir}/replicas/2/checkpoints"
    assert moved["logger"]["csv"] == {"save_dir": f"{run_dir}/replicas/2", "name": "csv"}
    assert spec.config["paths"]["output_dir"] == run_dir  # the job's own spec is left as it was


def write_record(run_dir: Path, group: int, rows: list[dict]) -> None:
    path = Path(steps_log_path(group_dir(str(run_dir), group)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_costs_of_a_lost_group_are_read_from_the_step_records(tmp_path):
    def steps(first: int, last: int, start: float, groups_at) -> list[dict]:
        return [{"step": s, "time": start + s, "groups": groups_at(s), "committed": s != 31} for s in range(first, last + 1)]

    survivor = [{"step": 0, "started": True, "time": 0.0, "groups": 3},
                *steps(1, 30, 0.0, lambda s: 3), {"step": 31, "time": 34.5, "groups": 2, "committed": False},
                *steps(32, 40, 3.5, lambda s: 2 if s < 38 else 3)]
    write_record(tmp_path, 0, survivor)
    write_record(tmp_path, 1, survivor)
    write_record(tmp_path, 2, [{"step": 0, "started": True, "time": 0.0, "groups": 3}, *steps(1, 29, 0.0, lambda s: 3),
                               {"step": 38, "started": True, "time": 41.0, "groups": 3},
                               *steps(38, 40, 3.5, lambda s: 3)])
    cost = costs(str(tmp_path), 3, [0, 1, 2])
    assert cost == {"groups": 3, "finished": [0, 1, 2], "not_finished": [], "fell_behind": [], "restarted": [2], "rejoined_at_step": {"2": 38},
                    "seconds_to_rejoin": {"2": pytest.approx(12.0)},
                    "longest_pause_s": pytest.approx(4.5), "median_step_s": pytest.approx(1.0),
                    "steps_with_fewer_groups": 7, "steps_dropped": 1,
                    "final_step": 40}
    # committed steps after the first: 29 with 3 groups, 6 with 2, 3 with 3, of 8 samples a group
    summary = {"micro_batch": 8, "data_parallel_size": 1, "accumulate_grad_batches": 1,
               "perf/samples_per_sec": 10.0, "perf/tokens_per_sec": 320.0}
    rate = (29 * 3 + 6 * 2 + 3 * 3) * 8 / (43.5 - 1.0)
    assert job_throughput(summary, str(tmp_path), [0, 1, 2]) == {"perf/samples_per_sec": pytest.approx(rate),
                                                                 "perf/tokens_per_sec": pytest.approx(rate * 32)}
    # A task without tokens (classification): the samples alone (the old code raised KeyError at the job's end).
    without_tokens = {k: v for k, v in summary.items() if k != "perf/tokens_per_sec"}
    assert job_throughput(without_tokens, str(tmp_path), [0, 1, 2]) == {"perf/samples_per_sec": pytest.approx(rate)}
    assert describe({**cost, "restarted": [], "not_finished": [2]}).startswith(
        "3 replica groups, 3 finished at step 40; group(s) 2 lost and not back by the end; the longest ")
    assert describe(cost) == ("3 replica groups, 3 finished at step 40; group(s) 2 restarted and rejoined at step(s) "
                              "38 after 12.0 s; the longest step of a group that never stopped: 4.50 s (median 1.00 s); 7 step(s) "
                              "with fewer groups, 1 dropped")


# 3 ranks on 2 cores: one thread each (the groups share the cores).
TRAIN = ["python", "train.py", "fault_tolerance=replicas", "strategy=single", "trainer.devices=1", *RUN,
         "logger=csv", "launcher.oversubscribe=true"]


def job_summary(outputs: Path) -> dict:
    (path,) = [p for p in outputs.glob("**/summary.json") if p.parent.name != "replicas" and
               "replicas" not in p.parts]
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.soak  # 117-154 s; the kill's figures are the study's (experiments/reliability/replica_loss.py)
@pytest.mark.timeout(700)
def test_three_groups_train_on_while_one_is_killed_and_it_rejoins_from_a_peer(tmp_path):
    import sys

    # NOTE: killed at step 20 of 90, not 30 of 60: the group's new interpreter takes 20 s to import
    # and build on 2 idle cores (27 of the others' 0.8 s steps, measured) and more than 32 s on a
    # loaded one (CI's run of 60 steps ended before it was back), and a group not back when the
    # run ends is stopped, not waited for. The sum's timeout is 60 s, as in the DDP-group test
    # below: in a soak slice the three groups all stalled 10-12 s at steps 86-89, long after the
    # kill's 2.2 s, and the pause is the kill's claim, so it is bounded from the kill to the rejoin.
    command = [sys.executable, *TRAIN[1:], "trainer.max_steps=90", "trainer.val_check_interval=90",
               "fault_tolerance.timeout_s=60",
               "+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.at_step=20",
               "+callbacks.fault.kind=sigkill", "+callbacks.fault.replica_group=2"]
    process, _, stray = run_in_own_group(command, outputs=tmp_path / "killed", timeout=540)
    assert process.returncode == 0, explain(process)
    assert stray == []
    summary = job_summary(tmp_path / "killed")
    cost = summary["fault_tolerance"]
    assert cost["finished"] == [0, 1, 2] and cost["final_step"] == 90, cost  # every group ends the run
    # (a loaded 2-core machine runs 3 processes at seconds a step)
    check_the_kill_cost_the_survivors_no_long_pause(summary, lost=2, survivors=(0, 1), killed_at=20)
    assert 0 < cost["steps_with_fewer_groups"] < 90, cost
    assert "litscale: fault tolerance: replica group 2 rejoined at step" in process.stdout + process.stderr

    reference, _, _ = run_in_own_group([sys.executable, "train.py", *ONE_PROCESS, "trainer.max_steps=90",
                                        "trainer.val_check_interval=90"], outputs=tmp_path / "reference", timeout=300)
    assert reference.returncode == 0, explain(reference)
    expected = job_summary(tmp_path / "reference")["val/loss"]
    # The tolerance the study states (experiments/reliability/replica_loss.py): the steps with
    # 2 of 3 groups train on a smaller global batch, so the result is close, not equal.
    assert math.isclose(summary["val/loss"], expected, rel_tol=0.03), (summary["val/loss"], expected)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_single_rank_groups_train_end_to_end_as_one_process_with_their_global_batch(tmp_path):
    """The one end-to-end replica-group job outside ``soak``: 2 groups of 1 process, 4 steps of
    2 micro batches of 4 (the groups' sums start in the backward that ends a step,
    ``group_sums``), against one process at their global batch of 16 (validated on the same 48
    samples). Every other replica-group run is ``soak``: a change that hung every
    single-process group (a fresh rendezvous store per restart, which no process group hosted
    there) had nothing in ``make test`` or ``make test-full`` to fail. Arming the sums on the
    window's first micro batch instead of its last fails it (val/loss 4.8677 against 4.8458)."""
    import sys

    steps = ["trainer.max_steps=4", "trainer.val_check_interval=4"]
    groups = [sys.executable, "train.py", "fault_tolerance=replicas", "fault_tolerance.groups=2", "strategy=single",
              "trainer.devices=1", *RUN[:1], "data.batch_size=4", "trainer.accumulate_grad_batches=2", *RUN[2:4],
              "trainer.limit_val_batches=12", *RUN[5:], "logger=csv", steps[0], "trainer.val_check_interval=8",
              "trainer.log_every_n_steps=2"]
    process, _, stray = run_in_own_group(groups, outputs=tmp_path / "groups", timeout=240)
    assert process.returncode == 0, explain(process)
    assert stray == []
    one = ["strategy=single", "trainer.devices=1", *RUN[:1], "data.batch_size=16", *RUN[2:4],
           "trainer.limit_val_batches=3", *RUN[5:], "logger=csv", *steps]
    reference, _, _ = run_in_own_group([sys.executable, "train.py", *one], outputs=tmp_path / "reference", timeout=200)
    assert reference.returncode == 0, explain(reference)
    ours, theirs = job_summary(tmp_path / "groups"), job_summary(tmp_path / "reference")
    assert ours["fault_tolerance"]["finished"] == [0, 1] and ours["global_batch"] == theirs["global_batch"] == 16
    assert math.isclose(ours["val/loss"], theirs["val/loss"], rel_tol=1.3e-6, abs_tol=1e-5), (ours["val/loss"],
                                                                                            theirs["val/loss"])
    # The groups' figures are logged only where the loggers write: they are in every row that
    # holds the step's loss, in each group's own log (a gate that never opens leaves them out).
    for group in (0, 1):
        (metrics,) = (tmp_path / "groups").glob(f"**/replicas/{group}/csv/metrics.csv")
        written = [row for row in csv.DictReader(metrics.open()) if row["train/loss"]]
        assert written, metrics
        assert all((row["fault_tolerance/groups"], row["fault_tolerance/committed"]) == ("2.0", "1.0")
                   for row in written), written


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(400)
def test_three_groups_without_a_fault_match_one_process_with_their_global_batch(tmp_path):
    import sys

    steps = ["trainer.max_steps=6", "trainer.val_check_interval=6"]
    process, _, stray = run_in_own_group([sys.executable, *TRAIN[1:], *steps], outputs=tmp_path / "groups", timeout=300)
    assert process.returncode == 0, explain(process)
    assert stray == []
    reference, _, _ = run_in_own_group([sys.executable, "train.py", *ONE_PROCESS, *steps],
                                       outputs=tmp_path / "reference", timeout=300)
    assert reference.returncode == 0, explain(reference)
    ours, theirs = job_summary(tmp_path / "groups"), job_summary(tmp_path / "reference")
    assert ours["fault_tolerance"]["steps_with_fewer_groups"] == ours["fault_tolerance"]["steps_dropped"] == 0, (
        ours["fault_tolerance"])
    expected = final_weights(theirs)
    for group in range(3):  # every group ends with the one process's weights
        weights = final_weights(json.loads((Path(ours["output_dir"]) / "replicas" / str(group) /
                                            "summary.json").read_text()))
        torch.testing.assert_close(weights, expected, rtol=1.3e-6, atol=1e-5)
    assert math.isclose(ours["val/loss"], theirs["val/loss"], rel_tol=1.3e-6, abs_tol=1e-5), (ours["val/loss"],
                                                                                            theirs["val/loss"])


@pytest.mark.slow
@pytest.mark.soak  # 98 s alone
@pytest.mark.timeout(500)
def test_two_fsdp_groups_form_an_outer_replicate_axis_that_matches_one_process(tmp_path):
    """HSDP's replicate axis as replica groups: 2 groups of 2 FSDP ranks, each rank's gradient
    shards averaged with the same rank's of the other group."""
    import sys

    steps = ["trainer.max_steps=6", "trainer.val_check_interval=6"]
    # 4 validation batches of 8 on each of a group's 2 ranks: the 64 samples one process takes in 2 of 32.
    groups = [sys.executable, "train.py", "fault_tolerance=replicas", "fault_tolerance.groups=2", "strategy=fsdp",
              "trainer.devices=2", *[o for o in RUN if "limit_val" not in o], "trainer.limit_val_batches=4",
              "logger=csv", "launcher.oversubscribe=true", *steps]
    process, _, stray = run_in_own_group(groups, outputs=tmp_path / "groups", timeout=400)
    assert process.returncode == 0, explain(process)
    assert stray == []
    one = [o if o != "data.batch_size=24" else "data.batch_size=32" for o in ONE_PROCESS]
    reference, _, _ = run_in_own_group([sys.executable, "train.py", *one, *steps], outputs=tmp_path / "reference",
                                       timeout=300)
    assert reference.returncode == 0, explain(reference)
    ours, theirs = job_summary(tmp_path / "groups"), job_summary(tmp_path / "reference")
    assert ours["global_batch"] == theirs["global_batch"] == 32
    assert ours["fault_tolerance"]["steps_with_fewer_groups"] == 0
    assert math.isclose(ours["val/loss"], theirs["val/loss"], rel_tol=1.3e-6, abs_tol=1e-5), (ours["val/loss"],
                                                                                            theirs["val/loss"])


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(900)
def test_a_rank_killed_in_a_ddp_group_of_two_restarts_its_group_alone(tmp_path):
    """3 groups of 2 DDP ranks (6 ranks on 2 cores): rank 1 of group 1 is SIGKILLed at step 10
    of 150; its agent stops rank 0 of the group at once and starts both again, and they rejoin
    while groups 0 and 2 train on, no step of theirs waiting for the lost group's live rank.

    NOTE: 150 steps, as the restart (2 processes importing torch and Lightning beside 4 that
    train) took 8-10 s here and the other groups' 30 steps after step 10 about 6 s: at 40 the
    run ended while the group was starting again. The sum's timeout is 60 s, not 10: in a soak
    slice beside a 4-rank run the whole machine stalled 15 s at step 104, group 1's sum timed out,
    and a group lost to the load (not to the kill) was restarted again; the claim here is the
    kill's, so the pause is measured from the kill to the rejoin."""
    import sys

    command = [sys.executable, "train.py", "fault_tolerance=replicas", "strategy=ddp", "trainer.devices=2", *RUN,
               "logger=csv", "launcher.oversubscribe=true", "trainer.max_steps=150", "trainer.val_check_interval=150",
               "fault_tolerance.timeout_s=60",
               "+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.at_step=10",
               "+callbacks.fault.kind=sigkill", "+callbacks.fault.replica_group=1", "+callbacks.fault.rank=1"]
    process, _, stray = run_in_own_group(command, outputs=tmp_path, timeout=840)
    assert process.returncode == 0, explain(process)
    assert stray == []
    summary = job_summary(tmp_path)
    cost = summary["fault_tolerance"]
    assert cost["finished"] == [0, 1, 2] and cost["final_step"] == 150, cost
    check_the_kill_cost_the_survivors_no_long_pause(summary, lost=1, survivors=(0, 2), killed_at=10)


def check_the_kill_cost_the_survivors_no_long_pause(summary: dict, *, lost: int, survivors: tuple[int, ...],
                                                    killed_at: int) -> None:
    """Only the ``lost`` group restarted; from the kill to its rejoin no step of the survivors took
    10 s beyond a step's own time (none waited for the lost group); and it rejoined past the
    kill, the others having trained on while it started again."""
    cost = summary["fault_tolerance"]
    assert cost["restarted"] == [lost], cost
    rejoined = cost["rejoined_at_step"][str(lost)]
    # From the step after ``killed_at``: the fault fires at the end of that step, which the lost
    # group itself committed (a whole soak run's failure counted the 11.7 s that every group,
    # the lost one too, took for step 10 under the machine's load; the kill's own wait was step
    # 11's, 4.9 s).
    pauses = pauses_between(summary["output_dir"], groups=survivors, steps=range(killed_at + 1, rejoined + 2))
    assert pauses and max(pauses) - cost["median_step_s"] < 10.0, (max(pauses, default=None), cost)
    assert rejoined > killed_at, cost


def pauses_between(run_dir: str, *, groups: tuple[int, ...], steps: range) -> list[float]:
    """The seconds between each two consecutive steps of ``groups`` (their step records) whose
    later step is in ``steps``."""
    pauses = []
    for group in groups:
        rows = [row for row in _group_record(run_dir, group) if "started" not in row]
        pauses += [b["time"] - a["time"] for a, b in itertools.pairwise(rows) if b["step"] in steps]
    return pauses


def test_a_group_rejoining_past_an_epoch_with_a_partial_window_reads_the_step_it_rejoins_at():
    """11 batches of 4 an epoch, accumulation 3: windows of 3, 3, 3 and 2 batches, so 4 steps an
    epoch (Lightning steps on an epoch's last batch). A group that rejoins at step ``s`` reads
    step ``s``'s samples as one process reads them; the old code counted 44 // 12 = 3 steps an
    epoch and put a group rejoining at step 4 on step 5's samples."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, TensorDataset

    from litscale.data.base import ResumableSampler
    from litscale.reliability.replica_groups import _skip_samples

    dataset, batch, accumulation = TensorDataset(torch.arange(44)), 4, 3

    def sampler() -> ResumableSampler:
        return ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)

    steps = []  # one process's: each epoch's permutation in batches of 4, windows of 3 batches
    for epoch in range(3):
        order = sampler()
        order.set_epoch(epoch)
        batches = [part for part in torch.tensor(list(order)).split(batch) if len(part) == batch]
        steps += [torch.cat(batches[i:i + accumulation]).tolist() for i in range(0, len(batches), accumulation)]
    assert len(steps) == 12 and len(steps[3]) == 8
    for step in range(len(steps)):
        order = sampler()
        loader = DataLoader(dataset, batch_size=batch, sampler=order, drop_last=True)
        _skip_samples(SimpleNamespace(train_dataloader=loader, accumulate_grad_batches=accumulation,
                                      num_training_batches=len(loader)), step)
        order.set_epoch(0)  # the rejoined group's own first epoch
        assert list(order)[:len(steps[step])] == steps[step], step


# --- what the groups reduce beside the gradients, in-process --------------------------------


class FakeQuorum:
    """torchft's quorum of ``groups`` replica groups, each a thread here: a group's all-reduce
    waits for every other group's and hands back the sum (the mean for ``AVG``), as torchft's."""

    def __init__(self, groups: int) -> None:
        import threading

        self.groups, self.barrier, self.sent = groups, threading.Barrier(groups, timeout=30), [None] * groups

    def manager(self, group: int):
        from types import SimpleNamespace

        from torch.distributed import ReduceOp

        def allreduce(tensor, reduce_op=ReduceOp.AVG):
            self.sent[group] = tensor.clone()
            self.barrier.wait()
            total = torch.stack(self.sent).sum(dim=0)
            self.barrier.wait()
            tensor.copy_(total / self.groups if reduce_op == ReduceOp.AVG else total)
            return SimpleNamespace(wait=lambda: None)

        return SimpleNamespace(allreduce=allreduce, participating_rank=lambda: group,
                               num_participants=lambda: self.groups, errored=lambda: None)


def step_in_groups(modules: list, batches: list) -> None:
    """Each group's forward and backward on its own micro batch (the losses kept as the module
    keeps them on a logging step), then the replica callback's work before the optimizer step,
    every group at once."""
    from concurrent.futures import ThreadPoolExecutor

    from litscale.reliability.replica_groups import ReplicaFaultTolerance

    quorum = FakeQuorum(len(modules))
    for module, batch in zip(modules, batches, strict=True):
        loss = module.loss(batch)
        loss.backward()
        module.window_losses.append(loss.detach())

    def reduce(group: int) -> None:
        callback = ReplicaFaultTolerance(run_dir="unused")
        callback.manager = quorum.manager(group)
        callback.on_before_optimizer_step(None, modules[group], None)

    with ThreadPoolExecutor(len(modules)) as pool:
        list(pool.map(reduce, range(len(modules))))


@pytest.mark.slow  # in-process: two groups' backward in threads, about a second
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_one_process_group_sums_its_gradients_during_backward_and_holds_the_groups_mean(monkeypatch,
                                                                                           set_to_none):
    """A group of one process starts its gradients' sum over the groups bucket by bucket while
    the backward that ends the step runs (as DDP overlaps its all-reduce), and ends with the
    groups' mean of the gradients accumulated over the step's two micro batches; a parameter
    that only one group used takes the mean in both, as DDP gives it. The reference is each
    group's gradients from plain autograd, at two steps with ``zero_grad`` between (the
    gradients become pieces of the sum's buffers, kept from step to step). Without the hooks
    nothing starts in backward; a sum taken for the mean fails the comparison, and so does a
    piece of a parameter unused at the second step left holding the first step's mean."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    from litscale.reliability import group_sums

    monkeypatch.setattr(group_sums, "FIRST_BUCKET_BYTES", 64)  # several buckets on a small net
    monkeypatch.setattr(group_sums, "BUCKET_BYTES", 512)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 2))
    extra = torch.nn.Parameter(torch.randn(3))  # used by group 1 only
    batches = [[torch.randn(5, 4) for _ in range(2)] for _ in range(2)]  # group -> its two micro batches

    def backward(model, used_extra, inputs, group):
        loss = model(inputs).pow(2).mean() + (used_extra.pow(2).sum() if group == 1 else 0)
        loss.backward()

    def own_gradients(group: int) -> list[torch.Tensor]:
        model, used = copy.deepcopy(net), copy.deepcopy(extra)
        for inputs in batches[group]:
            backward(model, used, inputs, group)
        return [torch.zeros_like(p) if p.grad is None else p.grad for p in (used, *model.parameters())]

    expected = [(a + b) / 2 for a, b in zip(own_gradients(0), own_gradients(1), strict=True)]
    quorum = FakeQuorum(2)
    copies = [(copy.deepcopy(net), copy.deepcopy(extra)) for _ in range(2)]
    started_in_backward = [0, 0]

    def steps(group: int) -> list[list[torch.Tensor]]:
        model, used = copies[group]
        parameters = [used, *model.parameters()]  # ``extra`` last in backward's order: the last bucket
        sums = group_sums.OverlappedGradientSum(quorum.manager(group), parameters)
        averaged = []
        for _ in range(2):
            backward(model, used, batches[group][0], group)  # inside the accumulation window
            sums.arm()
            backward(model, used, batches[group][1], group)
            started_in_backward[group] = sum(bucket.work is not None for bucket in sums.buckets)
            sums.start_rest()
            sums.finish(participants=2)
            averaged.append([p.grad.clone() for p in parameters])
            for parameter in parameters:  # as ``optimizer.zero_grad`` does
                if set_to_none:
                    parameter.grad = None
                elif parameter.grad is not None:
                    parameter.grad.zero_()
        sums.remove()
        return averaged

    with ThreadPoolExecutor(2) as pool:
        averaged = list(pool.map(steps, (0, 1)))
    buckets = len(group_sums.buckets_in_backward_order([extra, *net.parameters()]))
    assert buckets >= 4 and 0 < started_in_backward[0] < buckets, started_in_backward  # ``extra`` unused
    assert started_in_backward[1] == buckets, started_in_backward  # group 1 used every parameter
    for group_steps in averaged:
        for grads in group_steps:
            for got, want in zip(grads, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-7)


@pytest.mark.slow  # in-process, but builds an MoE and steps it in 3 copies: seconds
def test_two_groups_count_a_mixture_of_experts_load_and_log_the_loss_of_the_global_batch():
    """The router load the bias update reads after the step is the global batch's (as one
    process counts it), not a group's own half: the groups' selection biases move alike, and as
    one process's; the loss logged is the global batch's. On the old code each group updated
    its bias from its own load (0.002 apart after 6 steps) and logged its own half's loss."""
    import copy
    from functools import partial

    from litscale.models.moe import build_moe
    from litscale.modules import CausalLMModule

    torch.manual_seed(0)
    one = CausalLMModule(net=build_moe(aux_loss_coef=0.0, bias_update_rate=0.001),
                         optimizer=partial(torch.optim.SGD, lr=0.1)).train()
    groups = [copy.deepcopy(one) for _ in range(2)]
    tokens = torch.randint(256, (8, 17))
    batch = (tokens[:, :-1], tokens[:, 1:])
    expected_loss = one.loss(batch)
    expected_loss.backward()
    expected = one.net.take_router_statistics().load
    one.net.update_expert_bias(expected)

    step_in_groups(groups, [(batch[0][:4], batch[1][:4]), (batch[0][4:], batch[1][4:])])
    for group in groups:
        load = group.net.take_router_statistics().load
        assert torch.equal(load, expected), (load, expected)
        group.net.update_expert_bias(load)
        for name, bias in group.net.state_dict().items():
            if name.endswith("selection_bias"):
                assert torch.equal(bias, one.net.state_dict()[name]), name
        (loss,) = group.window_losses
        torch.testing.assert_close(loss, expected_loss.detach(), rtol=1.3e-6, atol=1e-5)
        for mine, theirs in zip(group.parameters(), one.parameters(), strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1.3e-6, atol=1e-5)


@pytest.mark.slow  # in-process: a ResNet in 3 copies, about a second
def test_two_groups_keep_the_first_groups_batch_norm_statistics_as_ddp_keeps_rank_0s():
    """DDP broadcasts rank 0's buffers before each forward, so its run keeps the running
    statistics of rank 0's micro batches; two replica groups then hold group 0's, the same in
    both (on the old code each kept its own)."""
    import copy
    from functools import partial

    from litscale.models.resnet import ResNet
    from litscale.modules import ClassificationModule
    from litscale.reliability.determinism import running_statistics

    torch.manual_seed(0)
    module = ClassificationModule(net=ResNet(input_shape=[1, 8, 8], num_classes=10, widths=[4, 8],
                                             blocks_per_stage=1),
                                  optimizer=partial(torch.optim.SGD, lr=0.1)).train()
    rank_0 = copy.deepcopy(module)  # DDP's rank 0: its own micro batch through its own statistics
    groups = [copy.deepcopy(module) for _ in range(2)]
    images, labels = torch.randn(8, 1, 8, 8), torch.randint(10, (8,))
    halves = [(images[:4], labels[:4]), (images[4:], labels[4:])]
    with torch.no_grad():
        rank_0.loss(halves[0])
    step_in_groups(groups, halves)
    expected = running_statistics(rank_0)
    assert not torch.equal(expected["net.stem.1.running_mean"], module.net.stem[1].running_mean)  # it moved
    for group in groups:
        for name, statistic in running_statistics(group).items():
            assert torch.equal(statistic, expected[name]), name


@pytest.mark.slow  # in-process: builds an MoE, about a second
def test_a_dropped_step_takes_its_router_counts_with_it():
    """A step the groups did not commit (a peer lost in it) updates no weight, and so moves no
    selection bias either: its router counts are dropped with it, not left to be added to the
    next step's."""
    from types import SimpleNamespace

    from litscale.models.moe import build_moe
    from litscale.reliability.replica_groups import ReplicaFaultTolerance

    torch.manual_seed(0)
    net = build_moe().train()
    net(torch.randint(256, (2, 16)))
    callback = ReplicaFaultTolerance(run_dir="unused")
    callback.manager, callback.committed, callback._stepped = SimpleNamespace(current_step=lambda: 3), False, True
    total = SimpleNamespace(ready=4, completed=4)
    loop = SimpleNamespace(automatic_optimization=SimpleNamespace(optim_progress=SimpleNamespace(
        optimizer=SimpleNamespace(step=SimpleNamespace(total=total)))), _batches_that_stepped=4)
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop), global_step=3, log_every_n_steps=1)
    callback.on_train_batch_end(trainer, SimpleNamespace(modules=net.modules, log_dict=lambda *a, **k: None),
                                None, None, 0)
    assert (total.completed, loop._batches_that_stepped) == (3, 3)  # Lightning's count set back
    assert net.take_router_statistics() is None


# soak: a replica-group job spends about a minute starting; make test holds the same sums
# over the groups in one process (the threads against a fake quorum above).
@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(900)
def test_two_moe_groups_match_one_process_with_their_global_batch_bias_and_logged_loss(tmp_path):
    """2 groups of 1 rank, a mixture of experts with its bias update (no balance loss, which
    weighs each group's own micro batch, as DDP's ranks'): every group ends with one process's
    weights and selection biases at the global batch of 16, and the loss the job logs is the
    global batch's (on the old code each group moved its bias by its own load and logged its
    own half's loss)."""
    import sys

    moe = ["model=moe", "model.net.aux_loss_coef=0", "trainer.max_steps=6", "trainer.val_check_interval=6",
           "trainer.limit_val_batches=1"]
    # A sum slower than its 10 s timeout on a machine the soak set loads drops its step (one
    # process then saw a batch the groups did not): the claim here is the sum's, not its speed.
    groups = [sys.executable, *(o for o in TRAIN[1:] if "limit_val" not in o), "fault_tolerance.groups=2",
              "fault_tolerance.timeout_s=120", *moe]
    process, _, stray = run_in_own_group(groups, outputs=tmp_path / "groups", timeout=420)
    assert process.returncode == 0, explain(process)
    assert stray == []
    one = [o if o != "data.batch_size=24" else "data.batch_size=16" for o in ONE_PROCESS if "limit_val" not in o]
    reference, _, _ = run_in_own_group([sys.executable, "train.py", *one, *moe], outputs=tmp_path / "reference",
                                       timeout=420)
    assert reference.returncode == 0, explain(reference)
    ours, theirs = job_summary(tmp_path / "groups"), job_summary(tmp_path / "reference")
    assert ours["global_batch"] == theirs["global_batch"] == 16
    # every step summed over both groups and committed: what one process is compared with
    assert ours["fault_tolerance"]["steps_with_fewer_groups"] == ours["fault_tolerance"]["steps_dropped"] == 0, (
        ours["fault_tolerance"])
    expected = final_weights(theirs)
    biases = [name for name in expected if name.endswith("selection_bias")]
    assert biases and all(expected[name].abs().sum() > 0 for name in biases)  # the update moved them
    for group in range(2):
        summary = json.loads((Path(ours["output_dir"]) / "replicas" / str(group) / "summary.json").read_text())
        torch.testing.assert_close(final_weights(summary), expected, rtol=1.3e-6, atol=1e-5)
        assert math.isclose(summary["train/loss"], theirs["train/loss"], rel_tol=1.3e-6, abs_tol=1e-5), (
            group, summary["train/loss"], theirs["train/loss"])
    assert math.isclose(ours["train/loss"], theirs["train/loss"], rel_tol=1.3e-6, abs_tol=1e-5)


# soak: a replica-group job spends about a minute starting; make test holds the same sums
# over the groups in one process (the threads against a fake quorum above).
@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(900)
def test_two_batch_norm_groups_match_ddp_over_their_ranks(tmp_path):
    """2 groups of 1 rank on a ResNet: each group normalises its own micro batch, as each DDP
    rank does, and both end with the weights and running statistics of DDP over 2 ranks, which
    keeps rank 0's (it broadcasts rank 0's buffers before each step); on the old code each group
    kept its own statistics."""
    import sys

    resnet = ["experiment=digits_resnet", "trainer.accelerator=cpu", "data.batch_size=8", "trainer.max_steps=4",
              "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
              "logger=csv", "launcher.oversubscribe=true"]
    groups = [sys.executable, "train.py", "fault_tolerance=replicas", "fault_tolerance.groups=2", "strategy=single",
              "trainer.devices=1", *resnet]
    process, _, stray = run_in_own_group(groups, outputs=tmp_path / "groups", timeout=420)
    assert process.returncode == 0, explain(process)
    assert stray == []
    ddp, _, _ = run_in_own_group([sys.executable, "train.py", "strategy=ddp", "trainer.devices=2", *resnet],
                                 outputs=tmp_path / "ddp", timeout=420)
    assert ddp.returncode == 0, explain(ddp)
    ours = job_summary(tmp_path / "groups")
    expected = final_weights(job_summary(tmp_path / "ddp"))
    assert any(name.endswith("running_mean") for name in expected)
    for group in range(2):
        summary = json.loads((Path(ours["output_dir"]) / "replicas" / str(group) / "summary.json").read_text())
        torch.testing.assert_close(final_weights(summary), expected, rtol=1.3e-6, atol=1e-5)


def test_a_one_rank_groups_commit_vote_is_its_own_and_everything_else_goes_to_torchfts_client():
    """torchft's manager server ANDs the votes of a group's ranks and keeps nothing else: with one
    rank, the answer is the vote sent, which the group now gives itself (0.6 ms a step less)."""
    from types import SimpleNamespace

    from litscale.reliability.replica_groups import _OwnVote

    client = SimpleNamespace(should_commit=lambda *args, **kwargs: True, _quorum=lambda **kwargs: "quorum")
    own = _OwnVote(client)
    assert own.should_commit(0, 7, False, timeout=None) is False
    assert own.should_commit(0, 7, True, timeout=None) is True
    assert own._quorum() == "quorum"


def test_a_group_that_fell_behind_stops_once_another_group_has_finished_the_run(tmp_path):
    """A group that stalls past ``fault_tolerance.timeout_s`` (its heartbeat lapses: a machine
    under load, a paused VM) is dropped from the quorum, and the others may finish the run
    without it. Back, it found a quorum of itself alone and trained the run's last steps on its
    own share of the batch, and the job's summary was its own (reproduced: one group of three
    stopped 14 s at step 19 of 60, the others finished, and it took steps 19-60 alone, "3
    finished, no group lost"). Now a group stepping with fewer groups reads whether another has
    committed the run's final step, and stops without this step; with every group stepping it
    reads nothing."""
    from types import SimpleNamespace

    from litscale.reliability.replica_groups import ReplicaFaultTolerance

    run = tmp_path / "run"
    write_record(run, 0, [{"step": 0, "started": True, "groups": 2, "time": 0.0},
                          *({"step": s, "groups": 2, "committed": True, "time": s} for s in range(1, 20))])
    write_record(run, 1, [{"step": 0, "started": True, "groups": 2, "time": 0.0},
                          *({"step": s, "groups": 2 if s < 20 else 1, "committed": True, "time": s} for s in range(1, 61))])
    votes: list[bool] = []
    callback = ReplicaFaultTolerance(run_dir=group_dir(str(run), 0))
    callback.groups, callback._final_step, callback._agree = 2, 60, lambda flag: flag
    callback.manager = SimpleNamespace(num_participants=lambda: 2, should_commit=lambda: votes.append(True) or True)
    assert callback.commit() is True and votes == [True]  # every group stepping: torchft's vote, nothing read

    callback.manager.num_participants = lambda: 1
    callback._record = open(steps_log_path(group_dir(str(run), 0)), "a")  # noqa: SIM115
    assert callback.commit() is False and votes == [True]  # not stepped, no vote asked
    trainer = SimpleNamespace(global_step=19, should_stop=False)
    callback.on_train_batch_end(trainer, None, None, None, 0)
    callback._record.close()
    assert trainer.should_stop is True
    last = json.loads(Path(steps_log_path(group_dir(str(run), 0))).read_text().splitlines()[-1])
    assert (last["step"], last["stopped_as_finished"], last["behind_the_finished_run"]) == (19, True, True)
    cost = costs(str(run), 2, [1])
    assert (cost["finished"], cost["fell_behind"], cost["not_finished"]) == ([1], [0], [])
    assert "group(s) 0 fell behind and stopped when the others had finished the run" in describe(cost)


def test_whether_another_group_has_finished_the_run_is_read_from_the_end_of_its_record(tmp_path):
    from litscale.reliability.replica_groups import finished_marker, step_the_run_ended_at

    run = tmp_path / "run"
    own = group_dir(str(run), 0)
    assert step_the_run_ended_at(own, 3, 60) is None  # no record yet
    write_record(run, 0, [{"step": 60, "groups": 1, "committed": True, "time": 1.0}])  # its own: not another's
    write_record(run, 1, [*({"step": s, "groups": 3, "committed": True, "time": s, "pad": "x" * 80}
                            for s in range(1, 60)), {"step": 60, "groups": 2, "committed": False, "time": 61.0}])
    assert step_the_run_ended_at(own, 3, 60) is None  # its final step was dropped
    with open(steps_log_path(group_dir(str(run), 1)), "a") as record:
        record.write(json.dumps({"step": 60, "groups": 2, "committed": True, "time": 62.0}) + "\n")
        record.write('{"step": 61, "gro')  # a row being written
    assert step_the_run_ended_at(own, 3, 60) == 60
    assert step_the_run_ended_at(own, 3, 80) is None  # the run goes on to 80
    Path(finished_marker(own)).write_text("1")
    assert step_the_run_ended_at(own, 3, -1) == -1  # the epochs end the run: the marker says it
