"""Beyond one launcher: two torchrun "nodes" on localhost (c10d rendezvous) against a
single-process run of the same global batch, a sweep through the submitit launcher (one dir
and world size per job), the SLURM launcher's resources from the trainer settings, the run
dir all ranks of an external launch agree on, and the one-line errors of bad setups."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.cli import REPO, explain, final_weights, run_train, summaries
from helpers.configs import CONF_DIR, compose_full
from helpers.distributed import free_port

from hydra_plugins.litscale_plugins.slurm import (
    SlurmLauncher,
    group_by_resources,
    job_resources,
    resume_checkpoint,
)
from litscale.app.launch import RUN_ID_ENV, check_launchable, prepare_external_rank
from litscale.app.preflight import check_command_line
from litscale.errors import ConfigError

# SGD + momentum, no dropout, a global batch of 8 in every run: 1 process x 8 and 2 ranks x 4
# (scaling.global_batch splits it) see the same samples, so the weights must agree.
TINY = ("strategy=ddp", "trainer.accelerator=cpu", "optimizer=sgd", "optimizer.lr=0.05",
        "trainer.max_steps=6", "trainer.val_check_interval=6", "trainer.limit_val_batches=2",
        "data.seq_len=32", "data.max_bytes=400000", "trainer.enable_progress_bar=false",
        "scaling.global_batch=8")
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "SLURM_NTASKS", "SLURM_PROCID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID",
                "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID", RUN_ID_ENV)


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert expected.keys() == actual.keys() and len(expected) > 10
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1.3e-6, atol=1e-5, msg=name)


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in LAUNCHER_ENV:  # set first, so that what the code under test sets is undone too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


# --- a sweep through submitit's local executor, then two torchrun nodes -------------------------


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    """``-m hydra/launcher=slurm_local trainer.devices=1,2``: two submitit jobs, 1 and 2 ranks."""
    outputs = tmp_path_factory.mktemp("sweep")
    process = run_train("-m", "hydra/launcher=slurm_local", "trainer.devices=1,2", *TINY,
                        "name=submitit", outputs=outputs, timeout=240)
    assert process.returncode == 0, explain(process)
    return outputs


def run_torchrun_nodes(outputs: Path, nodes: int, *overrides: str, timeout: float = 240) -> list:
    """One ``torchrun --nnodes=<nodes> --nproc-per-node=1`` per node, all on localhost, meeting
    through c10d rendezvous; returns each node's (exit code, output)."""
    endpoint = f"localhost:{free_port()}"
    env = {**os.environ, "LITSCALE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"}
    for name in LAUNCHER_ENV:
        env.pop(name, None)
    processes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", "--nproc-per-node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--node-rank={node}",
         str(REPO / "train.py"), *overrides],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True) for node in range(nodes)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in processes]
        return [(p.returncode, output) for p, output in zip(processes, outputs, strict=True)]
    finally:
        for process in processes:  # a hang or a failure: stop each node's agent and its ranks
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, local_sweep):
    outputs = tmp_path_factory.mktemp("nodes")
    nodes = run_torchrun_nodes(outputs, 2, *TINY, "trainer.devices=1", "trainer.num_nodes=2",
                               "name=nodes")
    for node, (code, output) in enumerate(nodes):
        assert code == 0, f"node {node}: exit {code}\n{output[-4000:]}"
    return outputs, nodes


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_submitit_sweep_gives_each_job_its_dir_and_world_size(local_sweep):
    sweeps = list((local_sweep / "submitit" / "multiruns").iterdir())
    assert len(sweeps) == 1, sweeps  # no second multirun dir
    assert not (local_sweep / "submitit" / "runs").exists()
    jobs = sorted(p.name for p in sweeps[0].iterdir() if p.is_dir() and p.name.isdigit())
    assert jobs == ["0", "1"]
    found = {s["output_dir"]: s for s in summaries(local_sweep)}
    assert sorted(found) == [str(sweeps[0] / "0"), str(sweeps[0] / "1")]
    assert [found[str(sweeps[0] / j)]["world_size"] for j in jobs] == [1, 2]
    for job in jobs:  # one set of config and logs per job
        assert [p.name for p in (sweeps[0] / job).glob("*/config.yaml")] == ["config.yaml"]
        assert (sweeps[0] / job / "train.log").is_file()
    one, two = (found[str(sweeps[0] / j)] for j in jobs)
    assert one["global_batch"] == two["global_batch"] == 8
    assert_same_weights(final_weights(two), final_weights(one))


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_torchrun_nodes_match_one_process_of_the_same_global_batch(two_nodes, local_sweep):
    outputs, nodes = two_nodes
    runs = list((outputs / "nodes" / "runs").iterdir())
    assert len(runs) == 1, runs  # both nodes picked the same run dir
    (summary,) = summaries(outputs)  # written once, by rank 0
    assert summary["world_size"] == 2 and summary["global_batch"] == 8
    assert summary["output_dir"] == str(runs[0])
    assert torch.load(summary["checkpoint"], weights_only=True)["global_step"] == 6
    assert sorted(p.name for p in runs[0].glob(".hydra/*.yaml")) == [
        "config.yaml", "hydra.yaml", "overrides.yaml"]
    output = "".join(text for _, text in nodes)
    assert output.count("litscale: done: 6 steps") == 1 and "terminate called" not in output
    (reference,) = (s for s in summaries(local_sweep) if s["world_size"] == 1)
    assert_same_weights(final_weights(summary), final_weights(reference))


# --- the run dir that the ranks of an external launch share -------------------------------------


