"""The suite's faults that an engine meets rather than the job (``faults.py``): a Kubernetes pod
deleted, seen by the k8s launcher through the stub API server of ``tests/test_k8s.py``, and a
Ray worker killed under ``hydra/launcher=ray`` on a local Ray instance."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time
from pathlib import Path

from fault_runs import REPO, fault_record, launch, verdict, when_recorded

from litscale.checkpoint.resume import newest_last_checkpoint


class StampedLines(io.TextIOBase):
    """A stdout that keeps each line with the wall-clock time it was printed."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self._partial = ""

    def write(self, text: str) -> int:
        *complete, self._partial = (self._partial + text).split("\n")
        self.lines += [(time.time(), line) for line in complete]
        return len(text)


# When the pod goes, after the launcher first sees its job running.
DELETED_AFTER_S = 0.5


def _stub_cluster(outputs: Path):
    """A stub API server on a free port: a job shows as created; a job in ``failing`` loses its
    pod ``DELETED_AFTER_S`` after the first GET and answers Failed from then on (the JobSet under
    a TrainJob does not replace it), others Complete. Returns (server, handler class, kubeconfig)."""
    import threading
    from http.server import ThreadingHTTPServer

    import yaml
    from test_k8s import StubApiServer

    class PodDeleted(StubApiServer):
        first_get: dict[str, float] = {}
        deleted_at: list[float] = []

        def do_GET(self):  # noqa: N802 - http.server's name
            name = self.path.rstrip("/").rsplit("/", 1)[-1]
            seen = self.first_get.setdefault(name, time.time())
            body = next(c["body"] for c in self.created if c["body"]["metadata"]["name"] == name)
            conditions = [{"type": "Created", "status": "True"}]
            gone = seen + DELETED_AFTER_S
            if name in self.failing and time.time() >= gone:
                self.deleted_at[:] = self.deleted_at or [gone]
                conditions.append({"type": "Failed", "status": "True", "reason": "JobsFailed",
                                   "message": "pod node-0-0 was deleted"})
            elif name not in self.failing and time.time() >= gone:
                conditions.append({"type": "Complete", "status": "True", "reason": "JobsCompleted",
                                   "message": "all nodes finished"})
            self._answer(200, {**body, "status": {"conditions": conditions}})

    PodDeleted.created, PodDeleted.failing = [], set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), PodDeleted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = outputs / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "users": [{"name": "stub", "user": {"token": "stub"}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}]}))
    return server, PodDeleted, kubeconfig


POLL_S = 2.0


def pod_deleted(outputs: Path) -> dict:
    """A TrainJob whose pod is deleted while it runs: its JobSet fails, and the k8s launcher,
    waiting on it, creates it again in the same run dir (``max_restarts=1``)."""
    from hydra_plugins.litscale_plugins.k8s import submit_and_wait
    from hydra_plugins.litscale_plugins.k8s_manifests import trainjob

    server, stub, kubeconfig = _stub_cluster(outputs)
    params = {"image": "litscale:cpu", "working_dir": "/workspace/litscale", "nodes": 1, "processes_per_node": 2,
              "outputs_mount": "/outputs", "outputs_claim": "litscale-outputs", "namespace": "default",
              "runtime": "torch-distributed", "kubeconfig": str(kubeconfig), "poll_s": POLL_S, "max_restarts": 1,
              "wait_timeout_min": 2}
    manifest = trainjob("litscale-faults-0", ["trainer.devices=2", "strategy=ddp", "ckpt_path=here"], params)
    stub.failing = {manifest["metadata"]["name"]}
    printed = StampedLines()
    try:
        with contextlib.redirect_stdout(printed):
            (outcome,) = submit_and_wait([manifest], params)
    finally:
        server.shutdown()
    said = verdict(printed.lines, stub.deleted_at[0] if stub.deleted_at else 0.0,
                   re.compile(r"failed; creating it again"))
    return {"verdict": said.line, "detected": said.detected, "seconds": said.seconds, "steps_lost": None,
            "resumed_from_step": None, "data_lost": "n/a (no pods run)", "finished": outcome is None,
            "exits": [], "stray": [], "run_seconds": None,
            "created": [c["body"]["metadata"]["name"] for c in stub.created],
            "note": "stub API server (tests/test_k8s.py): no pods run, so the steps a pod loses (those since "
                    "the last checkpoint, resumed with ckpt_path=here) are not measured; the launcher sees the failure at its "
                    f"next poll (hydra.launcher.poll_s={POLL_S:g} here, 10 by default)"}


def ray_worker_killed(outputs: Path, run: tuple[str, ...], fault: list[str], record: Path,
                      steps: int, timeout: float) -> dict:
    """Rank 1's Ray worker SIGKILLed at step 10 of a 2-worker job on a local Ray instance; Ray
    starts the job again (``max_failures=1``) and it resumes its own checkpoint."""
    sweep = outputs / "ray"
    snapshot: dict[str, int | None] = {}

    def newest_checkpoint_then(process) -> None:  # what the restart can resume from, at the kill
        path = newest_last_checkpoint(str(sweep))
        import torch

        snapshot["step"] = None if path is None else int(
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])

    first = launch([sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=ray", "hydra.launcher.max_failures=1",
                    *run, *fault, f"hydra.sweep.dir={sweep}"], outputs=outputs, timeout=timeout,
                   act=when_recorded(record, newest_checkpoint_then, poll_s=0.02))
    acted = fault_record(record)
    # (a line from Ray's controller or a worker comes under Ray's prefix, "(TrainController pid=...) ")
    said = verdict(first.lines, acted["time"] if acted else first.started,
                   re.compile(r"^(\([^)]*\) )?(error: |litscale: .*(fail|restart|lost|died|again))"))
    summaries = [json.loads(p.read_text()) for p in sweep.rglob("summary.json")]
    finished = first.exit == 0 and any(s.get("steps") == steps for s in summaries)
    resumed_from = snapshot.get("step")
    # what the user sees instead where litscale says nothing: Ray's own lines
    fault_at = acted["time"] if acted else first.started
    printed = [line[:200] for at, line in first.lines if at >= fault_at and line.strip()][:6]
    return {"verdict": said.line, "detected": said.detected, "seconds": said.seconds,
            "steps_lost": None if acted is None else acted["step"] - (resumed_from or 0),
            "resumed_from_step": resumed_from, "data_lost": "none" if finished else "summary.json missing",
            "finished": finished, "exits": [first.exit], "stray": first.stray, "run_seconds": round(first.seconds, 1),
            "printed_after_the_fault": printed, "note": "local Ray; max_failures=1: Ray starts the job's workers again"}
