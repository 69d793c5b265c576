"""Combinations of litscale's options, drawn from their cross product by a seeded generator.

A combination is one choice per dimension (strategy with its mesh sizes, precision,
determinism, model family, compression, optimizer (LARS, LAMB and Muon among them), devices,
accumulation, Hydra launcher and sweeper, checkpoints: none, or saved every step on the
training thread or in the background, the LR rule across widths: none, or µP, and gradient
clipping: the default norm clipping, or none, and fault tolerance: none, or replica groups),
turned into the overrides a user would type. ``tests/test_combinations.py`` checks that each
is either refused in one line before any rank starts, or accepted and trains right.
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass

# strategy variant -> its overrides (mesh sizes included); sizes that need 4 ranks say so.
STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    "fsdp_ep2": ["strategy=fsdp", "strategy.expert_parallel_size=2"],
    "fsdp_cp2": ["strategy=fsdp", "strategy.context_parallel_size=2"],
    "zero1": ["strategy=deepspeed_zero", "strategy.stage=1"],
    "zero2": ["strategy=deepspeed_zero", "strategy.stage=2"],
    "zero3": ["strategy=deepspeed_zero", "strategy.stage=3"],
    "tensor_parallel": ["strategy=tensor_parallel"],
    "tp2_cp2": ["strategy=tensor_parallel", "strategy.tensor_parallel_size=2", "strategy.context_parallel_size=2"],
    "tp_ep2": ["strategy=tensor_parallel", "strategy.tensor_parallel_size=1", "strategy.expert_parallel_size=2"],
    "pipeline": ["strategy=pipeline"],
    "pp2_dp2": ["strategy=pipeline", "strategy.pipeline_parallel_size=2", "strategy.data_parallel_size=2"],
    "local_sgd": ["strategy=local_sgd"],
    "federated": ["strategy=federated"],
}
PRECISIONS = ("fp32", "bf16_mixed", "fp16_mixed", "bf16_true")
DETERMINISM = ("none", "layout_invariant")
# model family -> its overrides: the data of its task, small enough to train in a second.
MODELS = {
    "gpt": ["model=gpt", "data=synthetic", "data.seq_len=32"],
    "llama": ["model=llama", "data=synthetic", "data.seq_len=32"],
    "moe": ["model=moe", "data=synthetic", "data.seq_len=32"],
    "hf": ["model=hf", "data=synthetic", "data.seq_len=32"],
    "mlp": ["model=mlp", "data=digits"],
    "resnet": ["model=resnet", "data=digits"],  # BatchNorm: running statistics in buffers
}
COMPRESSIONS = ("none", "fp16", "powersgd", "topk")
OPTIMIZERS = ("adamw", "sgd", "lars", "lamb", "muon")
DEVICES = (1, 2, 4)
ACCUMULATIONS = (1, 2)
LAUNCHERS = ("basic", "ray", "slurm_local")
SWEEPERS = ("basic", "optuna")
# none: no checkpoint (callbacks=none); sync / async: last.ckpt and the step's saved every step.
CHECKPOINTS = ("none", "sync", "async")
# none: the default rule; mup: µP at a quarter or half of the model's width (every multiplier of litscale.optim.mup is not 1).
LR_SCALINGS = ("none", "mup")
# norm: the default clipping (trainer.gradient_clip_val=1.0); none: no clipping (what Muon
# under ZeRO, stepped by DeepSpeed's ZeRO Muon, needs).
CLIPPINGS = ("norm", "none")
# fault_tolerance=replicas: replica groups of the layout (trained by tests/test_fault_tolerance.py:
# the rank pool runs one group of ranks, not a lighthouse and its groups).
FAULT_TOLERANCE = ("none", "replicas")
# What every combination shares: a CPU run of 4 steps (the loss after 3 updates) with a micro
# batch that 4 microbatches split, each step's loss and gradient norm logged (metrics.csv).
STEPS = 4
BASE = ["trainer.accelerator=cpu", f"trainer.max_steps={STEPS}", "launcher.oversubscribe=true",
        "data.batch_size=8", "logger=csv", "trainer.log_every_n_steps=1", "callbacks=none"]
SEED_ENV = "LITSCALE_COMBINATION_SEED"


@dataclass(frozen=True)
class Combination:
    strategy: str
    precision: str
    determinism: str
    model: str
    compression: str
    optimizer: str
    devices: int
    accumulation: int
    launcher: str
    sweeper: str
    checkpoint: str = "none"
    lr_scaling: str = "none"
    clipping: str = "norm"
    fault_tolerance: str = "none"

    def job_overrides(self) -> list[str]:
        """What the job sees: everything but the Hydra launcher and sweeper."""
        saves = [] if self.checkpoint == "none" else [
            "callbacks=checkpoints", f"checkpoint.async_save={str(self.checkpoint == 'async').lower()}"]
        widths = ["lr_scaling=mup", "lr_scaling.base_width=32"] if self.lr_scaling == "mup" else []
        clipping = ["trainer.gradient_clip_val=null"] if self.clipping == "none" else []
        return [*BASE, *STRATEGIES[self.strategy], f"precision={self.precision}",
                f"determinism={self.determinism}", *MODELS[self.model], f"compression={self.compression}",
                f"optimizer={self.optimizer}",
                f"trainer.devices={self.devices}", f"trainer.accumulate_grad_batches={self.accumulation}", *saves,
                *widths, *clipping, f"fault_tolerance={self.fault_tolerance}"]

    def overrides(self) -> list[str]:
        """The command line: the job's overrides and the engines that launch and sweep it."""
        engines = [f"hydra/launcher={self.launcher}"] if self.launcher != "basic" else []
        if self.sweeper != "basic":
            engines.append(f"hydra/sweeper={self.sweeper}")
        return [*self.job_overrides(), *engines]

    @property
    def multirun(self) -> bool:
        """Another launcher or sweeper is chosen only with ``-m``."""
        return self.launcher != "basic" or self.sweeper != "basic"

    def __str__(self) -> str:
        return " ".join(self.overrides())


