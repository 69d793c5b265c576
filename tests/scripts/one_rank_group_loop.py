"""The one-rank gloo fixture of ``test_compression.py`` in a loop, to check its teardown.

Each repetition: ``init_process_group("gloo", store=HashStore(), rank=0, world_size=1)``, a
test body (DDP with one of litscale's compression hooks, 4 steps; its locals go when it
returns), then the teardown: ``--teardown old`` destroys the group at once (the fixture as it
was), ``--teardown fixed`` through ``helpers.distributed.destroy_process_groups``. An abort kills
the process (exit 134, "Resource deadlock avoided"); a hang prints every thread's stack and
exits 1. Run it beside a process burning a core (tests/README.md has the counts):

    python tests/scripts/one_rank_group_loop.py 500 --teardown fixed &
    python -c "while True: pass"   # stop it when the loop is done
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.distributed import destroy_process_groups  # noqa: E402

from litscale.compression import bf16, fp16, powersgd, qsgd, signsgd, terngrad, topk  # noqa: E402

HOOKS = [fp16, bf16, lambda: topk(ratio=0.05), lambda: qsgd(levels=7, block_size=128),
         lambda: terngrad(block_size=128), lambda: signsgd(block_size=128),
         lambda: powersgd(rank=2, start_iteration=2)]


def body(repetition: int) -> None:
    torch.manual_seed(repetition)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                                        torch.nn.Linear(128, 32)), bucket_cap_mb=0.01)
    HOOKS[repetition % len(HOOKS)]().register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repetitions", type=int)
    parser.add_argument("--teardown", choices=("old", "fixed"), default="fixed")
    args = parser.parse_args()
    faulthandler.enable()  # as pytest: an abort prints the Python stacks
    threads, started = [], time.monotonic()
    for repetition in range(args.repetitions):
        faulthandler.dump_traceback_later(60, exit=True)
        assert not dist.is_initialized(), f"repetition {repetition}: a group was left initialised"
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            body(repetition)
        finally:
            destroy_process_groups() if args.teardown == "fixed" else dist.destroy_process_group()
        threads.append(len(os.listdir("/proc/self/task")))
    faulthandler.cancel_dump_traceback_later()
    print(f"{args.repetitions} repetitions ({args.teardown} teardown) in {time.monotonic() - started:.0f} s: "
          f"no abort, no hang; OS threads after each: max {max(threads)}, last {threads[-1]}")


if __name__ == "__main__":
    main()
