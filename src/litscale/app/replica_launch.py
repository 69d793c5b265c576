"""Starting a ``fault_tolerance=replicas`` job: a lighthouse and one elastic agent per replica group.

This process hosts torchft's lighthouse (the service that tells the groups, step by step, which
of them are alive), unless ``fault_tolerance.lighthouse`` names one that is running. Each
replica group is one process here running torch's elastic agent, as ``torchrun
--max-restarts`` would for it: the agent starts the group's ``trainer.devices`` ranks and, when
one of them dies, stops the group's other ranks and starts the whole group again (up to
``fault_tolerance.max_restarts`` times), while the other groups train on
(``litscale.reliability.replica_groups``). Each group writes to ``<run dir>/replicas/<group>/``; the job's
``summary.json`` is the first finished group's, with what the faults cost added under
``fault_tolerance``.

A group still starting again when another group has finished the run is stopped then (its
ranks, if they got as far, see ``finished_marker`` and stop before their first step); one at
the final step gets ``FINISH_GRACE_S`` to write its summary.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from litscale.app.launch import RankFailure, launch
from litscale.reliability.replica_groups import (
    ReplicaGroup,
    ReplicaGroups,
    finished_marker,
    steps_log_path,
)

FINISH_GRACE_S = 60.0
# The groups of the last step write its row within moments of each other; only a group still
# behind this long after the run finished is counted as starting again.
ROWS_SETTLE_S = 5.0
STOP_GRACE_S = 30.0  # a group's agent stopping its ranks (they may be saving)
SIGNALLED_EXIT_S = 2.0  # time for the groups to stop on a signal they got themselves
# The lighthouse counts a group lost once its heartbeats (from a thread of torchft's own, in the
# group's rank 0) have stopped for this long: a killed or frozen group is left out of the next
# quorum after this.
HEARTBEAT_TIMEOUT_MS = 2000
# How often the lighthouse looks for a quorum to form: every step waits for one, and torchft's
# 100 ms default is a third of a small model's CPU step.
QUORUM_TICK_MS = 5
POLL_S = 0.2


def replicas_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "replicas")


def group_dir(run_dir: str, group: int) -> str:
    return os.path.join(replicas_dir(run_dir), str(group))


def launch_replica_groups(entrypoint: Callable[[Any], Any], spec: Any, *, replicas: ReplicaGroups) -> dict:
    """Run ``entrypoint`` on ``replicas.groups`` replica groups of the layout's processes each
    (``spec.layout``); return the job's summary."""
    groups, lighthouse = replicas.groups, replicas.lighthouse
    run_dir = spec.config["paths"]["output_dir"]
    os.makedirs(replicas_dir(run_dir), exist_ok=True)
    server = None
    os.environ.setdefault("RUST_LOG", "error")  # torchft's services log every quorum at info
    if lighthouse is None:
        from torchft.coordination import LighthouseServer

        # NOTE: the join timeout is how long a quorum waits for a group that still heartbeats but
        # has not asked yet (a slow step): at torchft's second, the groups' steps on a loaded
        # 2-core machine, seconds apart, left one group out of a quorum every few steps, and it
        # then had to heal from a peer.
        server = LighthouseServer(bind="[::]:0", min_replicas=replicas.min_replicas,
                                  join_timeout_ms=int(replicas.straggler_timeout_s * 1000),
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS, quorum_tick_ms=QUORUM_TICK_MS)
        lighthouse = server.address()
    from torch.distributed import TCPStore

    start_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    processes_by_group = {}
    try:
        for group in range(groups):
            identity = ReplicaGroup(group=group, groups=groups, lighthouse=lighthouse,
                                    start_store=f"127.0.0.1:{start_store.port}")
            process = context.Process(target=_run_group, name=f"replica-group-{group}",
                                      args=(entrypoint, _spec_of_group(spec, run_dir, identity), replicas.max_restarts))
            process.start()
            processes_by_group[group] = process
        exit_codes = _wait(processes_by_group, run_dir)
    finally:
        _stop(processes_by_group.values())
        if server is not None:
            server.shutdown()
    return _job_summary(run_dir, groups, exit_codes)


