"""The hand-written PyTorch reference for the benchmarks: the same model, data, batch, optimizer,
schedule and gradient clipping as ``python train.py`` with the default groups, without
Lightning, Hydra or any callback.

    python experiments/bench/plain_loop.py --strategy ddp --devices 2 --out result.json

What it shares with litscale is deliberately only what a user would write themselves: the GPT
from the model zoo (a plain ``nn.Module``), the synthetic dataset, the parameter groups and the
warmup-cosine multiplier. The step time is taken the way ``ThroughputCallback`` takes it: wall
time from the end of optimizer step ``warmup`` to the end of the last step, divided by the
steps in between (data loading included in both).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from litscale.data.synthetic import SyntheticLM  # noqa: E402
from litscale.models.gpt import build_gpt  # noqa: E402
from litscale.modules import weight_decay_groups  # noqa: E402
from litscale.optim.schedulers import warmup_cosine  # noqa: E402

# conf/model/gpt.yaml, conf/optimizer/adamw.yaml, conf/scheduler/cosine.yaml,
# conf/trainer/default.yaml (gradient_clip_val, log_every_n_steps), conf/train.yaml (seed)
WEIGHT_DECAY, LR, BETAS, EPS = 0.1, 1.0e-3, (0.9, 0.95), 1.0e-8
WARMUP_LR_STEPS, MIN_LR_RATIO, CLIP_NORM, LOG_EVERY, SEED = 20, 0.1, 1.0, 10, 1234


def measured_warmup(steps: int, warmup: int) -> int:
    """The step at which timing starts: ``ThroughputCallback``'s rule for short runs."""
    return min(warmup, max(1, steps // 4))


def cpu_threads(local_world_size: int) -> int:
    """Each rank's share of the cores, as ``litscale.app.build`` gives it (taskset narrows it)."""
    return max(1, len(os.sched_getaffinity(0)) // local_world_size)


def loader(args: argparse.Namespace, world_size: int, rank: int) -> torch.utils.data.DataLoader:
    """The synthetic LM train set with the sampler litscale's data modules use."""
    dataset = SyntheticLM(num_samples=args.num_samples, seq_len=args.seq_len, vocab_size=256,
                          seed=SEED)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                                  shuffle=True, seed=SEED, drop_last=True)
    return torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                       drop_last=True)


def wrap(net: torch.nn.Module, strategy: str) -> torch.nn.Module:
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(net, bucket_cap_mb=25, gradient_as_bucket_view=True)
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in net.sharding_units():
            fully_shard(block, reshard_after_forward=True)
        fully_shard(net, reshard_after_forward=False)
    return net


def train(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """Train ``args.steps`` optimizer steps on this rank; return its timing."""
    torch.set_num_threads(cpu_threads(world_size))
    torch.manual_seed(SEED)
    net = build_gpt(preset=args.preset, vocab_size=256, block_size=args.seq_len, dropout=0.0,
                    n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head)
    model = wrap(net, args.strategy)  # before the optimizer: FSDP replaces the parameters
    optimizer = torch.optim.AdamW(weight_decay_groups(net, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS)
    scheduler = warmup_cosine(optimizer, total_steps=args.steps, warmup_steps=WARMUP_LR_STEPS,
                              min_lr_ratio=MIN_LR_RATIO)
    warmup, start, logged = measured_warmup(args.steps, args.warmup), 0.0, []
    batches = iter(loader(args, world_size, rank))
    for step in range(1, args.steps + 1):
        tokens, targets = next(batches)
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
        scheduler.step()
        if step % LOG_EVERY == 0:
            logged.append(loss.item())  # what a logger reads, at the same interval
        if step == warmup:
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    return {"step_time_s": elapsed / (args.steps - warmup), "last_loss": loss.item(),
            "world_size": world_size, "threads": torch.get_num_threads()}


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = train(rank, world_size, args)
        if rank == 0:
            Path(args.out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["single", "ddp", "fsdp"], default="single")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--preset", default="nano")
    for size in ("--n-layer", "--n-embd", "--n-head"):  # override the preset's numbers
        parser.add_argument(size, type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--num-samples", type=int, default=100_000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.strategy == "single":
        Path(args.out).write_text(json.dumps(train(0, 1, args)))
        return
    torch.multiprocessing.spawn(_rank_main, args=(args.devices, free_port(), args),
                                nprocs=args.devices, join=True)


if __name__ == "__main__":
    main()
