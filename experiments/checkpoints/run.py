"""How long a save blocks the training thread, synchronous against ``checkpoint.async_save``.

For GPT-nano and GPT-2 small (124M parameters) with AdamW's state, after one optimizer step:

- ``file``: one process; the synchronous save is the strategy's ``CheckpointIO`` writing
  ``last.ckpt`` to a staging path and publishing it (``litscale.checkpoint.atomic``); the
  background one is ``litscale.checkpoint.background``'s copy of the state, then the same write
  and publish on the writer thread.
- ``dcp``: FSDP2 on 2 gloo ranks; the synchronous save is Lightning's DCP save of the model's
  and optimizer's sharded state (what ``ModelParallelStrategy`` runs) and the publish; the
  background one is ``start_directory_save`` (DCP's ``async_save``: staged, then written).

Blocked time: from the call to its return on the training thread (rank 0's, after a barrier).
It also times the training steps that run while the background write goes on, against steps
with no write in flight: on a machine with few cores the write competes with the step.

    python experiments/checkpoints/run.py           # writes results.json
    python experiments/checkpoints/run.py --models nano --saves 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
SEQ_LEN, BATCH = 128, 2


def build(preset: str):
    from litscale.models.gpt import build_gpt

    torch.manual_seed(0)
    net = build_gpt(preset=preset, block_size=SEQ_LEN)
    return net


def step(net, optimizer) -> float:
    started = time.perf_counter()
    tokens = torch.randint(0, net.config.vocab_size, (BATCH, SEQ_LEN + 1))
    logits = net(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def steps_while(pending, net, optimizer, limit: int = 50, *, distributed: bool = False) -> list[float]:
    """Training steps run until ``pending()`` says the write is done (at most ``limit``). With
    ``distributed`` the ranks step while every rank's write is pending: an FSDP step is
    collective, and a rank stepping once more than the other waited for it forever (a third of
    the 2-rank runs hung before)."""
    times = []
    while len(times) < limit:
        going = torch.tensor(int(pending()))
        if distributed:
            dist.all_reduce(going, op=dist.ReduceOp.MIN)
        if not going:
            break
        times.append(step(net, optimizer))
    return times


def measure(kind: str, preset: str, saves: int, rank: int = 0) -> dict:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from litscale.checkpoint.atomic import publish, remove, staging_path
    from litscale.checkpoint.background import CheckpointWriter, start_directory_save

    net = build(preset)
    if kind == "dcp":
        from torch.distributed.fsdp import fully_shard

        for block in net.sharding_units():
            fully_shard(block)
        fully_shard(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    step(net, optimizer)  # the optimizer's state exists
    baseline = [step(net, optimizer) for _ in range(3)]
    directory = tempfile.mkdtemp(prefix="litscale-save-") if rank == 0 else None
    if kind == "dcp":
        shared = [directory]
        dist.broadcast_object_list(shared, src=0)
        directory = shared[0]
    path = os.path.join(directory, "last.ckpt")
    writer, io = CheckpointWriter(), TorchCheckpointIO()

    def state() -> dict:
        if kind == "file":
            return {"state_dict": net.state_dict(), "optimizer_states": [optimizer.state_dict()], "step": 1}
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        return {"state_dict": get_model_state_dict(net), "optimizer_states": [get_optimizer_state_dict(net, optimizer)],
                "step": 1}

    def barrier() -> None:
        if kind == "dcp":
            dist.barrier()

    results = {"sync_s": [], "async_blocked_s": [], "async_written_s": [], "steps_during_write_s": []}
    for _ in range(saves):
        # synchronous: the whole write on the training thread
        barrier()
        started = time.perf_counter()
        staging = staging_path(path)
        if kind == "file":
            io.save_checkpoint(state(), staging)
        else:
            from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save

            checkpoint = state()
            tensors = {"state_dict": checkpoint.pop("state_dict"), "optimizer_0": checkpoint.pop("optimizer_states")[0]}
            _distributed_checkpoint_save(tensors, Path(staging))
            barrier()
        if rank == 0:
            publish(staging, path)
        results["sync_s"].append(time.perf_counter() - started)
        # in the background: the training thread pays for the copy
        barrier()
        started = time.perf_counter()
        staging = staging_path(path)
        if rank == 0:
            remove(staging)
        if kind == "file":
            copied = writer.snapshot(state())
            done = writer.submit(lambda copied=copied, staging=staging: (io.save_checkpoint(copied, staging),
                                                                         publish(staging, path)))
        else:
            complete = start_directory_save(state(), staging, writer=writer, is_global_zero=rank == 0)
            done = writer.submit(lambda complete=complete, staging=staging: (complete(),
                                                                             rank == 0 and publish(staging, path)))
        blocked = time.perf_counter() - started
        results["async_blocked_s"].append(blocked)
        results["steps_during_write_s"] += steps_while(lambda done=done: not done.done(), net, optimizer,
                                                       distributed=kind == "dcp")
        writer.wait()
        results["async_written_s"].append(time.perf_counter() - started)
    writer.close()
    results["steps_without_write_s"] = baseline + [step(net, optimizer) for _ in range(3)]
    results["state_bytes"] = sum(t.numel() * t.element_size() for t in net.parameters()) * 3
    return results


def _rank(rank: int, port: int, preset: str, saves: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = measure("dcp", preset, saves, rank)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_dcp(preset: str, saves: int) -> dict:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(_rank, args=(port, preset, saves, out), nprocs=2, join=True)
    return json.loads(Path(out).read_text())


def summarize(raw: dict) -> dict:
    median = statistics.median
    # The first background save also makes the copies' memory, which every later one reuses: its
    # blocked time is reported apart, the median over the later ones.
    first, later = raw["async_blocked_s"][0], raw["async_blocked_s"][1:] or raw["async_blocked_s"]
    sync, blocked = median(raw["sync_s"]), median(later)
    during = raw["steps_during_write_s"]
    return {"sync_save_s": round(sync, 3), "async_blocked_s": round(blocked, 3),
            "blocked_over_sync": round(blocked / sync, 3), "first_async_blocked_s": round(first, 3),
            "async_write_s": round(median(raw["async_written_s"]), 3),
            "step_s_without_write": round(median(raw["steps_without_write_s"]), 3),
            "step_s_during_write": round(median(during), 3) if during else None,
            "steps_during_write": len(during), "state_mib": round(raw["state_bytes"] / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="nano,small")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results.json"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    rows = []
    for preset in args.models.split(","):
        for kind in ("file", "dcp"):
            raw = measure(kind, preset, args.saves) if kind == "file" else run_dcp(preset, args.saves)
            row = {"model": preset, "kind": kind, **summarize(raw)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "cores": os.cpu_count(), "rows": rows},
                                         indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
