"""What a newcomer types on a fresh clone, checked before Hydra runs.

Command lines Hydra itself rejects (a group set to null, a key without ``+``, a key of an
option not selected, a malformed override, an empty sweep) are one ``error:`` line naming the
override and what to type instead, exit code 2, nothing written. And the first commands of
the README work or say why: a device sweep skips the cells it cannot run, more gloo ranks than
cores on request, model=llama's own keys, the run's lines in ``train.log``, a checkpoint of
another model refused before any rank starts.

The checks run in this process (``check_command_line``); the tests marked ``slow`` start
``train.py`` as a user would.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.configs import CONF_DIR, compose_job
from hydra.utils import instantiate

from litscale.app.preflight import check_command_line

CORES = len(os.sched_getaffinity(0))
TWO_CORES = pytest.mark.skipif(CORES < 2, reason="needs 2 CPU cores")


def check(overrides: list[str], capsys) -> tuple[int, str, str]:
    """``check_command_line(overrides)`` as ``train.py`` runs it: (exit code, stdout, stderr)."""
    code = 0
    try:
        check_command_line(overrides, config_dir=str(CONF_DIR), config_name="train")
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- model=llama's own keys -------------------------------------------------------------------


def test_llama_takes_n_kv_heads_as_the_readme_writes_it(capsys, tmp_path, outputs_root):
    assert check(["model=llama", "model.net.n_kv_heads=2", "trainer.max_steps=2"], capsys) == (0, "", "")
    cfg, _ = compose_job(["model=llama", "model.net.n_kv_heads=1"], tmp_path / "run")
    net = instantiate(cfg.model.net)
    assert net.config.n_kv_heads == 1 and net.config.n_head == 4  # the preset's n_head, its own kv heads
    tokens = torch.randint(0, net.config.vocab_size, (2, 8))
    net(tokens).logsumexp(-1).mean().backward()  # a training step's forward and backward
    assert all(p.grad is not None for p in net.parameters())
