"""``-m hydra/launcher=k8s``: TrainJob and PyTorchJob manifests sized from each job's trainer
settings validate against the vendored CRD schemas, under names no rerun takes again, and with
``submit=true`` a stub API server (the ``kubernetes`` client pointed at it through a
kubeconfig) receives exactly the manifests written; waiting survives a job not yet visible,
names one deleted, and gives up at its timeout. Every plugin module imports without the
engines' packages (a base install's Hydra plugin scan prints nothing)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from helpers.cli import REPO, check_command, explain, run_train
from helpers.configs import compose_full

from hydra_plugins.litscale_plugins.k8s import (
    KubernetesLauncher,
    job_name,
    launch_line,
    launch_token,
    submit_and_wait,
)
from hydra_plugins.litscale_plugins.k8s_manifests import (
    NODES_AT_RENDEZVOUS,
    SCHEMAS,
    elastic_args,
    manifest_problems,
)
from litscale.errors import ConfigError


def manifest_for(tmp_path: Path, *overrides: str) -> dict:
    config = compose_full(
        ["hydra/launcher=k8s", f"hydra.sweep.dir={tmp_path}/2026-11-25_18-31-00", *overrides]
    )
    manifest, _, _ = KubernetesLauncher.manifest(
        config, list(overrides), Path(str(config.hydra.sweep.dir)), 3, "a1b2c3"
    )
    return manifest


@pytest.mark.slow
def test_trainjob_sized_from_the_trainer_validates_against_the_vendored_schema(tmp_path):
    manifest = manifest_for(tmp_path, "trainer.devices=8", "trainer.num_nodes=4", "strategy=fsdp")
    assert manifest_problems(manifest) == []
    assert (
        manifest["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and manifest["kind"] == "TrainJob"
    )
    assert manifest["metadata"]["name"] == "litscale-20261125183100-a1b2c3-3"
    trainer = manifest["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 8)
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 8}
    assert trainer["command"] == [
        "torchrun",
        "/workspace/litscale/train.py",
        "trainer.devices=8",
        "trainer.num_nodes=4",
        "strategy=fsdp",
        "hydra.run.dir=/outputs/default/multiruns/2026-11-25_18-31-00/a1b2c3/3",
        "ckpt_path=here",  # a restarted job resumes from its own run dir
    ]
    assert manifest["spec"]["runtimeRef"]["name"] == "torch-distributed"


@pytest.mark.slow
def test_pytorchjob_has_a_master_and_workers_and_cpu_jobs_ask_for_no_gpu(tmp_path):
    manifest = manifest_for(
        tmp_path,
        "hydra.launcher.api=pytorchjob",
        "trainer.devices=2",
        "trainer.num_nodes=3",
        "trainer.accelerator=cpu",
        "hydra.launcher.cpu_per_node=4",
    )
    assert manifest_problems(manifest) == []
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
    assert manifest["spec"]["nprocPerNode"] == "2"
    (container,) = replicas["Master"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"cpu": "4"}
    assert container["command"][:3] == [
        "torchrun",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
    ]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """``docker/Dockerfile`` as (instruction, arguments), continuation lines joined."""
    text = (REPO / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.slow  # runs make -n
def test_the_manifests_run_the_image_the_dockerfile_builds_where_it_puts_train_py(tmp_path):
    """``make image`` / ``make image-cuda`` build docker/Dockerfile under the tags a job's
    manifest names by default (by its accelerator), into the working dir the manifest runs
    train.py from, with what train.py reads there; the image's outputs are the volume's mount."""
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    builds = {}
    for target in ("image", "image-cuda"):
        command = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=REPO, capture_output=True, text=True, check=True).stdout
        assert command.startswith("docker build -f docker/Dockerfile "), command
        builds[target] = command.split(" -t ", 1)[1].split()[0]
    assert builds == {"image": f"litscale:{version}-cpu", "image-cuda": f"litscale:{version}-cuda"}

    cpu = manifest_for(tmp_path, "hydra.launcher.api=pytorchjob", "trainer.accelerator=cpu")
    (container,) = cpu["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    gpu = manifest_for(tmp_path, "trainer.devices=8")
    assert (container["image"], gpu["spec"]["trainer"]["image"]) == (builds["image"], builds["image-cuda"])
    assert manifest_for(tmp_path, "hydra.launcher.image=registry/litscale:1")["spec"]["trainer"]["image"] == (
        "registry/litscale:1")  # the user's own, as given

    instructions = dockerfile_instructions()
    workdir = [args for kind, args in instructions if kind == "WORKDIR"]
    assert workdir == [container["workingDir"]] and gpu["spec"]["trainer"]["command"][1] == f"{workdir[0]}/train.py"
    copied = {args.split()[0] for kind, args in instructions if kind == "COPY"}
    assert copied == {"pyproject.toml", "src", "conf", "train.py"}
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert not [path for path in ("pyproject.toml", "constraints.txt", "README.md", "src", "conf", "train.py")
                if path in ignored]
    mount = container["volumeMounts"][0]["mountPath"]
    assert ("ENV", f"LITSCALE_OUTPUTS={mount}") in instructions
    # The one torch pin the image installs from torch's index: constraints.txt's, less its +cpu label.
    pins = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch==")]
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [pin.split("+")[0] for pin in pins] == [d for d in dependencies if d.startswith("torch==")]


def test_schema_refuses_unknown_fields_and_wrong_types(tmp_path):
    manifest = manifest_for(tmp_path, "trainer.devices=8")
    manifest["spec"]["trainer"]["numNodes"] = "four"
    manifest["spec"]["trainer"]["numGPUs"] = 8
    assert manifest_problems(manifest) == [
        "spec.trainer: Additional properties are not allowed ('numGPUs' was unexpected)",
        "spec.trainer.numNodes: 'four' is not of type 'integer'",
    ]
    for path in (SCHEMAS / "trainjob.yaml", SCHEMAS / "pytorchjob.yaml"):  # version and source
        header = path.read_text()[:600]
        assert (
            "# Source: https://github.com/kubeflow/trainer/blob/v" in header and "commit" in header
        )


def test_job_names_are_dns_labels_unique_per_job_and_per_launch():
    sweep = Path("/o/multiruns/2026-11-25_18-31-00")
    assert job_name("LitScale_x", sweep, 12, "a1b2c3") == "litscale-x-20261125183100-a1b2c3-12"
    # The same sweep dir run again (a resumed Optuna study, hydra.sweep.dir given again) is
    # another launch: its jobs must not collide with the first run's objects in the cluster.
    tokens = {launch_token() for _ in range(20)}
    assert len(tokens) == 20 and all(len(t) == 6 and t.isalnum() and t[0].isalpha() for t in tokens)
    names = {job_name("litscale", sweep, n, t) for n in (0, 1) for t in tokens}
    assert len(names) == 40


class StubApiServer(BaseHTTPRequestHandler):
    """Just enough of the Kubernetes API for custom objects: create records the body; get
    answers with the object, its job complete."""

    created: list[dict] = []
    failing: set[str] = set()  # job names whose pods failed past the operator's restarts
    fail_first_runs = False  # every job's first run fails (its runs again, <name>-r<k>, do not)
    # job name -> how many GETs answer 404 before the job shows (None: it never does, a
    # negative count: it shows once, then is gone)
    missing: dict[str, int | None] = {}

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.created.append({"path": self.path, "body": body})
        self._answer(201, body)

    def do_GET(self):  # noqa: N802
        name = self.path.rstrip("/").rsplit("/", 1)[-1]
        (body,) = [c["body"] for c in self.created if c["body"]["metadata"]["name"] == name]
        if name in self.missing:
            left = self.missing[name]
            if left is None or left > 0:
                self.missing[name] = None if left is None else left - 1
                return self._answer(404, {"kind": "Status", "reason": "NotFound", "code": 404})
            if left < 0:  # shown once, running: deleted from the next GET on
                self.missing[name] = None
                return self._answer(200, {**body, "status": {"conditions": []}})
        done = "Complete" if body["kind"] == "TrainJob" else "Succeeded"
        if name in self.failing or (self.fail_first_runs and not re.search(r"-r[0-9]+$", name)):
            done = "Failed"
        self._answer(
            200,
            {
                **body,
                "status": {
                    "conditions": [
                        {"type": "Created", "status": "True"},
                        {
                            "type": done,
                            "status": "True",
                            "reason": "JobsCompleted",
                            "message": "all nodes finished",
                        },
                    ]
                },
            },
        )

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_cluster(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubApiServer)
    StubApiServer.created, StubApiServer.missing, StubApiServer.failing = [], {}, set()
    StubApiServer.fail_first_runs = False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "stub",
                "clusters": [
                    {
                        "name": "stub",
                        "cluster": {"server": f"http://127.0.0.1:{server.server_port}"},
                    }
                ],
                "users": [{"name": "stub", "user": {"token": "stub"}}],
                "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
            }
        )
    )
    yield kubeconfig, StubApiServer.created
    server.shutdown()


@pytest.mark.full
@pytest.mark.slow
def test_submit_creates_exactly_the_written_manifests(stub_cluster, tmp_path):
    pytest.importorskip("kubernetes")
    kubeconfig, created = stub_cluster
    process = run_train(
        "-m",
        "hydra/launcher=k8s",
        "hydra.launcher.submit=true",
        f"hydra.launcher.kubeconfig={kubeconfig}",
        "hydra.launcher.poll_s=0.1",
        "hydra.launcher.namespace=research",
        "trainer.devices=1,2",
        "strategy=ddp",
        f"hydra.sweep.dir={tmp_path}/sweep",
        outputs=tmp_path,
        timeout=180,
    )
    assert process.returncode == 0, explain(process)
    written = [
        yaml.safe_load(p.read_text()) for p in sorted((tmp_path / "sweep" / "k8s").glob("*.yaml"))
    ]
    assert [c["body"] for c in created] == written and len(written) == 2
    assert [c["path"] for c in created] == [
        "/apis/trainer.kubeflow.org/v1alpha1/namespaces/research/trainjobs"
    ] * 2
    assert [m["spec"]["trainer"]["numProcPerNode"] for m in written] == [1, 2]
    for manifest in written:
        assert (
            f"TrainJob {manifest['metadata']['name']}: Complete (JobsCompleted: all nodes finished)"
            in process.stdout
        )


def run_dir_of(command: list[str]) -> str:
    (run_dir,) = [a.removeprefix("hydra.run.dir=") for a in command if a.startswith("hydra.run.dir=")]
    return run_dir


@pytest.mark.full
@pytest.mark.slow
def test_a_rerun_into_the_same_sweep_dir_starts_fresh_in_run_dirs_of_its_own(stub_cluster, tmp_path):
    """The same sweep run again into the same ``hydra.sweep.dir`` is a new launch: its job trains
    in a run dir of its own, never resuming the first launch's checkpoints (``ckpt_path=here``
    there), and says so; a TrainJob created again within a launch keeps its run dir."""
    pytest.importorskip("kubernetes")
    kubeconfig, created = stub_cluster
    StubApiServer.fail_first_runs = True  # each launch's job fails once and is created again
    sweep = ("-m", "hydra/launcher=k8s", "hydra.launcher.submit=true", f"hydra.launcher.kubeconfig={kubeconfig}",
             "hydra.launcher.poll_s=0.1", "hydra.launcher.max_restarts=1", "trainer.devices=1",
             f"hydra.sweep.dir={tmp_path}/sweep")

    def launched() -> tuple[list[str], list[str], str]:
        """The names and run dirs of what one run of the command created, and its launch line."""
        created.clear()
        process = run_train(*sweep, outputs=tmp_path, timeout=180)
        assert process.returncode == 0, explain(process)
        bodies = [c["body"] for c in created]
        lines = [line for line in process.stdout.splitlines() if line.startswith("litscale: k8s launch ")]
        return ([b["metadata"]["name"] for b in bodies], [run_dir_of(b["spec"]["trainer"]["command"]) for b in bodies],
                "\n".join(lines))

    names, run_dirs, line = launched()
    assert names[1:] == [f"{names[0]}-r1"] and run_dirs[0] == run_dirs[1]  # the restart resumes its own run dir
    again_names, again_run_dirs, again_line = launched()  # the same command, later
    assert again_run_dirs[0] != run_dirs[0] and again_run_dirs[0] == again_run_dirs[1]
    assert not set(again_names) & set(names)
    for run_dir, said in ((run_dirs[0], line), (again_run_dirs[0], again_line)):
        (launch,) = re.findall(r"^/outputs/default/multiruns/sweep/([a-z][0-9a-f]{5})/0$", run_dir)
        assert said == (f"litscale: k8s launch {launch}: a new launch, in run dirs of its own "
                        f"(/outputs/default/multiruns/sweep/{launch}/<job>): its jobs start fresh there unless they "
                        "name a ckpt_path, and a pod restarted within the launch resumes its own; "
                        f"hydra.launcher.launch={launch} runs them again, resuming")


def test_a_launch_named_again_runs_its_jobs_again_in_its_run_dirs_under_new_names(tmp_path):
    """``hydra.launcher.launch=<id>``: the jobs run in that launch's run dirs again, resuming
    (``ckpt_path=here``), under names no earlier run of the command took."""
    config = compose_full(["hydra/launcher=k8s", f"hydra.sweep.dir={tmp_path}/sweep", "hydra.launcher.launch=a1b2c3"])
    launcher = KubernetesLauncher(**{k: v for k, v in config.hydra.launcher.items() if k != "_target_"})
    launcher.setup(hydra_context=None, task_function=None, config=config)
    assert launcher.run_launch == "a1b2c3" and launcher.launch_token != "a1b2c3"
    manifest, _, run_dir = KubernetesLauncher.manifest(config, [], Path(str(config.hydra.sweep.dir)), 0,
                                                       launcher.launch_token, launcher.run_launch)
    assert run_dir == "/outputs/default/multiruns/sweep/a1b2c3/0"
    assert manifest["spec"]["trainer"]["command"][-2:] == [f"hydra.run.dir={run_dir}", "ckpt_path=here"]
    assert manifest["metadata"]["name"] == f"litscale-sweep-{launcher.launch_token}-0"[:63]
    assert launch_line("a1b2c3", True, "/outputs/default/multiruns/sweep/a1b2c3") == (
        "litscale: k8s launch a1b2c3 run again (hydra.launcher.launch=a1b2c3): each job resumes from the newest "
        "complete checkpoint of its run dir, /outputs/default/multiruns/sweep/a1b2c3/<job> (ckpt_path=here), unless "
        "it names a ckpt_path")


@pytest.mark.slow  # composes the config
def test_a_launch_id_that_no_launch_has_is_refused_in_one_line_before_the_sweep(capsys):
    code, _, err = check_command(["-m", "hydra/launcher=k8s", "hydra.launcher.launch=123456"], capsys)
    assert (code, err) == (2, "error: hydra.launcher.launch=123456 is not a launch's id; allowed: null (a new "
                              "launch, its jobs in run dirs of their own) or the id of an earlier launch of this "
                              "sweep (a letter and 5 hex digits), as its first line names it (its jobs run again in "
                              "its run dirs, resuming)\n")


@pytest.mark.slow
def test_a_pytorchjob_is_created_and_waited_for(stub_cluster, tmp_path):
    pytest.importorskip("kubernetes")
    kubeconfig, created = stub_cluster
    manifest = manifest_for(
        tmp_path, "hydra.launcher.api=pytorchjob", "trainer.devices=2", "trainer.num_nodes=2"
    )
    params = {"kubeconfig": str(kubeconfig), "namespace": "default", "poll_s": 0.01}
    assert submit_and_wait([manifest], params) == [None]
    assert created == [
        {"path": "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs", "body": manifest}
    ]


@pytest.mark.slow
def test_a_failed_trainjob_runs_again_in_its_run_dir_resuming_until_its_restarts_are_spent(stub_cluster, tmp_path,
                                                                                            capsys):
    pytest.importorskip("kubernetes")
    kubeconfig, created = stub_cluster
    first = manifest_for(tmp_path, "trainer.devices=2", "hydra.launcher.max_restarts=2")
    name = first["metadata"]["name"]
    assert first["spec"]["trainer"]["command"][-2:] == [
        "hydra.run.dir=/outputs/default/multiruns/2026-11-25_18-31-00/a1b2c3/3", "ckpt_path=here"]
    StubApiServer.failing = {name}
    params = {"kubeconfig": str(kubeconfig), "namespace": "default", "poll_s": 0.01, "max_restarts": 2}
    assert submit_and_wait([first], params) == [None]  # its second run completed
    again = created[1]["body"]
    assert [c["body"]["metadata"]["name"] for c in created] == [name, f"{name}-r1"]
    assert again["spec"] == first["spec"]  # the same run dir, resuming from its checkpoints
    assert (f"litscale: TrainJob {name} failed; creating it again as {name}-r1 (restart 1 of "
            "hydra.launcher.max_restarts=2): it resumes from the newest complete checkpoint of its run dir "
            "(ckpt_path=here)") in capsys.readouterr().out

    created.clear()
    StubApiServer.failing = {name, f"{name}-r1", f"{name}-r2"}
    (outcome,) = submit_and_wait([first], params)
    assert [c["body"]["metadata"]["name"] for c in created] == [name, f"{name}-r1", f"{name}-r2"]
    assert str(outcome) == f"TrainJob {name}-r2 failed: all nodes finished"


def test_a_pytorchjob_is_restarted_by_its_operator_and_a_named_checkpoint_is_kept(tmp_path):
    manifest = manifest_for(tmp_path, "hydra.launcher.api=pytorchjob", "ckpt_path=last")
    assert manifest_problems(manifest) == [] and manifest["spec"]["runPolicy"] == {"backoffLimit": 3}
    (container,) = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["command"][-2:] == ["ckpt_path=last", "hydra.run.dir=/outputs/default/multiruns/"
                                         "2026-11-25_18-31-00/a1b2c3/3"]  # the user's choice, not ckpt_path=here


@pytest.mark.slow
def test_waiting_survives_a_job_not_yet_visible_and_names_a_deleted_one(stub_cluster, tmp_path, capsys):
    pytest.importorskip("kubernetes")
    kubeconfig, _ = stub_cluster
    late, deleted = (manifest_for(tmp_path / name, "trainer.devices=1") for name in ("late", "deleted"))
    deleted["metadata"]["name"] += "-x"
    StubApiServer.missing = {late["metadata"]["name"]: 2, deleted["metadata"]["name"]: -1}
    params = {"kubeconfig": str(kubeconfig), "namespace": "default", "poll_s": 0.01}
    outcomes = submit_and_wait([late, deleted], params)
    assert outcomes[0] is None  # 404 twice (not yet visible), then Complete
    assert str(outcomes[1]) == f"TrainJob {deleted['metadata']['name']} was deleted before it ended"


@pytest.mark.slow
def test_waiting_gives_up_at_its_timeout_and_the_job_goes_on(stub_cluster, tmp_path, capsys):
    pytest.importorskip("kubernetes")
    kubeconfig, _ = stub_cluster
    never = manifest_for(tmp_path, "trainer.devices=1")
    StubApiServer.missing = {never["metadata"]["name"]: None}
    params = {"kubeconfig": str(kubeconfig), "namespace": "default", "poll_s": 0.01,
              "wait_timeout_min": 0.002}
    (outcome,) = submit_and_wait([never], params)
    line = (f"TrainJob {never['metadata']['name']} had not ended after "
            "hydra.launcher.wait_timeout_min=0.002; it goes on in the cluster")
    assert isinstance(outcome, TimeoutError) and str(outcome) == line
    assert capsys.readouterr().out.splitlines()[-1] == f"litscale: {line}"


# Every engine a plugin module could need, blocked as on a base install (``pip install -e .``).
ENGINES = ("hydra_plugins.hydra_submitit_launcher", "submitit", "ray", "optuna", "kubernetes",
           "sky", "jsonschema")
IMPORT_EVERY_PLUGIN = f"""
import importlib, pkgutil, sys

