"""The Ray launcher's settings for clusters of several hosts, without a cluster: storage,
the working dir and environment sent to the workers, elastic worker counts, each refused in
one line; a run dir's round trip through URI storage; the stop signal handed to the loop."""

from __future__ import annotations

import os
import signal

import pytest

from hydra_plugins.litscale_plugins import ray_settings, ray_worker
from hydra_plugins.litscale_plugins.ray_storage import StoredRunDir
from litscale.errors import ConfigError

DDP = "litscale.strategies.ddp.DDPStrategy"
FSDP = "litscale.strategies.fsdp.FSDPStrategy"
ALLOWED = ("allowed: null (the sweep dir), an absolute path every node mounts, or a URI (s3://, gs://, "
           "gcs://, abfs://, abfss://, hdfs://, viewfs://, file://)")


def refusal(function, *args) -> str:
    with pytest.raises(ConfigError) as error:
        function(*args)
    return str(error.value)


def test_storage_is_refused_in_one_line_where_a_node_could_not_reach_it():
    ray_settings.check_storage(None, None)
    ray_settings.check_storage("/shared/runs", "ray://head:10001")
    ray_settings.check_storage("s3://bucket/prefix", "ray://head:10001")
    assert refusal(ray_settings.check_storage, None, "ray://head:10001") == (
        "hydra.launcher.storage=null leaves run dirs, checkpoints and summary.json on the disks of the hosts "
        f"of hydra.launcher.address=ray://head:10001, where this driver cannot read them; {ALLOWED}")
    assert refusal(ray_settings.check_storage, "runs", None) == (
        f"hydra.launcher.storage='runs' is a relative path, which names another dir on each node; {ALLOWED}")
    assert refusal(ray_settings.check_storage, "ftp://host/x", None) == (
        f"hydra.launcher.storage='ftp://host/x' is not a storage URI pyarrow opens; {ALLOWED}")
    assert refusal(ray_settings.check_storage, "s3://", None).startswith("hydra.launcher.storage='s3://' is not")


def test_uri_storage_holds_rank_zeros_saves_alone():
    ray_settings.check_uri_storage_strategy("s3://b/p", DDP, 8)
    ray_settings.check_uri_storage_strategy("/shared", FSDP, 8)
    ray_settings.check_uri_storage_strategy("s3://b/p", "litscale.strategies.single.SingleStrategy", 1)
    assert refusal(ray_settings.check_uri_storage_strategy, "s3://b/p", FSDP, 2) == (
        "hydra.launcher.storage=s3://b/p copies each rank's run dir to the URI after every save, which holds the "
        f"checkpoints that rank 0 writes alone; strategy {FSDP} saves a part from every rank into one "
        "directory; allowed: a data-parallel strategy (ddp, local_sgd), one rank, or an absolute path every "
        "node mounts")


def test_elastic_workers_need_a_range_and_a_data_parallel_strategy():
    assert ray_settings.elastic_workers({}, FSDP) is None
    assert ray_settings.elastic_workers({"min_workers": 1, "max_workers": 4}, DDP) == (1, 4)
    assert ray_settings.elastic_workers(
        {"min_workers": 1, "max_workers": 2}, "litscale.strategies.local_sgd.LocalSGDStrategy") == (1, 2)
    assert refusal(ray_settings.elastic_workers, {"min_workers": 3, "max_workers": 2}, DDP) == (
        "hydra.launcher.min_workers=3 / max_workers=2 is not an elastic range; allowed: both null (a fixed "
        "count from trainer.devices x trainer.num_nodes), or two integers with 1 <= min_workers <= max_workers")
    assert refusal(ray_settings.elastic_workers, {"min_workers": 1, "max_workers": None}, DDP).startswith(
        "hydra.launcher.min_workers=1 / max_workers=None is not an elastic range")
    assert refusal(ray_settings.elastic_workers, {"min_workers": 1, "max_workers": 2}, FSDP) == (
        "hydra.launcher.min_workers=1 / max_workers=2 runs the job on however many workers the cluster has, "
        f"which needs a replica of the whole model on each; strategy {FSDP} splits it; allowed: a "
        "data-parallel strategy (ddp, local_sgd), or min_workers=null max_workers=null")
    federated = "litscale.strategies.federated.FederatedStrategy"
    assert "strategy litscale.strategies.federated" in refusal(
        ray_settings.elastic_workers, {"min_workers": 1, "max_workers": 2}, federated)