def test_slurm_tasks_share_the_job_id_as_run_dir(no_launcher_env, outputs_root):
    no_launcher_env.setenv("SLURM_NTASKS", "8")
    no_launcher_env.setenv("SLURM_PROCID", "3")
    no_launcher_env.setenv("SLURM_JOB_ID", "4242")
    assert prepare_external_rank() == ["hydra.output_subdir=null"]  # rank 0 alone writes .hydra
    assert os.environ[RUN_ID_ENV] == "4242"
    full = compose_full(["name=big"])
    assert full.hydra.run.dir == f"{outputs_root}/big/runs/4242"
    assert full.hydra.sweep.dir == f"{outputs_root}/big/multiruns/4242"

    no_launcher_env.delenv(RUN_ID_ENV)
    no_launcher_env.setenv("SLURM_PROCID", "0")
    no_launcher_env.setenv("SLURM_ARRAY_JOB_ID", "4200")
    no_launcher_env.setenv("SLURM_ARRAY_TASK_ID", "7")
    no_launcher_env.setenv("SLURM_STEP_ID", "1")
    assert prepare_external_rank() == []
    assert os.environ[RUN_ID_ENV] == "4200_7.1"


def test_a_run_id_the_user_set_wins_and_plain_runs_are_untouched(no_launcher_env):
    assert prepare_external_rank() == [] and RUN_ID_ENV not in os.environ
    no_launcher_env.setenv("SLURM_NTASKS", "2")
    no_launcher_env.setenv("SLURM_PROCID", "0")
    no_launcher_env.setenv("SLURM_JOB_ID", "4242")
    no_launcher_env.setenv(RUN_ID_ENV, "my-run")
    prepare_external_rank()
    assert os.environ[RUN_ID_ENV] == "my-run"


# --- SLURM through the submitit launcher -----------------------------------------------------------


@pytest.mark.slow
def test_slurm_launcher_sizes_each_job_from_the_trainer(tmp_path, monkeypatch):
    full = compose_full(["hydra/launcher=slurm", "trainer.devices=4", "trainer.num_nodes=2",
                         "hydra.launcher.partition=gpu", f"hydra.sweep.dir={tmp_path}"])
    params = job_resources(full)
    assert (params["nodes"], params["tasks_per_node"], params["gpus_per_node"]) == (2, 4, 4)
    # The sbatch script submitit would submit (a stand-in srun: submitit looks for one).
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    script = SlurmLauncher(**params)._executor(params)._executor._make_submission_file_text("x", "0")
    for flag in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--partition=gpu",
                 "--time=60", "--signal=USR2@120"):
        assert f"#SBATCH {flag}\n" in script, flag

    one = job_resources(compose_full(["hydra/launcher=slurm", "trainer.devices=1"]))
    assert (one["nodes"], one["tasks_per_node"], one["gpus_per_node"]) == (1, 1, 1)
    groups = group_by_resources([one, params, one])
    assert [indices for _, indices in groups] == [[0, 2], [1]]  # one SLURM array each
    assert groups[1][0] == params


def test_requeued_job_resumes_from_its_own_last_checkpoint(tmp_path):
    job_dir = tmp_path / "3"
    (job_dir / "checkpoints").mkdir(parents=True)
    assert resume_checkpoint(str(job_dir), restart_count=1) is None
    torch.save({"global_step": 40}, job_dir / "checkpoints" / "last.ckpt")
    assert resume_checkpoint(str(job_dir), restart_count=0) is None  # first start: as configured
    assert resume_checkpoint(str(job_dir), restart_count=2) == str(job_dir / "checkpoints" / "last.ckpt")


# --- one-line errors before anything starts ---------------------------------------------------------


def check(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        check_command_line(argv, config_dir=str(CONF_DIR), config_name="train")
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip()


def test_slurm_needs_a_device_count(no_launcher_env, capsys):
    assert check(["-m", "hydra/launcher=slurm", "strategy=ddp", "trainer.devices=-1"], capsys) == (
        "error: trainer.devices=-1 cannot size a SLURM job: hydra/launcher=slurm asks for "
        "trainer.devices tasks and GPUs per node; give a count, e.g. trainer.devices=4")


@pytest.mark.slow
def test_slurm_jobs_are_not_checked_against_this_machines_devices(no_launcher_env, capsys):
    gpus = ["strategy=ddp", "trainer.accelerator=gpu", "trainer.devices=8", "trainer.num_nodes=2"]
    check_command_line(["-m", "hydra/launcher=slurm", *gpus], config_dir=str(CONF_DIR),
                       config_name="train")  # the GPUs are on the cluster's nodes
    if not torch.cuda.is_available():
        assert check(["hydra/launcher=slurm", *gpus], capsys) == (  # no -m: runs here
            "error: trainer.accelerator=gpu but no CUDA device is visible; use "
            "trainer.accelerator=cpu or auto")


@pytest.mark.slow
def test_several_nodes_need_an_external_launcher(no_launcher_env, capsys):
    assert check(["strategy=ddp", "trainer.accelerator=cpu", "trainer.num_nodes=2"], capsys) == (
        "error: trainer.num_nodes=2 needs one launcher per node: start train.py with torchrun on "
        "each node, or use SLURM (srun, or -m hydra/launcher=slurm); see the README")


def test_trainer_must_describe_the_ranks_torchrun_started(no_launcher_env):
    no_launcher_env.setenv("LOCAL_RANK", "0")
    no_launcher_env.setenv("WORLD_SIZE", "4")
    check_launchable(2, 2)
    with pytest.raises(ConfigError) as info:
        check_launchable(1, 2)
    assert str(info.value) == (
        "trainer.devices=1 x trainer.num_nodes=2 is 2 rank(s), but the launcher started 4; set "
        "trainer.devices to the processes per node (torchrun --nproc-per-node, srun "
        "--ntasks-per-node) and trainer.num_nodes to the number of nodes")