DIMENSIONS = (tuple(STRATEGIES), PRECISIONS, DETERMINISM, tuple(MODELS), COMPRESSIONS, OPTIMIZERS, DEVICES,
              ACCUMULATIONS, LAUNCHERS, SWEEPERS, CHECKPOINTS, LR_SCALINGS, CLIPPINGS, FAULT_TOLERANCE)


# How often each value is drawn, by dimension (None: evenly). Most options refuse only a few
# partners, so the usual value of the dimensions that refuse most (compression, fp16, the
# determinism mode) is drawn more often: a sample with as many accepted combinations to train
# as refused ones to read.
WEIGHTS = (None, (5, 2, 1, 2), (3, 1), None, (6, 1, 1, 1), (4, 2, 1, 1, 1), None, None, (3, 1, 1), (3, 1), None,
           (3, 1), (3, 1), (5, 1))


def cross_product_size() -> int:
    size = 1
    for values in DIMENSIONS:
        size *= len(values)
    return size


def combination_seed(default: int) -> int:
    """The sample's seed: ``LITSCALE_COMBINATION_SEED`` when set (to reproduce a failure), else
    ``default``; tests print it."""
    return int(os.environ.get(SEED_ENV, default))


def sample(count: int, seed: int) -> list[Combination]:
    """``count`` distinct combinations, each dimension drawn by ``WEIGHTS``, reproducible from
    ``seed``."""
    rng, found = random.Random(seed), {}
    while len(found) < count:
        chosen = Combination(*(rng.choices(values, weights)[0] for values, weights in zip(DIMENSIONS, WEIGHTS, strict=True)))
        found.setdefault(chosen, None)
    return list(found)


def every_pair_of_strategy_and(dimension: int) -> list[Combination]:
    """Each strategy with each value of one other dimension, the rest at its first value: the
    cells the compatibility table states, checked against validation."""
    first = [values[0] for values in DIMENSIONS]
    found = []
    for strategy, value in itertools.product(DIMENSIONS[0], DIMENSIONS[dimension]):
        chosen = list(first)
        chosen[0], chosen[dimension] = strategy, value
        found.append(Combination(*chosen))
    return found
