"""Pipeline parallel: every schedule on 2 gloo CPU ranks against a single process of the same
global batch (weights after 5 steps, logged losses, validation, clipping), per-stage
checkpoints, stage cutting, and the one-line errors for bad meshes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.cli import explain, summaries
from helpers.distributed import run_distributed
from helpers.inprocess import train_on_pool
from helpers.parity import (
    TINY_WITH_BIASES,
    ParitySetup,
    global_batches,
    rank_loader,
    reference,
    tiny_module,
)

from litscale.strategies.pipeline import SCHEDULES
from litscale.strategies.stages import balanced_cuts, stage_ranks

# SGD + momentum, 5 steps of a global batch of 8 (every stage sees all of it), clipped.
SETUP = ParitySetup(config=TINY_WITH_BIASES, gradient_clip_val=0.5)
VALIDATION = dataclasses.replace(SETUP, data_seed=1, steps=2)  # 2 other batches of 8
MICROBATCHES = 4
TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}


def expected_results() -> tuple[dict, float, float]:
    """Weights, last train loss and final validation loss of a single-process loop."""
    trace = reference(SETUP)
    module = tiny_module(SETUP)
    module.net.load_state_dict(trace.weights)
    with torch.no_grad():
        val = torch.stack([module.loss((tokens[:, :-1], tokens[:, 1:]))
                           for tokens in global_batches(VALIDATION)]).mean()
    return trace.weights, trace.losses[-1], val.item()


def fit_pipeline(rank, world_size, strategy_kwargs, checkpoint_dir=None):
    """Fit with the pipeline strategy; return this rank's stage weights and the logged losses."""
    import lightning as L

    from litscale.strategies import PipelineParallelStrategy

    module = tiny_module(SETUP)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=SETUP.steps,
        gradient_clip_val=SETUP.gradient_clip_val,
        strategy=PipelineParallelStrategy(microbatches=MICROBATCHES, **strategy_kwargs),
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        val_check_interval=SETUP.steps, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=rank_loader(SETUP), val_dataloaders=rank_loader(VALIDATION))
    if checkpoint_dir is not None:
        trainer.save_checkpoint(f"{checkpoint_dir}/pp.ckpt")
    weights = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    metrics = trainer.callback_metrics
    return weights, float(metrics["train/loss"]), float(metrics["val/loss"])


def fit_every_schedule(rank, world_size, schedules, checkpoint_dir):
    """One process start for all schedules (starting ranks costs more than fitting here); the
    GPipe run, cut at an explicit split point, also saves a checkpoint."""
    results = {}
    for schedule in schedules:
        kwargs = {"schedule": schedule}
        if schedule == "gpipe":
            kwargs["split_points"] = ["blocks.1"]
        results[schedule] = fit_pipeline(rank, world_size, kwargs,
                                         checkpoint_dir if schedule == "gpipe" else None)
    return results


def assert_stages_match(results, expected_weights, expected_loss, expected_val, label=""):
    stage_keys = [set(weights) for weights, _, _ in results]
    assert not stage_keys[0] & stage_keys[1], label
    assert stage_keys[0] | stage_keys[1] == set(expected_weights), label
    for weights, train_loss, val_loss in results:  # every rank logs the last stage's loss
        assert train_loss == pytest.approx(expected_loss, rel=1e-5), label
        assert val_loss == pytest.approx(expected_val, rel=1e-5), label
        for name, value in weights.items():
            torch.testing.assert_close(value, expected_weights[name], **TOLERANCE,
                                       msg=lambda m, n=name: f"{label} {n}: {m}")


@pytest.fixture(scope="module")
def expected():
    return expected_results()


@pytest.fixture(scope="module")
def every_schedule(tmp_path_factory):
    checkpoint_dir = tmp_path_factory.mktemp("pipeline")
    return run_distributed(fit_every_schedule, 2, list(SCHEDULES), str(checkpoint_dir), timeout=280), \
        checkpoint_dir


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_stage_pipeline_matches_single_process(schedule, every_schedule, expected):
    """Each schedule (interleaved and V shapes with 2 stages per rank): weights after 5 clipped
    SGD steps, the train loss every rank logs, and the validation loss."""
    results, _ = every_schedule
    assert_stages_match([result[schedule] for result in results], *expected, label=schedule)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_holds_each_stage_and_loads_into_the_plain_network(every_schedule, expected):
    import torch.distributed.checkpoint as dcp

    _, checkpoint_dir = every_schedule
    plain = tiny_module(SETUP)
    state = {"state_dict": plain.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint_dir / "pp.ckpt"))  # written by both stages
    for name, value in expected[0].items():
        torch.testing.assert_close(state["state_dict"][f"net.{name}"], value, **TOLERANCE)


