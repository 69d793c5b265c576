"""The composed network timed here as each plan's rank runs it: plain, sharded by FSDP2, or
split by tensor parallel, built for real on torch's fake process group (its collectives
return at once, so what is timed is compute and the framework's own work; communication is
the cost model's).

NOTE: in a child process, because a process holds one default process group: the planner
also runs at the end of a real run (``plan/predicted_*`` in its summary), whose group is
taken, and an FSDP or tensor-parallel plan needs a group of its own world size.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from litscale.planner.model_facts import Profile


def profiles_in_child(net_config: dict, *, keys: dict[str, set[int]], seq_len: int, vocab_size: int
                      ) -> dict[str, Profile]:
    """``keys``: profile key (``litscale.planner.cost.profile_key``) -> micro batches to time."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_profiles, net_config, keys, seq_len, vocab_size).result()


def _profiles(net_config: dict, keys: dict[str, set[int]], seq_len: int, vocab_size: int) -> dict[str, Profile]:
    import torch
    import torch.distributed as dist
    from hydra.utils import instantiate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from litscale.planner.model_facts import profile
    from litscale.strategies.fsdp import shard_units
    from litscale.strategies.tensor_parallel import apply_declared_plan

    found = {}
    for key, micro_batches in sorted(keys.items()):
        torch.manual_seed(0)
        net = instantiate(net_config, _convert_="all")
        world = int(key.removeprefix("fsdp").removeprefix("tp")) if key != "plain" else 1
        if world > 1:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            mesh = init_device_mesh("cpu", (world,))
            if key.startswith("fsdp"):  # as the FSDP strategy wraps it: units, then the network
                shard_units(list(net.sharding_units()), reshard_after_forward=True, mesh=mesh)
                fully_shard(net, mesh=mesh, reshard_after_forward=False)
            else:  # tensor parallel, as the strategy's defaults run it (sequence parallel)
                apply_declared_plan(net, mesh)
        try:
            found[key] = profile(net, seq_len=seq_len, micro_batches=micro_batches, vocab_size=vocab_size)
        finally:
            if world > 1:
                dist.destroy_process_group()
    return found
