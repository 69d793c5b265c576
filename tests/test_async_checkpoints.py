"""Checkpoints written in the background (``checkpoint.async_save=true``,
``litscale.checkpoint.background``): the run trains as it does with synchronous saves, every save
it keeps is complete and holds the state of its own step (training went on while it was
written), and a resume from one continues as the uninterrupted run.

The reference is one process with the whole global batch and synchronous saves (the
moving-runs test's), never the layout under test.
"""

from __future__ import annotations

import os

import pytest
from helpers.moving_runs import RUN, SINGLE, STEPS, assert_same_run, train, train_one_process

from litscale.checkpoint.resume import is_complete_checkpoint

pytestmark = pytest.mark.slow  # every test here runs train.py

# A save every 2 steps, all kept, while training goes on to STEPS.
EVERY = 2
SAVING = (*(o for o in RUN if not o.startswith("trainer.val_check_interval")), f"trainer.val_check_interval={EVERY}",
          "callbacks.model_checkpoint.save_top_k=-1", "checkpoint.async_save=true")
# (name, overrides, ranks): a file (one process, DDP) and a DCP directory (FSDP, TP, pipeline);
# CI (make test-full) saves one of each, make test-soak the rest.
LAYOUTS = [
    ("single", SINGLE[1], 1),
    pytest.param("ddp2", ("strategy=ddp", "trainer.devices=2", "data.batch_size=8"), 2, marks=pytest.mark.soak),
    ("fsdp2", ("strategy=fsdp", "trainer.devices=2", "data.batch_size=8"), 2),
    pytest.param("tp2", ("strategy=tensor_parallel", "trainer.devices=2", "data.batch_size=16"), 2,
                 marks=pytest.mark.soak),
    pytest.param("pp2", ("strategy=pipeline", "trainer.devices=2", "data.batch_size=16"), 2, marks=pytest.mark.soak),
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return train_one_process(tmp_path_factory.mktemp("async_reference"))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return tmp_path_factory.mktemp("async")


@pytest.mark.full
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "overrides", "ranks"), LAYOUTS)
def test_saves_in_the_background_keep_each_steps_state_and_resume_as_the_uninterrupted_run(
        outputs, one_process, name, overrides, ranks):
    saving = train(outputs, f"async_{name}", overrides, ranks, f"trainer.max_steps={STEPS}", base=SAVING)
    assert_same_run(saving, one_process, steps=range(STEPS))  # the saves changed nothing
    directory = os.path.join(saving["output_dir"], "checkpoints")
    kept = sorted(os.listdir(directory))
    assert kept == ["last.ckpt", *(f"step{step:06d}.ckpt" for step in range(EVERY, STEPS + 1, EVERY))], kept
    for entry in kept:
        assert is_complete_checkpoint(os.path.join(directory, entry)), entry
    # A save from the middle of the run, written while the steps after it ran, resumed on one
    # process. (With the validation interval it was saved with: Lightning counts a step saved at
    # its validation once more, and logs every later step one step early, on a resume that
    # would not have validated there.)
    middle = os.path.join(directory, f"step{STEPS // 2:06d}.ckpt")
    resumed = train(outputs, f"resumed_async_{name}", SINGLE[1], 1, f"trainer.max_steps={STEPS}",
                    f"ckpt_path={middle}", base=SAVING)
    assert_same_run(resumed, one_process, steps=range(STEPS // 2, STEPS))