def test_stages_balance_parameters_and_place_interleaved_and_v_shapes():
    assert balanced_cuts([10, 100, 100, 100, 100, 10], 2) == [0, 3]
    assert balanced_cuts([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    assert stage_ranks(4, 2, "loop") == [0, 1, 0, 1]
    assert stage_ranks(4, 2, "v") == [0, 1, 1, 0]


# (train.py's one-line refusals of a mesh are test_validation.py's pipeline-* and tensor-parallel-* cases)


def _validate(world_size=2, *, preset="nano", tie=None, **kwargs):
    from litscale.models.gpt import build_gpt
    from litscale.strategies import PipelineParallelStrategy

    with torch.device("meta"):
        net = build_gpt(preset=preset, tie_embeddings=tie)
    PipelineParallelStrategy(**kwargs).validate_setup(world_size=world_size, net=net)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tie": True}, "strategy.pipeline_parallel_size=2 cuts between tied parameters (wte.weight and "
     "lm_head.weight are one tensor on stages 0 and 1); untie them (model.net.tie_embeddings=false) "
     "or keep them on one stage"),
    ({"split_points": ["blocks.9"]}, "strategy.split_points=['blocks.9']: 'blocks.9' is not a block to "
     "cut before; allowed: blocks.0, blocks.1, blocks.2, blocks.3, ln_f"),
    ({"split_points": ["blocks.1", "blocks.2"]}, "strategy.split_points=['blocks.1', 'blocks.2'] gives 3 "
     "stages but the pipeline has 2; allowed: 1 names"),
    ({"schedule": "zbv_zero_bubble", "virtual_stages": 3}, "strategy.virtual_stages=3 is not valid for "
     "strategy.schedule=zbv_zero_bubble: its V shape holds exactly 2 stages per rank"),
    ({"schedule": "1f1b", "virtual_stages": 2}, "strategy.virtual_stages=2 needs a multi-stage schedule; "
     "strategy.schedule=1f1b runs 1 stage per rank (try interleaved_1f1b)"),
    ({"microbatches": 1}, "strategy.microbatches=1 is fewer than the 2 pipeline ranks, which "
     "strategy.schedule=1f1b needs; allowed: >= 2 (or schedule=gpipe)"),
    ({"world_size": 4, "pipeline_parallel_size": 2, "data_parallel_size": None, "tensor_parallel_size": 3},
     "strategy.pipeline_parallel_size=2 x strategy.tensor_parallel_size=3 = 6 does not divide the world "
     "size (4); allowed: sizes whose product divides 4"),
])
def test_pipeline_and_3d_mesh_errors_are_one_line(kwargs, message):
    with pytest.raises(ValueError) as error:
        _validate(**kwargs)
    assert str(error.value) == message


def test_3d_mesh_sizes_resolve_and_valid_setups_pass():
    from litscale.parallel.layout import MeshSizes, resolve_mesh_sizes

    assert resolve_mesh_sizes(8, pipeline=2, data=None, tensor=2) == MeshSizes(2, 2, 2)
    assert resolve_mesh_sizes(4, pipeline=None, data=1, tensor=2) == MeshSizes(2, 1, 2)
    _validate(8, pipeline_parallel_size=2, data_parallel_size=2, tensor_parallel_size=2)
    _validate(2, schedule="interleaved_1f1b", split_points=["blocks.0", "blocks.2", "blocks.3"])


# --- end to end through train.py -------------------------------------------------------------

SHORT_RUN = ("optimizer=sgd", "optimizer.lr=0.05", "trainer.max_steps=5", "trainer.val_check_interval=5",
             "trainer.limit_val_batches=2", "trainer.accelerator=cpu", "trainer.devices=2",
             "data.seq_len=32", "data.max_bytes=400000", "trainer.enable_progress_bar=false",
             "data.batch_size=8")


