"""``python -m litscale.planner.calibrate``: this machine's figures for ``cluster=local_cpu``.

Times square matmuls on one rank's share of the cores (each CPU rank runs one thread), gloo's
collectives between two local processes at sizes from 4 KiB to 16 MiB, each between stretches
of compute as a step issues them (latency and bandwidth fitted to each kind), and a small
training step alone and under DDP on two processes at once (contention, beyond the all-reduce
those figures predict); writes them to ``$LITSCALE_CACHE/cluster_local_cpu.json`` (default ``~/.cache/litscale``). A plan for
``cluster=local_cpu`` reads that file, and calibrates first if it is missing.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from litscale.constraints import Fraction, NonNegativeFloat
from litscale.measure import flops
from litscale.measure.flops import probe_matmul_flops
from litscale.planner import machine
from litscale.planner.cluster import Cluster, Link

SIZES = [2**k for k in range(12, 25, 2)]  # bytes: 4 KiB .. 16 MiB
ROUNDS = 3  # each a mean over many calls; the median of the rounds is kept


def calibration_path() -> Path:
    root = os.environ.get("LITSCALE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "litscale")
    return Path(root) / "cluster_local_cpu.json"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Each collective as the planner costs it at 2 ranks: (latency messages per call, bytes each
# rank sends per byte of the buffer timed): a ring all-reduce sends the buffer in 2 messages;
# an all-gather (of its output), a reduce-scatter (of its input) and an all-to-all half of it
# in one; a send the whole buffer.
KINDS = {"all-reduce": (2, 1.0), "all-gather": (1, 0.5), "reduce-scatter": (1, 0.5), "all-to-all": (1, 0.5),
         "send": (1, 1.0)}


def _collective_calls(dist, rank: int, size: int) -> dict:
    whole, half, received = torch.ones(size // 4), torch.ones(size // 8), torch.ones(size // 4)
    return {"all-reduce": lambda: dist.all_reduce(whole),
            "all-gather": lambda: dist.all_gather_single(whole, half),
            "reduce-scatter": lambda: dist.reduce_scatter_single(half, whole),
            "all-to-all": lambda: dist.all_to_all_single(received, whole),
            "send": (lambda: dist.send(whole, 1)) if rank == 0 else (lambda: dist.recv(received, 0))}


def _time_collectives(rank: int, port: int, out: str) -> None:
    """Each kind's mean time per call, at each size, issued as a training step issues them:
    between stretches of compute on both ranks. Timed after a barrier, back to back, gloo's
    small calls take a third of what they take there: its threads are asleep or busy on the
    cores the ranks compute on, and a step pays for waking them at every call."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    work = torch.randn(256, 256)

    def compute() -> None:  # about 2 ms on one core: a layer's matmuls between two collectives
        for _ in range(4):
            work @ work

    try:
        times: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
        for size in SIZES:
            calls_per_round = 20 if size <= 2**20 else 6
            for kind, call in _collective_calls(dist, rank, size).items():
                call()  # the first call sets up the buffers
                rounds = []
                for _ in range(ROUNDS):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(calls_per_round):
                        compute()
                    alone = time.perf_counter() - start
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(calls_per_round):
                        compute()
                        call()
                    rounds.append((time.perf_counter() - start - alone) / calls_per_round)
                times[kind][size] = max(statistics.median(rounds), 1e-6)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def fit_link(times: dict[int, float], messages: int, sent_per_byte: float) -> Link:
    """Latency and bandwidth of ``seconds = messages x latency + sent_per_byte x bytes /
    bandwidth`` fitted to median times by size. Least squares on relative errors (weights
    1 / t^2): plain least squares lets the 16 MiB times set the intercept, and the latency came
    out 10x what a 4 KiB call takes."""
    xs, ys = [sent_per_byte * n for n in times], list(times.values())
    weights = [1 / y**2 for y in ys]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys, strict=True)) / sum(
        w * (x - mean_x) ** 2 for w, x in zip(weights, xs, strict=True))
    slope = max(slope, 1e-12)  # a noisy sweep must not give a negative or infinite bandwidth
    return Link(bandwidth_bytes_s=1 / slope, latency_s=max(mean_y - slope * mean_x, 1e-7) / messages)


