"""The composed network timed here as each plan's rank runs it: plain, sharded by FSDP2, or
split by tensor parallel, built for real on torch's fake process group (its collectives
return at once, so what is timed is compute and the framework's own work; communication is
the cost model's); under DDP with a compression hook, or inside DeepSpeed's ZeRO engine, on
one real gloo rank (neither runs on the fake group).

NOTE: in a child process, because a process holds one default process group and an FSDP or
tensor-parallel plan needs a group of its own world size, and because what the profiles
import and leave behind (DeepSpeed, fake groups, threads) should not outlive them. Only
``plan=show|auto`` times: what it timed is cached (``litscale.planner.profile_cache``), and
an ordinary run's summary reads that cache.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from litscale.planner.model_facts import Profile

# Steps a compression hook may take to reach its steady state (PowerSGD's dense warm-up is
# `start_iteration`, 10 by default).
MAX_WARMUP_STEPS = 40


def profiles_in_child(net_config: dict, *, keys: dict[str, set[int]], seq_len: int, vocab_size: int,
                      compression: dict | None = None, packed_documents: bool = False) -> dict[str, Profile]:
    """``keys``: profile key (``litscale.planner.cost.profile_key``) -> micro batches to time;
    ``compression``: the ``compression`` config a ``ddp<n>-<name>`` key runs;
    ``packed_documents``: timed on packed rows (``model_facts.packed_positions``)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_profiles, net_config, keys, seq_len, vocab_size, compression, packed_documents).result()


def _profiles(net_config: dict, keys: dict[str, set[int]], seq_len: int, vocab_size: int,
              compression: dict | None, packed_documents: bool) -> dict[str, Profile]:
    import dataclasses
    import warnings

    import torch
    import torch.distributed as dist
    from hydra.utils import instantiate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from litscale.planner.model_facts import profile
    from litscale.strategies.fully_shard import shard_units
    from litscale.strategies.tensor_plan import apply_declared_plan

    # DeepSpeed's engine calls c10d functions torch deprecates (a FutureWarning per call, about
    # forty per plan): the user's own DeepSpeed run shows them, a plan need not.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    found = _deepspeed_profiles(net_config, {k: v for k, v in keys.items() if k.startswith("zero")}, seq_len,
                                vocab_size, packed_documents)
    for key, micro_batches in sorted(keys.items()):
        if key in found:
            continue
        torch.manual_seed(0)
        net = instantiate(net_config, _convert_="all")
        kind, world = _parse(key)
        if kind == "ddp":  # one real gloo rank: torch's hooks read their all-reduce's result,
            # which the fake group's futures do not carry
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        elif world > 1:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            ratio = 1.0
            if kind == "fsdp":  # as the FSDP strategy wraps it: units, then the network
                mesh = init_device_mesh("cpu", (world,))
                shard_units(list(net.sharding_units()), reshard_after_forward=True, mesh=mesh)
                fully_shard(net, mesh=mesh, reshard_after_forward=False)
            elif kind == "tp":  # tensor parallel, as the strategy's defaults run it (sequence parallel)
                apply_declared_plan(net, init_device_mesh("cpu", (world,)))
            elif kind == "ddp":  # DDP with the run's compression hook, past its warm-up
                net = DistributedDataParallel(net)
                hook = instantiate(compression, _convert_="all")
                hook.register(net)
                ratio = _steady_ratio(net, hook.state, seq_len, vocab_size, min(micro_batches))
            timed = profile(net, seq_len=seq_len, micro_batches=micro_batches, vocab_size=vocab_size,
                            packed_documents=packed_documents)
            found[key] = dataclasses.replace(timed, bytes_ratio=ratio)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return found


def _deepspeed_profiles(net_config: dict, keys: dict[str, set[int]], seq_len: int,
                        vocab_size: int, packed_documents: bool = False) -> dict[str, Profile]:
    """Each ``zero<s>`` key's network timed inside DeepSpeed's engine, on one real gloo rank
    (the engine asks its group for real buffers). NOTE: one group for every stage: DeepSpeed
    keeps the group it first saw, and refuses a new one after it is destroyed."""
    import torch
    import torch.distributed as dist
    from hydra.utils import instantiate

    if not keys:
        return {}
    found = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for key, micro_batches in sorted(keys.items()):
            torch.manual_seed(0)
            net = instantiate(net_config, _convert_="all")
            try:
                found[key] = _deepspeed_profile(net, _parse(key)[1], seq_len=seq_len, micro_batches=micro_batches,
                                                vocab_size=vocab_size, packed_documents=packed_documents)
            except RuntimeError as error:
                # NOTE: a network DeepSpeed's engine cannot run (ZeRO-3 on the MoE decoder's
                # stacked experts: a released parameter in backward) must not stop the plan:
                # that stage is costed without its timing, and said so.
                print(f"litscale: plan: {key} not timed here (DeepSpeed: {error}); its plans are costed from the "
                      f"plain network's timing", flush=True)
    finally:
        dist.destroy_process_group()
    return found


