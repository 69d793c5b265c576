"""The run layout: computed once by validation, checked by its own arithmetic, read by LR
scaling and written to the summary."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from helpers.configs import compose_job

from litscale.app.checks.validation import ConfigError, validate
from litscale.optim.lr_scaling import LRScaling
from litscale.parallel.layout import MeshSizes, RunLayout, mesh_of, micro_batch_for
from litscale.parallel.mesh import world_layout


def test_global_batch_counts_data_parallel_ranks_only():
    layout = RunLayout(num_nodes=2, processes_per_node=4, micro_batch=3, accumulation=2,
                       mesh=MeshSizes(pipeline=2, data_replicate=1, data_shard=2, tensor=2))
    assert layout.world_size == 8 and layout.data_parallel_size == 2
    assert layout.global_batch == 3 * 2 * 2
    assert layout.as_dict()["global_batch"] == 12 and layout.as_dict()["mesh"]["tensor"] == 2


def test_a_mesh_that_does_not_tile_the_world_is_refused():
    with pytest.raises(ValueError, match=r"mesh pipeline 1 x data 2 x tensor 1 = 2 ranks but "
                                         r"1 node\(s\) x 4 processes = 4"):
        RunLayout(processes_per_node=4, mesh=MeshSizes(data_replicate=2))


def test_hsdp_mesh_describes_replicate_and_shard():
    assert MeshSizes(data_replicate=2, data_shard=2).describe() == (
        "pipeline 1 x data 4 (replicate 2 x shard 2) x tensor 1")


def test_strong_scaling_micro_batch_and_its_error():
    assert micro_batch_for(64, data_parallel_size=4, accumulation=2) == 8
    with pytest.raises(ConfigError, match=r"^scaling.global_batch=6 does not split over 4"):
        micro_batch_for(6, data_parallel_size=4, accumulation=1)


def test_a_strategy_without_a_mesh_is_data_parallel_over_every_rank():
    assert mesh_of(object(), 4) == MeshSizes(data_replicate=4)


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], dict(world_size=1, data_parallel_size=1, global_batch=16)),
    (["strategy=ddp", "trainer.devices=2", "data.batch_size=4", "trainer.accumulate_grad_batches=3"],
     dict(world_size=2, data_parallel_size=2, global_batch=24)),
    (["strategy=tensor_parallel", "trainer.devices=2", "data.batch_size=4"],
     dict(world_size=2, data_parallel_size=1, global_batch=4)),
    (["strategy=ddp", "trainer.devices=2", "scaling.global_batch=32"],
     dict(world_size=2, data_parallel_size=2, global_batch=32, micro_batch=16, strong_scaling=True)),
])
def test_validation_returns_the_layout(overrides, expected, tmp_path, outputs_root):
    cfg, choices = compose_job(["trainer.accelerator=cpu", *overrides], tmp_path)
    layout = validate(cfg, choices=choices).as_dict()
    assert {key: layout[key] for key in expected} == expected


def test_lr_scaling_reads_the_layout_not_the_trainer():
    """Given a layout, the callback scales from its global batch whatever the trainer says."""
    layout = RunLayout(processes_per_node=2, mesh=MeshSizes(data_replicate=2), micro_batch=8,
                       accumulation=2)
    callback = LRScaling(rule="linear", base_batch_size=8, layout=layout)
    module = SimpleNamespace(optimizer_factory=functools.partial(torch.optim.SGD, lr=0.1))
    trainer = SimpleNamespace(accumulate_grad_batches=1, strategy=None, datamodule=None)
    callback.setup(trainer, module, "fit")
    assert callback.global_batch == 32 and callback.lr == pytest.approx(0.4)


def test_a_device_sweep_gives_every_job_the_largest_jobs_thread_share():
    from litscale.app.scaling_study import threads_per_rank_of_sweep

    assert threads_per_rank_of_sweep(["-m", "trainer.devices=1,2", "strategy=ddp"], cores=2) == 1
    assert threads_per_rank_of_sweep(["trainer.devices=1,2,4"], cores=16) == 4
    assert threads_per_rank_of_sweep(["trainer.devices=2"], cores=2) is None


def test_context_ranks_split_the_world_and_expert_ranks_are_a_view_over_data_x_context():
    mesh = MeshSizes(data_shard=2, context=2, tensor=2, expert=4)
    assert mesh.world_size == 8 and mesh.data == 2  # context ranks share a sample: no more data ranks
    assert world_layout(mesh) == ((1, 2, 2, 2), ("pipeline_parallel", "shard", "context_parallel",
                                                 "tensor_parallel"))
    assert mesh.describe() == "pipeline 1 x data 2 x context 2 x tensor 2 (expert 4 over data x context)"
    assert world_layout(MeshSizes(data_shard=2, tensor=2))[1] == ("pipeline_parallel", "shard",
                                                                  "tensor_parallel")  # as before
    with pytest.raises(ValueError) as error:
        MeshSizes(data_shard=4, expert=3)
    assert str(error.value) == ("strategy.expert_parallel_size=3 does not divide the data x context ranks "
                                "(4 x 1 = 4); allowed: a divisor of 4")
    layout = RunLayout(processes_per_node=8, micro_batch=2, mesh=mesh)
    assert layout.global_batch == 2 * 2  # micro batch x data ranks only