def _spec_of_group(spec: Any, run_dir: str, identity: ReplicaGroup) -> Any:
    """The job's spec for one group: its identity handed in, and the resolved config with every
    path under the run dir moved to the group's own (checkpoints, loggers, exports: groups never
    write the same file)."""
    ours = group_dir(run_dir, identity.group)

    def moved(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: moved(item) for key, item in value.items()}
        if isinstance(value, list):
            return [moved(item) for item in value]
        if isinstance(value, str) and (value == run_dir or value.startswith(run_dir + os.sep)):
            return ours + value[len(run_dir):]
        return value

    return dataclasses.replace(spec, config=moved(spec.config), replica_group=identity)


def _run_group(entrypoint: Callable[[Any], Any], spec: Any, max_restarts: int) -> None:
    """One replica group: its ranks under an elastic agent that starts them again when one dies."""
    group, processes = spec.replica_group.group, spec.layout.processes_per_node
    _share_the_machine(group, spec.layout)
    _end_with_parent()
    output_dir = spec.config["paths"]["output_dir"]
    os.makedirs(output_dir, exist_ok=True)
    try:
        result = launch(entrypoint, spec, processes=processes, max_restarts=max_restarts, agent=True)
    except RankFailure as error:
        _write_result(output_dir, {"error": str(error)})
        raise SystemExit(1) from None
    record = _read_steps(steps_log_path(output_dir))
    result["stopped_as_finished"] = bool(record and record[-1].get("stopped_as_finished"))
    _write_result(output_dir, result)
    if not result["stopped_as_finished"] and not result.get("preempted"):
        with open(finished_marker(output_dir), "w") as handle:
            handle.write(str(group))