def test_the_elastic_line_states_the_batch_and_lr_rules():
    assert ray_worker.elastic_line(3, 2, (1, 4), 16, 1, "linear") == (
        "litscale: job 3 runs on 2 Ray workers (elastic, 1-4): data.batch_size=16 per device is fixed, so the "
        "global batch is 32; lr_scaling=linear rescales optimizer.lr to it")
    assert ray_worker.elastic_line(0, 1, (1, 2), 8, 2, "none").endswith(
        "global batch is 16; optimizer.lr stays as given (lr_scaling=none)")
    assert ray_worker.elastic_trainer_shape(4, 2) == (2, 2)
    assert ray_worker.elastic_trainer_shape(3, 2) == (3, 1)


def test_the_workers_get_the_project_dir_less_what_they_never_run_and_the_litscale_environment(tmp_path):
    def task(cfg):
        return None

    here = os.path.dirname(os.path.abspath(__file__))
    assert ray_settings.working_dir({"working_dir": "auto", "address": "auto"}, task) == here
    assert ray_settings.working_dir({"working_dir": "auto", "address": None}, task) is None
    assert ray_settings.working_dir({"working_dir": None, "address": "auto"}, task) is None
    assert ray_settings.working_dir({"working_dir": str(tmp_path)}, task) == str(tmp_path)
    assert refusal(ray_settings.working_dir, {"working_dir": "/nowhere"}, task) == (
        "hydra.launcher.working_dir='/nowhere' is not a directory; allowed: auto (the dir of train.py when "
        "joining a cluster), null, or a directory to send to every worker")
    env = ray_settings.runtime_env("/repo", {"LITSCALE_OUTPUTS": "/o", "HOME": "/h"})
    assert env["env_vars"] == {"LITSCALE_OUTPUTS": "/o"} and env["working_dir"] == "/repo"
    assert {".venv", ".git", "outputs", "multiruns"} <= set(env["excludes"])
    assert ray_settings.runtime_env(None, {}) == {"env_vars": {}}
    assert ray_settings.relative_cwd("/repo", "/repo/sub") == "sub"
    assert ray_settings.relative_cwd("/repo", "/elsewhere") == "."
    assert ray_settings.storage_run_root("s3://b/p/", "/x/outputs/default/multiruns/t", "/x/outputs") == (
        "s3://b/p/default/multiruns/t")