def _parse(key: str) -> tuple[str, int]:
    """``plain`` -> (plain, 1); ``fsdp2`` -> (fsdp, 2); ``tp2`` -> (tp, 2); ``ddp2-topk`` -> (ddp, 2);
    ``zero3`` -> (zero, 3): DeepSpeed's stage, timed at one rank."""
    for kind in ("fsdp", "tp", "ddp", "zero"):
        if key.startswith(kind):
            return kind, int(key.removeprefix(kind).split("-")[0])
    return "plain", 1


def _deepspeed_profile(net, stage: int, *, seq_len: int, micro_batches: set[int], vocab_size: int,
                       repeats: int = 3, packed_documents: bool = False):
    """``net`` inside DeepSpeed's ZeRO engine of ``stage`` (the strategy's own config), on this
    one rank: the median forward-backward (``engine.backward``: its hooks, buckets and
    partition copies) by micro batch, and the median ``engine.step``.

    NOTE: not ``model_facts.profile``: DeepSpeed's backward and step are the engine's own calls."""
    import argparse
    import logging
    import os
    import statistics
    import time

    import torch
    from torch.nn import functional as F

    from litscale.planner.model_facts import Profile, packed_positions
    from litscale.strategies.deepspeed_zero import (
        DeepSpeedZeroStrategy,
        skip_shared_memory_all_reduce_build,
    )

    os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is first imported
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")  # the engine asks a launcher's variables
    import deepspeed

    deepspeed.utils.logging.logger.setLevel(logging.WARNING)
    # As a run does: the engine's start JIT-compiled DeepSpeed's shared-memory op here too
    # ("deepspeed_shm_comm_op built successfully" in plan=show), the compile a killed run
    # leaves locked for every later DeepSpeed start.
    skip_shared_memory_all_reduce_build()
    config = {**DeepSpeedZeroStrategy(stage=stage).config, "train_micro_batch_size_per_gpu": max(micro_batches),
              "gradient_accumulation_steps": 1, "gradient_clipping": 0.0}
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-6)
    engine, *_ = deepspeed.initialize(args=argparse.Namespace(device_rank=0), config=config, model=net,
                                      model_parameters=list(net.parameters()), optimizer=optimizer,
                                      dist_init_required=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    generator, timed, steps = torch.Generator().manual_seed(0), {}, []
    try:
        for micro in sorted(micro_batches):
            tokens = torch.randint(vocab_size, (micro, seq_len + 1), generator=generator)
            inputs = (tokens[:, :-1], packed_positions(micro, seq_len, "cpu")) if packed_documents else (tokens[:, :-1],)
            samples = []
            for repeat in range(repeats + 1):  # the first allocates
                start = time.perf_counter()
                logits = engine(*inputs)
                engine.backward(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
                middle = time.perf_counter()
                engine.step()
                if repeat:
                    samples.append(middle - start)
                    steps.append(time.perf_counter() - middle)
            timed[micro] = statistics.median(samples)
    finally:
        torch.set_num_threads(previous)
    return Profile(timed, statistics.median(steps))


def _steady_ratio(ddp, state, seq_len: int, vocab_size: int, micro_batch: int) -> float:
    """Dense over sent bytes of one step, once two steps in a row sent the same."""
    import torch

    from litscale.planner.model_facts import forward_backward

    tokens = torch.randint(vocab_size, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    previous = None
    for _ in range(MAX_WARMUP_STEPS):
        sent, dense = state.bytes_sent, state.dense_bytes
        forward_backward(ddp, tokens)
        ddp.zero_grad(set_to_none=True)
        step = (state.bytes_sent - sent, state.dense_bytes - dense)
        if step == previous:
            break
        previous = step
    return step[1] / step[0]