class NoEngines:
    def find_spec(self, name, path=None, target=None):
        if any(name == e or name.startswith(e + ".") for e in {ENGINES!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}}")

sys.meta_path.insert(0, NoEngines())
import hydra_plugins.litscale_plugins as package
names = [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in names:
    importlib.import_module(name)  # as Hydra's plugin scan does
print(" ".join(sorted(n.rsplit(".", 1)[1] for n in names)))
"""


@pytest.mark.full
@pytest.mark.slow  # a fresh interpreter
def test_every_plugin_module_imports_without_its_engine():
    """Hydra imports every module under ``hydra_plugins`` on every command and warns in 6 lines
    for each that fails; a module imports its engine where it is used."""
    process = subprocess.run([sys.executable, "-c", IMPORT_EVERY_PLUGIN],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 0 and process.stderr == "", explain(process)
    assert process.stdout.split() == ["_ray_restarts", "_ray_worker_callback", "_ray_worker_state", "jobs", "k8s", "k8s_manifests", "optuna_space",
                                      "optuna_study", "optuna_sweeper", "ray_launcher", "ray_settings", "ray_storage",
                                      "ray_worker", "skypilot", "skypilot_outputs", "slurm", "strategy_kind", "sweeper"]
    plugin_packages = [p.name for p in Path(__file__).parents[1].joinpath("src", "hydra_plugins").iterdir()
                       if p.is_dir() and not p.name.startswith("__")]
    assert plugin_packages == ["litscale_plugins"]


# --- an elastic PyTorchJob ------------------------------------------------------------------------

ELASTIC = ("hydra.launcher.api=pytorchjob", "hydra.launcher.min_nodes=1", "hydra.launcher.max_nodes=4",
           "trainer.num_nodes=2", "trainer.devices=2", "trainer.accelerator=cpu", "strategy=ddp")


@pytest.mark.slow
def test_an_elastic_pytorchjob_has_workers_only_and_an_elastic_policy(tmp_path):
    manifest = manifest_for(tmp_path, *ELASTIC)
    assert manifest_problems(manifest) == []
    spec = manifest["spec"]
    assert spec["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 4, "maxRestarts": 3}
    assert list(spec["pytorchReplicaSpecs"]) == ["Worker"] and spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    (container,) = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    # torchrun takes its node range and rendezvous from the operator's PET_* variables; the run,
    # its node count from the pods that met (torchrun's GROUP_WORLD_SIZE), at every start, and
    # elastic=true: a resume on another count skips to a sample position it can share out
    without_nodes = [o for o in ELASTIC if not o.startswith("trainer.num_nodes=")]
    assert container["command"] == ["torchrun", "train.py", *without_nodes,
                                    "hydra.run.dir=/outputs/default/multiruns/2026-11-25_18-31-00/a1b2c3/3", "ckpt_path=here",
                                    "trainer.num_nodes='${oc.decode:${oc.env:GROUP_WORLD_SIZE}}'", "elastic=true"]
    fixed = manifest_for(tmp_path, *ELASTIC[:1], *ELASTIC[3:])
    assert "elasticPolicy" not in fixed["spec"] and list(fixed["spec"]["pytorchReplicaSpecs"]) == ["Master", "Worker"]


def test_an_elastic_jobs_node_count_is_the_pods_that_met_at_the_rendezvous(monkeypatch):
    """The pods' argument composes to torchrun's count of nodes, whatever the manifest asked for."""
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    (nodes,) = [a for a in elastic_args(["trainer.num_nodes=2", "strategy=ddp"]) if a.startswith("trainer.num_nodes")]
    assert compose_full([nodes, "strategy=ddp"]).trainer.num_nodes == 3


def test_an_elastic_pytorchjobs_resume_skips_to_a_position_its_pods_share_out():
    """The pods run with ``elastic=true`` (a restart on fewer pods resumes where its ranks can),
    given once whatever the job's own overrides said."""
    args = elastic_args(["strategy=ddp", "elastic=false"])
    assert args[1:] == [NODES_AT_RENDEZVOUS, "elastic=true"]
    assert compose_full([args[0], args[2]]).elastic is True  # a key of the config


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "refusal"), [
    (("hydra.launcher.api=trainjob",),
     "hydra.launcher.min_nodes=1 / max_nodes=4 needs an elastic policy, which a Kubeflow TrainJob "
     "(hydra.launcher.api=trainjob) does not have; allowed: hydra.launcher.api=pytorchjob, or min_nodes=null "
     "max_nodes=null"),
    (("trainer.num_nodes=5",),
     "hydra.launcher.min_nodes=1 / max_nodes=4 is not an elastic range around the job's 5 nodes (trainer.num_nodes); "
     "allowed: both null, or two integers with 1 <= min_nodes <= trainer.num_nodes <= max_nodes"),
    (("strategy=fsdp",),
     "hydra.launcher.min_nodes=1 / max_nodes=4 runs the job on however many pods are up, which needs a replica of the "
     "whole model on each; strategy litscale.strategies.fsdp.FSDPStrategy splits it; allowed: a data-parallel "
     "strategy (ddp, local_sgd), or min_nodes=null max_nodes=null"),
])
def test_an_elastic_job_that_cannot_work_is_refused_in_one_line_before_the_sweep(overrides, refusal, tmp_path, capsys):
    code, _, err = check_command(["-m", "hydra/launcher=k8s", *ELASTIC, *overrides], capsys)
    assert (code, err) == (2, f"error: {refusal}\n")
    with pytest.raises(ConfigError) as refused:  # and by the launcher, per job
        manifest_for(tmp_path, *ELASTIC, *overrides)
    assert str(refused.value) == refusal
