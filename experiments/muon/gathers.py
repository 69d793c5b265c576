"""The bytes one Muon step gathers under FSDP, measured, against the planner's prediction.

    python experiments/muon/gathers.py            # 2 and 4 gloo ranks, GPT-nano, a few seconds each

Each rank shards GPT-nano with litscale's FSDP2 units (``strategies.fully_shard.apply_fsdp``),
runs one forward-backward, then one ``litscale.optim.muon.Muon`` step under a dispatch mode that sees
every collective the step issues: the functional all-gathers a DTensor's ``full_tensor`` runs
(torch.distributed.tensor's redistribution) are summed, as bytes each rank receives (the
gathered tensor less its own part). The prediction is the planner's ``Muon update all-gather``
collective for the same plan (``planner.cost``): every hidden matrix's fp32 update, less the
rank's shard. Written by hand: torch's ``CommDebugMode`` counts collectives, not their bytes.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
GATHERS = ("all_gather_into_tensor", "all_gather_into_tensor_coalesced")


class GatheredBytes(TorchDispatchMode):
    """Sums the bytes this rank receives in the functional all-gathers issued inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.calls, self.other = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in GATHERS:
            inputs, group_size = args[0], args[1]
            for tensor in inputs if isinstance(inputs, list | tuple) else [inputs]:
                self.bytes += tensor.numel() * tensor.element_size() * (group_size - 1)
                self.calls += 1
        elif func.namespace in ("_c10d_functional", "c10d") and any(
                kind in name for kind in ("reduce", "gather", "scatter", "broadcast", "all_to_all")):
            self.other.add(name)  # any other collective the step issues (none expected)
        return func(*args, **kwargs)


def rank_main(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from litscale.models.gpt import build_gpt
        from litscale.optim.muon import Muon, parameter_roles
        from litscale.strategies.fully_shard import apply_fsdp, find_sharding_units

        torch.manual_seed(0)
        net = build_gpt(preset="nano", block_size=64)
        holder = torch.nn.Module()  # as the strategy shards it: the LightningModule holds the network as net
        holder.net = net
        apply_fsdp(holder, init_device_mesh("cpu", (world,)), units=find_sharding_units(holder))
        optimizer = Muon(parameter_roles(net, 0.0), lr=1e-3)
        tokens = torch.randint(0, 256, (16 // world, 65), generator=torch.Generator().manual_seed(rank))
        logits = net(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        counter = GatheredBytes()
        with counter:
            optimizer.step()
        results[rank] = {"bytes": counter.bytes, "calls": counter.calls, "other": sorted(counter.other)}
    finally:
        dist.destroy_process_group()


def predicted(world: int) -> tuple[float, int]:
    """The planner's Muon update all-gather for GPT-nano under FSDP on ``world`` ranks."""
    from hydra import compose, initialize_config_dir

    from litscale.app.checks.validation import validate
    from litscale.app.plan.description import describe
    from litscale.app.plan.runs import facts_of
    from litscale.parallel.layout import MeshSizes
    from litscale.planner.cluster import Cluster, Link
    from litscale.planner.cost import collectives
    from litscale.planner.plan import Plan

    with initialize_config_dir(config_dir=str(HERE.parents[1] / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["optimizer=muon", "data.seq_len=64", f"trainer.devices={world}"])
    cfg.paths.output_dir = str(HERE / "outputs")  # outside a Hydra run: its run dir, named (nothing is written)
    facts = facts_of(describe(cfg, {}, validate(cfg, choices={}, this_machine=False)))
    link = Link(bandwidth_bytes_s=1e10, latency_s=0.0)  # bytes are what is compared: any link
    cluster = Cluster(name="bytes only", nodes=1, devices_per_node=world, device_memory_bytes=2**34,
                      peak_flops={"float32": 1e12}, intra_node=link, inter_node=link)
    plan = Plan("fsdp", MeshSizes(data_shard=world), micro_batch=16 // world, accumulation=1)
    [gather] = [c for c in collectives(plan, facts, cluster) if c.name == "Muon update all-gather"]
    return gather.bytes_per_rank, gather.calls


def main() -> None:
    rows = []
    for world in (2, 4):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        results = mp.Manager().dict()
        mp.spawn(rank_main, args=(world, port, results), nprocs=world)
        bytes_predicted, calls_predicted = predicted(world)
        measured = [results[rank] for rank in range(world)]
        row = {"ranks": world, "measured_bytes_per_rank": [m["bytes"] for m in measured],
               "measured_calls": [m["calls"] for m in measured], "predicted_bytes_per_rank": bytes_predicted,
               "predicted_calls": calls_predicted, "other_collectives": measured[0]["other"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (HERE / "gathers.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {HERE / 'gathers.json'}")


if __name__ == "__main__":
    main()
