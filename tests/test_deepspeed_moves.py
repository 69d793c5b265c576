"""A DeepSpeed ZeRO checkpoint (stages 1-3) read whole as a file strategy's checkpoint
(``litscale.checkpoint.deepspeed``), on checkpoint files laid out as DeepSpeed lays them out:
each rank's flat partition of every parameter group, and where each parameter lies in it. End
to end (ZeRO-1, 2 and 3 runs resumed under other strategies, and the weights against
DeepSpeed's own ``zero_to_fp32``): ``test_moving_runs.py``."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from litscale.checkpoint.deepspeed import deepspeed_as_file_checkpoint, why_not_movable
from litscale.checkpoint.moves import OPTIMIZER_PARAM_NAMES


def Fragment(start: int, numel: int):  # noqa: N802 - DeepSpeed's own, as its files pickle it
    from deepspeed.utils.tensor_fragment import fragment_address

    return fragment_address(numel=numel, start=start)
SHAPES = [OrderedDict([("net.a", (2, 3)), ("net.b", (4,))]), OrderedDict([("net.c", (3,))])]


def stage3_partitions(whole: list[dict], ranks: int = 2) -> list[torch.Tensor]:
    """ZeRO-3's: each parameter cut into ``ranks`` padded pieces, rank r's pieces one after the
    other in its partition of the group."""
    flats = []
    for group, shapes in enumerate(SHAPES):
        pieces = [[] for _ in range(ranks)]
        for name in shapes:
            flat = whole[group][name].flatten()
            share = -(-flat.numel() // ranks)
            flat = torch.cat([flat, flat.new_zeros(share * ranks - flat.numel())])
            for rank in range(ranks):
                pieces[rank].append(flat[rank * share:(rank + 1) * share])
        flats.append(torch.stack([torch.cat(p) for p in pieces]))
    return flats


def partitions(whole: list[torch.Tensor], ranks: int = 2):
    """ZeRO-1/2's: each group's parameters flattened in order and cut into ``ranks`` equal
    partitions (padded), with each parameter's fragment in each partition."""
    flats, mappings = [], [[] for _ in range(ranks)]
    for group, shapes in enumerate(SHAPES):
        flat = torch.cat([whole[group][name].flatten() for name in shapes])
        size = -(-flat.numel() // ranks)
        flat = torch.cat([flat, flat.new_zeros(size * ranks - flat.numel())])
        flats.append(flat.view(ranks, size))
        offset = 0
        for name, shape in shapes.items():
            numel = torch.Size(shape).numel()
            for rank in range(ranks):
                lo, hi = max(offset, rank * size), min(offset + numel, (rank + 1) * size)
                if lo < hi:
                    mappings[rank].append((group, name, Fragment(lo - rank * size, hi - lo)))
            offset += numel
    return flats, mappings


def split_first(flats: list[torch.Tensor], at: int = 5) -> list[torch.Tensor]:
    """ZeRO-3's sub-groups: the first group's partitions cut in two (a group larger than
    ``sub_group_size``), each rank's sub-group partitions still one after the other."""
    return [flats[0][:, :at], flats[0][:, at:], *flats[1:]]


def write(tmp_path, *, state_keys=("exp_avg", "exp_avg_sq"), stage3=False, sub_groups=False) -> tuple[str, dict]:
    torch.manual_seed(0)
    tensors = {kind: [{name: torch.randn(shape) for name, shape in group.items()} for group in SHAPES]
               for kind in ("fp32", *state_keys)}
    folder = tmp_path / "last.ckpt" / "checkpoint"
    folder.mkdir(parents=True)
    (tmp_path / "last.ckpt" / "latest").write_text("checkpoint")
    module = OrderedDict((name, tensors["fp32"][g][name].half()) for g, group in enumerate(SHAPES) for name in group)
    module["net.buffer"] = torch.arange(3.0)
    torch.save({"module": module, "param_shapes": SHAPES, "ds_version": "0", "global_step": 4, "loops": {"x": 1},
                "lr_schedulers": [{"last_epoch": 4}], "dp_world_size": 2,
                "ds_config": {"zero_optimization": {"stage": 3 if stage3 else 2}}}, folder / "mp_rank_00_model_states.pt")
    flats = {kind: (stage3_partitions if stage3 else lambda g: partitions(g)[0])(groups)
             for kind, groups in tensors.items()}
    if sub_groups:
        flats = {kind: split_first(flat) for kind, flat in flats.items()}
    count = len(flats["fp32"])
    _, mappings = partitions(tensors["fp32"])
    for rank in range(2):
        state = {group: {"step": torch.tensor(4.0), **{k: flats[k][group][rank] for k in state_keys}}
                 for group in range(count)}
        optimizer = {"state": state, "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}]}
        weights = [flats["fp32"][group][rank] for group in range(count)]
        if stage3:
            saved = {"optimizer_state_dict": optimizer, "fp32_flat_groups": weights}
        else:
            slices = [OrderedDict((name, fragment) for g, name, fragment in mappings[rank] if g == group)
                      for group in range(len(SHAPES))]
            saved = {"base_optimizer_state": optimizer, "single_partition_of_fp32_groups": weights,
                     "param_slice_mappings": slices}
        torch.save({"optimizer_state_dict": saved}, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return str(tmp_path / "last.ckpt"), tensors


@pytest.mark.parametrize(("stage3", "sub_groups"), [(False, False), (True, False), (True, True)],
                         ids=["zero1_2", "zero3", "zero3_sub_groups"])
def test_every_parameter_and_moment_is_put_back_whole_from_its_fragments(tmp_path, stage3, sub_groups):
    path, tensors = write(tmp_path, stage3=stage3, sub_groups=sub_groups)
    assert why_not_movable(path) is None
    checkpoint = deepspeed_as_file_checkpoint(path)
    names = [name for group in SHAPES for name in group]
    assert checkpoint[OPTIMIZER_PARAM_NAMES] == [[list(group) for group in SHAPES]]
    for g, group in enumerate(SHAPES):
        for name in group:
            assert torch.equal(checkpoint["state_dict"][name], tensors["fp32"][g][name])  # the fp32 master copy
            state = checkpoint["optimizer_states"][0]["state"][names.index(name)]
            assert torch.equal(state["exp_avg"], tensors["exp_avg"][g][name])
            assert torch.equal(state["exp_avg_sq"], tensors["exp_avg_sq"][g][name])
            assert state["step"] == 4
    assert torch.equal(checkpoint["state_dict"]["net.buffer"], torch.arange(3.0))
    assert [g["params"] for g in checkpoint["optimizer_states"][0]["param_groups"]] == [[0, 1], [2]]
    assert [g["lr"] for g in checkpoint["optimizer_states"][0]["param_groups"]] == [0.1, 0.2]
    assert checkpoint["loops"] == {"x": 1} and checkpoint["global_step"] == 4  # Lightning's, as saved
    assert "module" not in checkpoint and "ds_version" not in checkpoint and "param_shapes" not in checkpoint


@pytest.mark.parametrize("stage3", [False, True], ids=["zero1_2", "zero3"])
def test_an_optimizer_whose_state_has_no_mapping_cannot_move_and_says_why(tmp_path, stage3):
    path, _ = write(tmp_path, state_keys=("momentum_buffer",), stage3=stage3)
    assert why_not_movable(path) == "its optimizer keeps momentum_buffer, which litscale moves only for Adam and AdamW"


@pytest.mark.slow  # over half a second alone: imports DeepSpeed
@pytest.mark.parametrize("stage3", [False, True], ids=["zero1_2", "zero3"])
def test_an_optimizer_without_adams_moments_cannot_move_either(tmp_path, stage3):
    """Its partitions hold no moments to cut back into parameters (it read ``exp_avg`` from
    them after the ranks started: ``KeyError``)."""
    path, _ = write(tmp_path, state_keys=(), stage3=stage3)
    assert why_not_movable(path) == "its optimizer keeps no exp_avg, exp_avg_sq, which litscale moves only for Adam and AdamW"


def test_a_checkpoint_that_cannot_move_is_refused_in_one_line_before_any_rank_starts(tmp_path):
    from omegaconf import OmegaConf

    from litscale.app.checks.checkpoint import check_checkpoint_moves
    from litscale.errors import ConfigError
    from litscale.strategies.fsdp import FSDPStrategy

    path, _ = write(tmp_path, state_keys=("momentum_buffer",))
    with pytest.raises(ConfigError) as refused:
        check_checkpoint_moves(OmegaConf.create({"ckpt_path": path}), path, FSDPStrategy, 2, {"strategy": "fsdp"})
    assert str(refused.value) == (
        f"ckpt_path={path!r}: this DeepSpeed checkpoint (ZeRO-2 on 2 ranks) is read only by DeepSpeed's own "
        "loader, not by strategy=fsdp on 2 ranks: its optimizer keeps momentum_buffer, which litscale moves only "
        "for Adam and AdamW; allowed: strategy=deepspeed_zero strategy.stage=1 or 2 on 2 ranks (trainer.devices x "
        "trainer.num_nodes), or start from its weights (DeepSpeed's zero_to_fp32.py) with ckpt_path=null")
    path, _ = write(tmp_path / "movable")
    check_checkpoint_moves(OmegaConf.create({"ckpt_path": path}), path, FSDPStrategy, 4, {"strategy": "fsdp"})


def adam_checkpoint(path: str) -> None:
    """A file strategy's checkpoint of one AdamW step (the state the move into ZeRO writes)."""
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch.save({"state_dict": {f"net.{k}": v for k, v in layer.state_dict().items()},
                "optimizer_states": [optimizer.state_dict()]}, path)


@pytest.mark.parametrize(("stage", "optimizer", "refused"), [
    (2, "muon", "optimizer=Muon"),
    (2, "sgd", "optimizer=SGD"),  # SGD's momentum: ZeRO's move writes Adam's state only
    (2, "adamw", None),
    (3, "adamw", None),
], ids=["muon", "sgd", "zero2-adamw", "zero3-adamw"])
def test_another_strategys_checkpoint_goes_into_zero_with_adam_only(tmp_path, stage, optimizer, refused):
    from helpers.configs import compose_job

    from litscale.app.build import build_strategy
    from litscale.app.checks.checkpoint import check_checkpoint_moves
    from litscale.errors import ConfigError

    path = str(tmp_path / "last.ckpt")
    adam_checkpoint(path)
    cfg, _ = compose_job(["strategy=deepspeed_zero", f"strategy.stage={stage}", f"optimizer={optimizer}",
                          "trainer.accelerator=cpu", "trainer.devices=2", "trainer.gradient_clip_val=null",
                          f"ckpt_path={path}"], tmp_path / "job")
    check = lambda: check_checkpoint_moves(cfg, path, build_strategy(cfg), 2, {"strategy": "deepspeed_zero"})  # noqa: E731
    if refused is None:
        check()
        return
    with pytest.raises(ConfigError) as error:
        check()
    assert str(error.value) == (
        f"ckpt_path={path!r}: strategy=deepspeed_zero resumes a file of another strategy only with Adam or AdamW, "
        f"not {refused}; allowed: resume it with any other strategy, or start fresh with ckpt_path=null")


@pytest.mark.parametrize(("stage", "devices"), [(2, 4), (3, 2), (1, 1)], ids=["4-ranks", "zero3", "1-rank"])
def test_a_deepspeed_checkpoint_moves_into_another_zero_layout_with_adam_and_not_otherwise(tmp_path, stage, devices):
    """DeepSpeed's own loader reads its partitions only on as many ranks in the same format; any
    other ZeRO layout gets the checkpoint read whole (Adam's moments move), or a one-line refusal."""
    from helpers.configs import compose_job

    from litscale.app.build import build_strategy
    from litscale.app.checks.checkpoint import check_checkpoint_moves
    from litscale.checkpoint.deepspeed import reads_as_saved
    from litscale.errors import ConfigError

    def check(path: str) -> None:
        cfg, _ = compose_job(["strategy=deepspeed_zero", f"strategy.stage={stage}", "trainer.accelerator=cpu",
                              f"trainer.devices={devices}", "launcher.oversubscribe=true", f"ckpt_path={path}"],
                             tmp_path / "job")
        check_checkpoint_moves(cfg, path, build_strategy(cfg), devices, {"strategy": "deepspeed_zero"})

    movable, _ = write(tmp_path / "adam")
    assert not reads_as_saved(movable, stage, devices) and reads_as_saved(movable, 1, 2)
    check(movable)
    stuck, _ = write(tmp_path / "sgd", state_keys=("momentum_buffer",))
    with pytest.raises(ConfigError) as refused:
        check(stuck)
    assert str(refused.value) == (
        f"ckpt_path={stuck!r}: this DeepSpeed checkpoint (ZeRO-2 on 2 ranks) is read only by DeepSpeed's own "
        f"loader, not by strategy=deepspeed_zero on {devices} rank{'s' if devices > 1 else ''}: its optimizer keeps momentum_buffer, which "
        "litscale moves only for Adam and AdamW; allowed: strategy=deepspeed_zero strategy.stage=1 or 2 on 2 ranks "
        "(trainer.devices x trainer.num_nodes), or start from its weights (DeepSpeed's zero_to_fp32.py) with "
        "ckpt_path=null")


# --- DeepSpeed's own files: read without running code, with only the classes they name -------

REAL_ZERO = {"zero2": (2, "AdamW"), "zero3": (3, "AdamW"), "zero2-sgd": (2, "SGD")}


def _save_real_zero_checkpoints(rank: int, world_size: int, folder: str) -> None:
    """One step of a small module and its checkpoint, saved by DeepSpeed through litscale's
    strategy, for each of ``REAL_ZERO`` (on this one rank)."""
    import lightning as L

    from litscale.strategies import DeepSpeedZeroStrategy

    class Small(L.LightningModule):
        def __init__(self, optimizer: str) -> None:
            super().__init__()
            self.optimizer_name = optimizer
            # NOTE: an even count of parameters (30): ZeRO-1/2 cut to an odd one fail DeepSpeed's
            # alignment assertion (the strategy sets the buckets to the parameter count)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            momentum = {"momentum": 0.9} if self.optimizer_name == "SGD" else {}
            return getattr(torch.optim, self.optimizer_name)(self.parameters(), lr=0.1, **momentum)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    for name, (stage, optimizer) in REAL_ZERO.items():
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedZeroStrategy(stage=stage), max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(Small(optimizer), train_dataloaders=data)
        trainer.save_checkpoint(f"{folder}/{name}.ckpt")


@pytest.fixture(scope="module")
def real_zero(tmp_path_factory) -> str:
    from helpers.distributed import run_distributed

    folder = str(tmp_path_factory.mktemp("real_zero"))
    run_distributed(_save_real_zero_checkpoints, 1, folder, timeout=300)
    return folder


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_real_zero_checkpoints_read_without_running_code_naming_only_the_allowed_classes(real_zero):
    """What DeepSpeed 0.19 pickles beside tensors and plain data is exactly the classes allowed
    for its files (``deepspeed_classes``), and every file reads with them, weights-only."""
    import glob

    from litscale.checkpoint.deepspeed import saved_layout, saved_state_kinds
    from litscale.checkpoint.reading import deepspeed_classes, is_readable_checkpoint

    allowed = {f"{kind.__module__}.{kind.__qualname__}" for kind in deepspeed_classes()}
    named = set()
    for name in REAL_ZERO:
        path = f"{real_zero}/{name}.ckpt"
        for file in glob.glob(f"{path}/*/*.pt"):
            named |= set(torch.serialization.get_unsafe_globals_in_checkpoint(file))
        assert is_readable_checkpoint(path)
    assert named and named <= allowed, named - allowed
    assert saved_layout(f"{real_zero}/zero3.ckpt") == (3, 1)
    assert saved_state_kinds(f"{real_zero}/zero2.ckpt") == {"step", "exp_avg", "exp_avg_sq"}
    assert why_not_movable(f"{real_zero}/zero2-sgd.ckpt") == (
        "its optimizer keeps momentum_buffer, which litscale moves only for Adam and AdamW")
    for name in ("zero2", "zero3"):  # read whole, weights-only: the weights DeepSpeed's own reader recovers
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        ours = deepspeed_as_file_checkpoint(f"{real_zero}/{name}.ckpt")["state_dict"]
        theirs = get_fp32_state_dict_from_zero_checkpoint(f"{real_zero}/{name}.ckpt")
        assert {k: ours[k] for k in theirs}.keys() == theirs.keys()
        for key, tensor in theirs.items():
            assert torch.equal(ours[key], tensor), key


# --- another strategy's checkpoint into ZeRO: only Adam's state moves ---------------------------

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_sgd_runs_checkpoint_into_zero_is_refused_in_one_line_before_any_rank_starts(tmp_path):
    """``deepspeed_moves.load_into_zero`` writes Adam's step and moments: a checkpoint of an SGD
    run, into ZeRO with SGD or with AdamW, is refused with the line a user sees (it died after
    start with ``KeyError: 'step'``)."""
    from helpers.cli import explain
    from helpers.inprocess import refusal_on_pool, train_on_pool
    from helpers.moving_runs import RUN

    from litscale.checkpoint.resume import newest_last_checkpoint

    saved = train_on_pool(*RUN, "strategy=single", "optimizer=sgd", "data.batch_size=4", "trainer.max_steps=1",
                          outputs=tmp_path / "saved")
    assert saved.returncode == 0, explain(saved)
    path = newest_last_checkpoint(str(tmp_path / "saved"))
    for optimizer, refused in (("sgd", "optimizer=SGD"), ("adamw", "a checkpoint whose optimizer keeps momentum_buffer")):
        line = refusal_on_pool(*RUN, "strategy=deepspeed_zero", f"optimizer={optimizer}", "trainer.devices=2",
                               "data.batch_size=2", f"ckpt_path={path}", outputs=tmp_path / optimizer)
        assert line == (
            f"error: ckpt_path={path!r}: strategy=deepspeed_zero resumes a file of another strategy only with Adam "
            f"or AdamW, not {refused}; allowed: resume it with any other strategy, or start fresh with ckpt_path=null")


@pytest.mark.slow  # over half a second: DCP saves, Hydra locates the optimizer
@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
def test_a_sharded_directory_of_sgd_into_zero_is_refused_by_what_its_optimizer_keeps(tmp_path):
    """A DCP directory's optimizer state, named in its ``.metadata`` (read without running code):
    SGD's momentum does not move into ZeRO, AdamW's step and moments do."""
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from litscale.app.checks.checkpoint import check_checkpoint_moves
    from litscale.errors import ConfigError
    from litscale.strategies import DeepSpeedZeroStrategy

    def saved(optimizer: type, **options) -> str:
        net = torch.nn.Linear(3, 2)
        stepped = optimizer(net.parameters(), lr=0.1, **options)
        net(torch.ones(1, 3)).sum().backward()
        stepped.step()
        weights, state = get_state_dict(net, stepped)
        path = str(tmp_path / f"{optimizer.__name__}-{options.get('momentum', 0)}")
        dcp.save({"state_dict": weights, "optimizer_0": state}, checkpoint_id=path)
        return path

    def check(path: str) -> None:
        cfg = OmegaConf.create({"ckpt_path": path, "optimizer": {"_target_": "torch.optim.AdamW"}})
        check_checkpoint_moves(cfg, path, DeepSpeedZeroStrategy, 2, {"strategy": "deepspeed_zero"})

    check(saved(torch.optim.AdamW))
    for momentum, keeps in ((0.9, "keeps momentum_buffer"), (0.0, "keeps no exp_avg, exp_avg_sq, step")):
        sgd = saved(torch.optim.SGD, momentum=momentum)
        with pytest.raises(ConfigError) as refused:
            check(sgd)
        assert str(refused.value) == (
            f"ckpt_path={sgd!r}: strategy=deepspeed_zero resumes a sharded directory of another strategy only with "
            f"Adam or AdamW, not a checkpoint whose optimizer {keeps}; allowed: resume it with any other strategy, or "
            "start fresh with ckpt_path=null")
