"""What the tests of runs that move share: a short GPT-nano run on the rank pool, the
one-process layout of its global batch (16 samples), and the check that two runs logged the same
losses and ended with the same weights."""

from __future__ import annotations

import torch

from helpers.cli import explain, summaries, train_losses
from helpers.inprocess import train_on_pool

# fp32 parity with one process (PyTorch's defaults for float32 comparisons).
TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}
STEPS = 8
RUN = ("model.net.preset=nano", "data.seq_len=32", "data.max_bytes=400000", "trainer.accelerator=cpu",
       "trainer.log_every_n_steps=1", f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1",
       "logger=csv", "trainer.enable_progress_bar=false")

# One process with the whole global batch: (name, overrides, ranks), as the layouts are written.
SINGLE = ("single", ("strategy=single", "data.batch_size=16"), 1)


def train(outputs, name: str, overrides: tuple[str, ...], ranks: int, *more: str, base: tuple[str, ...] = RUN) -> dict:
    process = train_on_pool(*base, *overrides, f"name={name}", *more, outputs=outputs, devices=ranks,
                            timeout=300)
    assert process.returncode == 0, explain(process)
    return summaries(outputs / name)[-1]


def train_one_process(outputs) -> dict:
    """The reference: one process, batch 16, ``STEPS`` steps, synchronous saves."""
    name, overrides, ranks = SINGLE
    return train(outputs, name, overrides, ranks, f"trainer.max_steps={STEPS}")


def weights(summary: dict) -> dict[str, torch.Tensor]:
    """The network as the run exported it (one file, whatever the layout sharded)."""
    return torch.load(summary["export"], map_location="cpu", weights_only=True)


def assert_same_run(actual: dict, expected: dict, *, steps: range, exact: bool = False) -> None:
    """The logged loss of every step in ``steps`` and the final weights of two runs agree."""
    ours, theirs = train_losses(actual["output_dir"]), train_losses(expected["output_dir"])
    assert sorted(ours) == list(steps), f"logged steps {sorted(ours)}"
    tolerance = {"rtol": 0, "atol": 0} if exact else TOLERANCE
    torch.testing.assert_close(torch.tensor([ours[s] for s in steps], dtype=torch.float64),
                               torch.tensor([theirs[s] for s in steps], dtype=torch.float64), **tolerance)
    expected_weights, actual_weights = weights(expected), weights(actual)
    assert actual_weights.keys() == expected_weights.keys() and len(actual_weights) > 10
    for name, tensor in expected_weights.items():
        if exact:
            assert torch.equal(actual_weights[name], tensor), name
        else:
            torch.testing.assert_close(actual_weights[name], tensor, **tolerance, msg=name)