@pytest.mark.soak  # make test-full: keeps make test within its time budget
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_py_tensor_parallel_and_pipeline_runs_agree(tmp_path):
    """Both strategies see the same global batches, so they train to the same losses (train.py
    on the rank pool; a pipeline's exit from its own interpreters is the runnable command of
    docs/model-parallel.md, in test_docs.py)."""
    tp = train_on_pool(*SHORT_RUN, "strategy=tensor_parallel", "name=tp", outputs=tmp_path, devices=2)
    assert tp.returncode == 0, explain(tp)
    pp = train_on_pool(*SHORT_RUN, "strategy=pipeline", "strategy.schedule=1f1b", "strategy.microbatches=4",
                       "name=pp", outputs=tmp_path, devices=2)
    assert pp.returncode == 0, explain(pp)
    by_strategy = {s["choices"]["strategy"]: s for s in summaries(tmp_path)}
    for summary in by_strategy.values():
        assert summary["steps"] == 5 and summary["data_parallel_size"] == 1
        assert summary["global_batch"] == 8 and summary["world_size"] == 2
        assert summary["val/loss"] < summary["val/loss_initial"]
    for key in ("train/loss", "val/loss", "val/loss_initial"):
        assert by_strategy["pipeline"][key] == pytest.approx(by_strategy["tensor_parallel"][key], rel=1e-5)


@pytest.mark.soak  # make test-full: keeps make test within its time budget
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_py_pipeline_resumes_from_its_per_stage_checkpoint(tmp_path):
    """5 steps + resume to 10 (each stage reloads its weights and momentum) == 10 straight; on the
    rank pool (the claim is the checkpoint's, not the launcher's)."""
    run = (*(o for o in SHORT_RUN if not o.startswith(("trainer.max_steps", "trainer.val_check"))),
           "strategy=pipeline", "scheduler=constant")
    first = train_on_pool(*run, "trainer.max_steps=5", "trainer.val_check_interval=5", "name=resumed",
                          outputs=tmp_path, devices=2)
    assert first.returncode == 0, explain(first)
    resumed = train_on_pool(*run, "trainer.max_steps=10", "trainer.val_check_interval=10", "name=resumed",
                            "ckpt_path=last", outputs=tmp_path, devices=2)
    assert resumed.returncode == 0, explain(resumed)
    straight = train_on_pool(*run, "trainer.max_steps=10", "trainer.val_check_interval=10", "name=straight",
                             outputs=tmp_path, devices=2)
    assert straight.returncode == 0, explain(straight)
    *_, after_resume, reference = summaries(tmp_path)
    assert after_resume["steps"] == reference["steps"] == 10
    for key in ("train/loss", "val/loss"):
        assert after_resume[key] == pytest.approx(reference[key], rel=1e-5), key


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipeline_with_data_parallel_exports_every_stage_as_one_process_trains_it(tmp_path):
    """PP 2 x DP 2 (FSDP inside each stage): ``model.pt`` holds both stages' weights, each equal to
    one process's after the same global batches. The stages' FSDP gather kept its tensors on
    global rank 0 only, so the second stage exported nothing (found by the combination sample)."""
    run = ("model=llama", "data=synthetic", "data.seq_len=32", "optimizer=sgd", "trainer.max_steps=3",
           "trainer.gradient_clip_val=null", "trainer.accelerator=cpu", "callbacks=none",
           "trainer.enable_progress_bar=false")
    pipelined = train_on_pool(*run, "strategy=pipeline", "strategy.pipeline_parallel_size=2",
                              "strategy.data_parallel_size=2", "data.batch_size=8", "trainer.devices=4",
                              "launcher.oversubscribe=true", "paths.output_dir=" + str(tmp_path / "pp"),
                              outputs=tmp_path, devices=4)
    assert pipelined.returncode == 0, explain(pipelined)
    single = train_on_pool(*run, "strategy=single", "data.batch_size=16", "paths.output_dir=" + str(tmp_path / "one"),
                           outputs=tmp_path)
    assert single.returncode == 0, explain(single)
    got, want = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("pp", "one"))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1.3e-6, atol=1e-5, msg=name)