def measure_link() -> tuple[Link, dict[str, dict[int, float]]]:
    """This machine's gloo link between two local processes: the all-reduce's latency and
    bandwidth, each kind of collective's own (``Link.collectives``), and the mean time per call
    by kind and size they were fitted to."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_time_collectives, args=(_free_port(), out), nprocs=2)
        times = {kind: {int(k): v for k, v in by_size.items()} for kind, by_size in json.loads(Path(out).read_text()).items()}
    kinds = {kind: fit_link(times[kind], *KINDS[kind]) for kind in KINDS}
    whole = kinds["all-reduce"]
    return Link(bandwidth_bytes_s=whole.bandwidth_bytes_s, latency_s=whole.latency_s, collectives=kinds), times


PROBE_SEQ, PROBE_MICRO = 128, 8  # the probe step: GPT-nano, micro batch 8 of 128 tokens


def _nano() -> torch.nn.Module:
    from litscale.models.gpt import build_gpt

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build_gpt(preset="nano", vocab_size=256, block_size=PROBE_SEQ)


def _step_seconds(net: torch.nn.Module | None = None, repeats: int = 30) -> float:
    """Median time of GPT-nano's forward-backward (micro batch 8, 128 tokens) on one thread
    (``net``: the same network wrapped, e.g. by DDP)."""
    from litscale.planner.model_facts import profile

    timed = profile(net or _nano(), seq_len=PROBE_SEQ, micro_batches={PROBE_MICRO}, vocab_size=256, repeats=repeats)
    return timed.forward_backward_s[PROBE_MICRO]


def _time_ddp_step(rank: int, ranks: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    store = dist.TCPStore("127.0.0.1", port, ranks, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)
    try:
        seconds = _step_seconds(DistributedDataParallel(_nano()))
        if rank == 0:
            Path(out).write_text(json.dumps(seconds))
    finally:
        dist.destroy_process_group()


def measure_contention(ranks: int, link: Link) -> float:
    """How much slower a data-parallel step runs on ``ranks`` processes at once (GPT-nano under
    DDP over gloo, one thread each) than alone plus the all-reduce that ``link`` predicts for
    it: the ranks share caches and memory bandwidth, and gloo reduces on the cores that
    compute, none of which a step timed alone sees."""
    import tempfile

    import torch.multiprocessing as mp

    from litscale.parallel.layout import MeshSizes
    from litscale.planner.cost import Plan, collectives
    from litscale.planner.model_facts import model_facts

    alone = _step_seconds()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds.json")
        mp.spawn(_time_ddp_step, args=(ranks, _free_port(), out), nprocs=ranks)
        together = json.loads(Path(out).read_text())
    with torch.device("meta"):
        facts = model_facts(_nano(), seq_len=PROBE_SEQ, vocab_size=256)
    probe = Cluster(name="probe", nodes=1, devices_per_node=ranks, device_memory_bytes=1.0,
                    peak_flops={"float32": 1.0}, intra_node=link, inter_node=link)
    plan = Plan("ddp", MeshSizes(data_replicate=ranks), micro_batch=PROBE_MICRO, accumulation=1)
    all_reduce = sum(c.seconds for c in collectives(plan, facts, probe))
    return max(1.0, together / (alone + all_reduce))


def calibrate() -> dict:
    """Measure this machine's figures and return them; write them unless the machine was busy
    when they began or other processes took its cores while they ran (``flops.disturbed``: the
    figures then serve this command only, and say why in ``refused``)."""
    load, clock = flops.load_average(), flops.cpu_clock()  # before our own processes add to them
    cores = flops.cores()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's share
    try:
        peak = {"float32": probe_matmul_flops(torch.float32, seconds=1.0),
                "bfloat16": probe_matmul_flops(torch.bfloat16, seconds=1.0)}
    finally:
        torch.set_num_threads(previous)
    link, times = measure_link()
    figures = {"cores": cores, "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
               "peak_flops": peak, "bandwidth_bytes_s": link.bandwidth_bytes_s, "latency_s": link.latency_s,
               "contention": measure_contention(min(cores, 2), link),
               "collectives": {kind: {"latency_s": fitted.latency_s, "bandwidth_bytes_s": fitted.bandwidth_bytes_s,
                                      "seconds_by_bytes": times[kind]}  # what each was fitted to
                               for kind, fitted in link.collectives.items()},
               "measured": time.strftime("%Y-%m-%d %H:%M"), "load_average": round(load, 2),
               "machine": machine.fingerprint(), "torch": torch.__version__}
    others = flops.others_load(clock)  # None where the kernel does not say
    figures["others_load"] = None if others is None else round(others, 2)
    refused = flops.disturbed(load, others)
    if refused:
        return {**figures, "refused": f"not written to {calibration_path()}: timed at a {refused}"}
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(figures, indent=1))
    os.replace(partial, path)
    return figures


def stale(figures: dict) -> str | None:
    """Why a calibration file does not describe this machine now (None: it does). A file written
    by hand (neither ``machine`` nor the all-reduce times this module records) is taken as written."""
    if "machine" not in figures:
        return "it was measured by an older litscale, which did not record the machine" if (
            "collectives" in figures or "all_reduce_s_by_bytes" in figures) else None
    if "collectives" not in figures:
        return "it was measured by an older litscale, which timed the all-reduce only"
    if figures["machine"] != machine.fingerprint():
        return "it was measured on another machine"
    if figures.get("torch") != torch.__version__:
        return f"it was measured with torch {figures.get('torch')}, this is {torch.__version__}"
    if "others_load" not in figures:
        return ("it was measured by an older litscale, which kept it whatever other processes took of the "
                "cores while it ran")
    return None


def calibrated_figures() -> dict | None:
    """This machine's calibration file, or None where there is none or it is ``stale``."""
    path = calibration_path()
    if not path.exists():
        return None
    figures = json.loads(path.read_text())
    return None if stale(figures) else figures


