"""Save a checkpoint twice through a litscale strategy, to be killed during the second save.

    python tests/scripts/save_twice.py DIR file|directory

Writes ``DIR/checkpoints/last.ckpt`` as version 1 (every tensor filled with 1.0), prints ``saving`` and
writes version 2 over it (filled with 2.0), prints ``saved <seconds>`` and waits to be
killed. ``file``: ``strategy=single``'s ``torch.save`` file; ``directory``: ``strategy=fsdp``'s
``torch.distributed.checkpoint`` directory, on a one-rank gloo group. ``test_atomic_checkpoints.py``
sends SIGKILL at chosen moments after ``saving`` and resumes from what is left.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist

TENSORS, SHAPE = 48, (512, 512)  # 48 MiB of fp32: a save long enough to be cut part way


def checkpoint(version: int) -> dict:
    weights = {f"net.w{i}": torch.full(SHAPE, float(version)) for i in range(TENSORS)}
    return {"state_dict": weights, "optimizer_states": [], "version": version}


def strategy(kind: str):
    if kind == "file":
        from litscale.strategies.single import SingleStrategy

        return SingleStrategy()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from litscale.strategies.fsdp import FSDPStrategy

    return FSDPStrategy()


def main() -> None:
    directory, kind = sys.argv[1], sys.argv[2]
    saver, path = strategy(kind), os.path.join(directory, "checkpoints", "last.ckpt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    saver.save_checkpoint(checkpoint(1), path)
    print("saving", flush=True)
    start = time.perf_counter()
    saver.save_checkpoint(checkpoint(2), path)
    print(f"saved {time.perf_counter() - start:.4f}", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