def _share_the_machine(group: int, layout: Any) -> None:
    """Group ``group``'s own block of GPUs (each group's ranks count their GPUs from 0), and of
    CPU threads: the cores shared by every rank of every group (``app.build`` reads it)."""
    from litscale.app.scaling_study import THREADS_ENV
    from litscale.measure.flops import cores

    processes = layout.processes_per_node
    os.environ.setdefault(THREADS_ENV, str(max(1, cores() // layout.replica_processes)))
    import torch

    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices[group * processes:(group + 1) * processes])


def _end_with_parent() -> None:
    """SIGTERM to this group's agent when the job's process dies (Linux), so that no group
    outlives a job killed from outside; the agent then stops its ranks."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the job's own exit path stops the groups (``_stop``)


def _write_result(output_dir: str, result: dict) -> None:
    path = os.path.join(output_dir, "group_result.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(result, handle, default=str)
    os.replace(path + ".tmp", path)


def _wait(processes: dict[int, Any], run_dir: str) -> dict[int, int | None]:
    """Each group's exit code once all have ended (``None``: ended here).

    Once a group has finished the run, a group that is behind it (killed and still starting
    again: its processes were importing while the others trained on) is stopped at once, not
    waited for; one at the final step is given ``FINISH_GRACE_S`` to write its summary."""
    finished_at, final_step, stopped = None, None, set()
    while any(process.is_alive() for process in processes.values()):
        time.sleep(POLL_S)
        marker = finished_marker(group_dir(run_dir, 0))
        if finished_at is None and os.path.exists(marker):
            finished_at, final_step = time.monotonic(), _last_step(run_dir, int(Path(marker).read_text()))
        if finished_at is None:
            continue
        if time.monotonic() - finished_at < ROWS_SETTLE_S:
            continue
        for group, process in processes.items():
            if group not in stopped and process.is_alive() and _last_step(run_dir, group) < final_step:
                print(f"litscale: fault tolerance: the run finished while group {group} was starting again; "
                      "it is stopped", flush=True)
                process.terminate()
                stopped.add(group)
        if time.monotonic() - finished_at > FINISH_GRACE_S:
            break
    still_running = [process for process in processes.values() if process.is_alive()]
    _stop(still_running)
    return {group: None if process in still_running else process.exitcode for group, process in processes.items()}


def _last_step(run_dir: str, group: int) -> int:
    """The step of a group's newest committed row (-1: none since its last start)."""
    record = _group_record(run_dir, group)
    return -1 if not record or record[-1].get("started") else int(record[-1]["step"])


def _stop(processes: Any) -> None:
    """SIGTERM to each group's agent still running (it stops its ranks, which save on it), SIGKILL
    to one still there after ``STOP_GRACE_S``.

    NOTE: first a moment's wait: after a Ctrl-C the agents got the terminal's SIGINT too, and a
    SIGTERM on top interrupted their own shutdown (a traceback from inside their logging)."""
    alive = [process for process in processes if process.is_alive()]
    for process in alive:
        process.join(max(0.0, SIGNALLED_EXIT_S / len(alive)))
    alive = [process for process in alive if process.is_alive()]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _job_summary(run_dir: str, groups: int, exit_codes: dict[int, int | None]) -> dict:
    """The first finished group's summary, with what the faults cost; raise ``RankFailure`` when
    no group finished."""
    results = {}
    for group in range(groups):
        path = os.path.join(group_dir(run_dir, group), "group_result.json")
        if os.path.exists(path):
            with open(path) as handle:
                results[group] = json.load(handle)
    finished = [g for g, r in results.items()
                if "error" not in r and not r.get("stopped_as_finished") and not r.get("preempted")]
    if not finished and any(r.get("preempted") for r in results.values()):
        # Stopped (SIGTERM, Ctrl-C): each group saved its last.ckpt; ckpt_path=auto resumes
        # every group from the newest of them (the groups hold the same weights).
        return {"preempted": True, "output_dir": run_dir}
    if not finished:
        errors = "; ".join(f"group {g}: {r['error']}" for g, r in results.items() if "error" in r)
        raise RankFailure(f"no replica group finished the run ({errors or f'exit codes {exit_codes}'})")
    summary = dict(results[finished[0]])
    summary["fault_tolerance"] = costs(run_dir, groups, finished)
    summary.update(job_throughput(summary, run_dir, finished))
    summary["output_dir"] = run_dir
    with open(os.path.join(run_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=2, default=str)
    print(f"litscale: fault tolerance: {describe(summary['fault_tolerance'])}", flush=True)
    for group, result in results.items():  # the run finished without them: said, not fatal
        if "error" in result:
            print(f"litscale: fault tolerance: group {group} stopped for good (its restarts used up): "
                  f"{result['error']}", flush=True)
    print(f"litscale: job outputs: {run_dir} (summary.json; each group's run under replicas/<group>/)", flush=True)
    return summary


def costs(run_dir: str, groups: int, finished: list[int]) -> dict:
    """What the faults cost, from each group's step record: the longest time between two
    steps of a group that never stopped (and the median: a step's own time), the steps taken with fewer groups, the steps dropped,
    and each group's lives (a restarted group rejoins at a later step)."""
    records = {g: _group_record(run_dir, g) for g in range(groups)}
    # Stalled past the groups' timeout, alive, and stopped once it found the run finished without it.
    behind = sorted(g for g in range(groups) if records[g] and records[g][-1].get("behind_the_finished_run"))
    survivors = [g for g in finished if _lives(records[g]) == 1]
    pauses = [b["time"] - a["time"] for g in survivors for a, b in itertools.pairwise(records[g])]
    reference = [row for row in (records[survivors[0]] if survivors else records[finished[0]])
                 if "committed" in row]
    return {
        "groups": groups,
        "finished": sorted(finished),
        "not_finished": sorted(set(range(groups)) - set(finished) - set(behind)),
        "fell_behind": behind,
        "restarted": sorted(g for g in range(groups) if _lives(records[g]) > 1),
        "rejoined_at_step": {str(g): _rejoined_at(records[g]) for g in range(groups) if _lives(records[g]) > 1},
        "seconds_to_rejoin": {str(g): _seconds_to_rejoin(records[g]) for g in range(groups) if _lives(records[g]) > 1},
        "longest_pause_s": max(pauses, default=0.0),
        "median_step_s": statistics.median(pauses) if pauses else 0.0,
        "steps_with_fewer_groups": sum(1 for row in reference if row["groups"] < groups),
        "steps_dropped": sum(1 for row in reference if not row["committed"]),
        "final_step": reference[-1]["step"] if reference else 0,
        **fault_tolerance_waits(reference),
    }


# What each step waited for fault tolerance, as ``ReplicaFaultTolerance`` records it: the
# quorum (the rest of it ran beside the forward and backward), the sum over the groups
# (gradients and counts, one collective) and the commit vote.
WAITS = {"quorum_wait_s": "quorum", "reduce_s": "sum over the groups", "commit_s": "commit vote"}


def fault_tolerance_waits(rows: list[dict]) -> dict:
    """The median of each wait over the committed steps that recorded it (none in a record
    written before the waits were)."""
    return {f"median_{name}": statistics.median(values) for name in WAITS
            if (values := [row[name] for row in rows if row.get("committed") and name in row])}


def job_throughput(summary: dict, run_dir: str, finished: list[int]) -> dict:
    """The job's samples (and tokens) per second: each committed step's samples, counted for the
    groups in its quorum, over the seconds from the first step to the last of a group that never
    stopped (a group's own figure counts its share alone, over its own life)."""
    survivors = [g for g in finished if _lives(_group_record(run_dir, g)) == 1]
    rows = [row for row in _group_record(run_dir, (survivors or finished)[0])
            if "committed" in row]
    per_group = summary.get("micro_batch", 0) * summary.get("data_parallel_size", 0) * summary.get(
        "accumulate_grad_batches", 1)
    if len(rows) < 2 or not per_group:
        return {}
    samples = sum(row["groups"] * per_group for row in rows[1:] if row["committed"])
    rate = samples / (rows[-1]["time"] - rows[0]["time"])
    found = {"perf/samples_per_sec": rate}
    # The group's own ratio of tokens to samples; a task without tokens (classification) has none.
    if summary.get("perf/samples_per_sec") and "perf/tokens_per_sec" in summary:
        found["perf/tokens_per_sec"] = rate * summary["perf/tokens_per_sec"] / summary["perf/samples_per_sec"]
    return found


def describe(cost: dict) -> str:
    parts = []
    if cost["restarted"]:
        parts.append(f"group(s) {', '.join(map(str, cost['restarted']))} restarted and rejoined at step(s) "
                     f"{', '.join(str(s) for s in cost['rejoined_at_step'].values())} after "
                     f"{', '.join(f'{s:.1f}' for s in cost['seconds_to_rejoin'].values())} s")
    if cost["not_finished"]:
        parts.append(f"group(s) {', '.join(map(str, cost['not_finished']))} lost and not back by the end")
    if cost.get("fell_behind"):
        parts.append(f"group(s) {', '.join(map(str, cost['fell_behind']))} fell behind and stopped when the others "
                     "had finished the run (the results are a finished group's)")
    lost = "; ".join(parts) or "no group lost"
    waits = ", ".join(f"{what} {cost[f'median_{name}'] * 1000:.1f} ms" for name, what in WAITS.items()
                      if f"median_{name}" in cost)
    return (f"{cost['groups']} replica groups, {len(cost['finished'])} finished at step {cost['final_step']}; "
            f"{lost}; the longest step of a group that never stopped: {cost['longest_pause_s']:.2f} s "
            f"(median {cost['median_step_s']:.2f} s); "
            f"{cost['steps_with_fewer_groups']} step(s) with fewer groups, {cost['steps_dropped']} dropped"
            + (f"; a step's median waits for the other groups: {waits}" if waits else ""))


def _group_record(run_dir: str, group: int) -> list[dict]:
    """Group ``group``'s step record (``litscale.reliability.replica_groups.steps_log_path``)."""
    return _read_steps(steps_log_path(group_dir(run_dir, group)))


def _read_steps(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _starts(record: list[dict]) -> list[int]:
    """The rows where the group started and trained (a start after the run had finished, which
    stops at once, is not one)."""
    return [i for i, row in enumerate(record) if row.get("started") and not row.get("stopped_as_finished")]


def _lives(record: list[dict]) -> int:
    """How many times the group started and trained."""
    return max(1, len(_starts(record)))


def _seconds_to_rejoin(record: list[dict]) -> float | None:
    """From the group's last row before its last start (about when it was lost) to that start."""
    starts = _starts(record)
    return record[starts[-1]]["time"] - record[starts[-1] - 1]["time"] if len(starts) > 1 else None


def _rejoined_at(record: list[dict]) -> int | None:
    starts = _starts(record)
    return record[starts[-1]]["step"] if len(starts) > 1 else None