def local_cpu(*, achieved_fraction: Fraction = 0.5, allocator_overhead: NonNegativeFloat = 0.0,
              overlap: Fraction = 0.0, overhead_per_microbatch_s: NonNegativeFloat = 0.0) -> Cluster:
    """This machine as a cluster: one rank per core, its measured matmul peak and gloo link
    (calibrated once, then read from the file). ``overlap`` 0: on CPU, gradient communication
    competes with backward for the same cores."""
    path = calibration_path()
    figures = calibrated_figures()
    if figures is None:
        figures = calibrate()
        if "refused" in figures:
            print(f"litscale: this machine's calibration {figures['refused']}; used for this command only",
                  file=sys.stderr)
    kinds = {kind: Link(bandwidth_bytes_s=fitted["bandwidth_bytes_s"], latency_s=fitted["latency_s"])
             for kind, fitted in figures.get("collectives", {}).items()}
    link = Link(bandwidth_bytes_s=figures["bandwidth_bytes_s"], latency_s=figures["latency_s"], collectives=kinds)
    return Cluster(name="local_cpu", nodes=1, devices_per_node=figures["cores"],
                   contention=figures.get("contention", 1.0),
                   device_memory_bytes=figures["memory_bytes"] / figures["cores"], peak_flops=figures["peak_flops"],
                   intra_node=link, inter_node=link, achieved_fraction=achieved_fraction,
                   allocator_overhead=allocator_overhead, overlap=overlap,
                   overhead_per_microbatch_s=overhead_per_microbatch_s, is_this_machine=True,
                   source=f"measured on this machine ({'not written' if 'refused' in figures else path}, "
                          f"{figures['measured']})")


if __name__ == "__main__":
    result = calibrate()
    print(json.dumps(result, indent=1))
    if "refused" in result:
        sys.exit(f"litscale: calibration {result['refused']}; run it again on a quiet machine")
    print(f"written to {calibration_path()}")