def test_a_run_dir_goes_to_uri_storage_and_back_with_its_write_times(tmp_path):
    local, back = tmp_path / "run", tmp_path / "back"
    (local / "checkpoints").mkdir(parents=True)
    (local / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    (local / "checkpoints" / ".last.ckpt.saving").write_bytes(b"half")  # a save in progress
    (local / "summary.json").write_text("{}")
    stored = StoredRunDir(f"file://{tmp_path / 'storage'}", str(local))
    assert stored.upload_changed("checkpoints") == 1 and stored.upload_changed() == 1
    assert stored.upload_changed() == 0  # nothing new
    (local / "summary.json").write_text('{"other": "node"}')  # another node's file of the same name
    (local / "rank1.json").write_text("{}")
    assert stored.upload_changed(only_new=True) == 1 and (tmp_path / "storage" / "summary.json").read_text() == "{}"
    copy = StoredRunDir(f"file://{tmp_path / 'storage'}", str(back))
    assert copy.download(skip=("checkpoints",)) == 2 and (back / "summary.json").is_file()
    assert copy.download() == 3
    # storage's own write time (the resume search picks the newest checkpoint by it)
    written = (tmp_path / "storage" / "checkpoints" / "last.ckpt").stat().st_mtime_ns
    assert (back / "checkpoints" / "last.ckpt").stat().st_mtime_ns == written


@pytest.mark.slow
def test_sigterm_on_the_worker_is_handed_to_the_loop_and_a_second_one_exits():
    previous = signal.getsignal(signal.SIGTERM)
    exits = []
    signal.signal(signal.SIGTERM, lambda signum, frame: exits.append(signum))
    try:
        ray_worker.on_main_thread(ray_worker.install_stop_handler)
        os.kill(os.getpid(), signal.SIGTERM)
        assert ray_worker.state.stop_requested.is_set() and exits == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits == [signal.SIGTERM]  # the handler there before: Ray's, which exits
        ray_worker.on_main_thread(ray_worker.restore_stop_handler)
    finally:
        signal.signal(signal.SIGTERM, previous)
        ray_worker.state.stop_requested.clear()


def job_config(tmp_path, *overrides):
    from helpers.configs import compose_full
    from omegaconf import OmegaConf

    config = compose_full(["hydra/launcher=ray", f"paths.root_dir={tmp_path}/outputs",
                           f"hydra.sweep.dir={tmp_path}/outputs/default/multiruns/t", *overrides])
    OmegaConf.set_struct(config, False)
    config.hydra.job.num = 0
    return config


@pytest.mark.slow
def test_a_jobs_run_dir_is_in_its_storage_and_the_sweep_reads_it_there_or_from_its_copy(tmp_path):
    from hydra_plugins.litscale_plugins.ray_launcher import checked_settings, prepare_job_config

    sweep = f"{tmp_path}/outputs/default/multiruns/t"
    plain = checked_settings(job_config(tmp_path))
    assert (plain.run_sweep_dir, plain.local_run_dir, plain.storage_uri) == (sweep, f"{sweep}/0", None)
    shared = checked_settings(job_config(tmp_path, "hydra.launcher.storage=/shared"))
    assert shared.run_sweep_dir == "/shared/default/multiruns/t" and shared.local_run_dir == f"{shared.run_sweep_dir}/0"
    assert shared.ray_storage_path == "/shared/default/multiruns/t/.ray"
    uri = checked_settings(job_config(tmp_path, "hydra.launcher.storage=s3://bucket/runs"))
    assert uri.storage_uri == "s3://bucket/runs/default/multiruns/t/0" and uri.staging == "default/multiruns/t"
    assert (uri.run_sweep_dir, uri.local_run_dir) == (sweep, f"{sweep}/0")  # the driver's copy
    config = job_config(tmp_path, "hydra.launcher.max_failures=1", "callbacks=none")
    prepare_job_config(config, shared, max_failures=1)
    assert config.ckpt_path == "here" and config.hydra.sweep.dir == shared.run_sweep_dir
    target = "hydra_plugins.litscale_plugins._ray_worker_callback.RayWorkerCallback"
    assert config.callbacks.ray_worker._target_ == target and list(config.allowed_targets) == [target]
    with pytest.raises(ConfigError, match="^hydra.launcher.min_workers=1 / max_workers=2 runs the job"):
        checked_settings(job_config(tmp_path, "strategy=fsdp", "hydra.launcher.min_workers=1",
                                                 "hydra.launcher.max_workers=2"))


@pytest.mark.slow  # composes two jobs: about half a second
def test_an_elastic_jobs_ranks_get_elastic_true(tmp_path):
    """Ray picks an elastic job's worker count at each attempt: its ranks resume at a sample
    position they can share out (``elastic=true``) instead of failing at every attempt."""
    from hydra_plugins.litscale_plugins.ray_launcher import checked_settings, prepare_job_config

    configs = {"elastic": job_config(tmp_path, "strategy=ddp", "hydra.launcher.min_workers=1",
                                     "hydra.launcher.max_workers=4"),
               "fixed": job_config(tmp_path, "strategy=ddp")}
    for config in configs.values():
        prepare_job_config(config, checked_settings(config), max_failures=1)
    assert {name: config.elastic for name, config in configs.items()} == {"elastic": True, "fixed": False}


def test_a_rank_stopped_on_sigterm_fails_on_purpose_and_rank_zero_says_why(monkeypatch, capsys):
    from hydra_plugins.litscale_plugins.ray_launcher import raise_preempted

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ray_worker.RayWorkerPreempted, match="^rank 0 stopped at step 3 on SIGTERM and saved last.ckpt$"):
        raise_preempted(2, 3)
    assert capsys.readouterr().out == ("litscale: job 2 stopped at step 3 on SIGTERM and saved last.ckpt; Ray starts "
                                       "it again from there while hydra.launcher.max_failures allows\n")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ray_worker.RayWorkerPreempted):
        raise_preempted(2, 3)
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_a_ray_setting_that_cannot_work_stops_the_sweep_in_one_line_before_it_starts(capsys):
    from helpers.cli import check_command

    code, _, err = check_command(["-m", "hydra/launcher=ray", "strategy=ddp", "trainer.accelerator=cpu",
                                  "trainer.devices=2", "hydra.launcher.storage=runs"], capsys)
    assert code != 0 and err == (f"error: hydra.launcher.storage='runs' is a relative path, which names another "
                                 f"dir on each node; {ALLOWED}\n")
    code, _, err = check_command(["-m", "hydra/launcher=ray", "strategy=fsdp", "trainer.accelerator=cpu",
                                  "trainer.devices=2", "hydra.launcher.min_workers=1",
                                  "hydra.launcher.max_workers=2"], capsys)
    assert code != 0 and err.startswith("error: hydra.launcher.min_workers=1 / max_workers=2 runs the job") and \
        err.count("\n") == 1
