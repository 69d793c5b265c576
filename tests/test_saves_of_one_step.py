"""The second save of one step in the background (``checkpoint.async_save=true``,
``litscale.checkpoint.background``): ``ModelCheckpoint`` under the default callbacks saves the top-k
file and then ``last.ckpt`` at every validation, and the state is copied once for both, with
nothing waited for; both checkpoints are complete and hold the step's state.

The references are the state the run ended with (its module and optimizer) and, for a sharded
directory, the tensors each save was handed; never the saved files against each other alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.distributed import one_rank_group
from omegaconf import OmegaConf

from litscale.checkpoint import atomic as atomic_checkpoint
from litscale.checkpoint.resume import is_complete_checkpoint

REPO = Path(__file__).resolve().parents[1]
WIDTH, VALIDATIONS, EVERY = 256, 3, 2


def copied_bytes(monkeypatch) -> list[int]:
    """Bytes the background saves copy from now on (their copies are one ``_foreach_copy_``)."""
    copied: list[int] = []
    original = torch._foreach_copy_

    def counting(targets, sources, **kwargs):
        copied.append(sum(target.numel() * target.element_size() for target in targets))
        return original(targets, sources, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    return copied


class Regression:
    """A linear regression on one fixed batch, validated on the same batch: its loss falls at
    every validation, so the top-k file is saved at each."""

    @staticmethod
    def module():
        import lightning.pytorch as pl

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.net = torch.nn.Linear(WIDTH, WIDTH)

            def training_step(self, batch, index):
                inputs, targets = batch
                return torch.nn.functional.mse_loss(self.net(inputs), targets)

            def validation_step(self, batch, index):
                inputs, targets = batch
                self.log("val/loss", torch.nn.functional.mse_loss(self.net(inputs), targets))

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)

        return Module()

    @staticmethod
    def data(batches: int = 1):
        """The one batch, ``batches`` times."""
        from torch.utils.data import DataLoader, TensorDataset

        torch.manual_seed(1)
        inputs = torch.randn(16, WIDTH) / WIDTH ** 0.5
        targets = inputs @ torch.randn(WIDTH, WIDTH)
        return DataLoader(TensorDataset(inputs.repeat(batches, 1), targets.repeat(batches, 1)), batch_size=16)


def default_model_checkpoint(dirpath: Path):
    """``ModelCheckpoint`` as ``conf/callbacks/default.yaml`` builds it, in ``dirpath``."""
    from hydra.utils import instantiate

    node = OmegaConf.load(REPO / "conf" / "callbacks" / "default.yaml").model_checkpoint
    node.dirpath = str(dirpath)
    return instantiate(node)


def test_async_saves_under_the_default_callbacks_copy_the_state_once_per_validation(tmp_path, monkeypatch):
    import lightning.pytorch as pl

    from litscale.strategies.single import SingleStrategy

    strategy, module = SingleStrategy(), Regression.module()
    strategy.async_save = True  # checkpoint.async_save=true
    copied = copied_bytes(monkeypatch)
    checkpoints = default_model_checkpoint(tmp_path / "checkpoints")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=VALIDATIONS * EVERY, val_check_interval=EVERY,
                         num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[checkpoints])
    saves: list[str] = []
    saving = strategy.save_checkpoint

    def recorded(checkpoint, path, *args, **kwargs):
        saves.append(os.path.basename(path))
        return saving(checkpoint, path, *args, **kwargs)

    monkeypatch.setattr(strategy, "save_checkpoint", recorded)
    trainer.fit(module, train_dataloaders=Regression.data(10), val_dataloaders=Regression.data())
    assert saves == [name for step in range(EVERY, VALIDATIONS * EVERY + 1, EVERY)
                     for name in (f"step{step:06d}.ckpt", "last.ckpt")], saves
    optimizer = trainer.optimizers[0]
    state = [*module.state_dict().values(), *(t for s in optimizer.state.values() for t in s.values()
                                               if isinstance(t, torch.Tensor))]
    state_bytes = sum(tensor.numel() * tensor.element_size() for tensor in state)
    # One copy of the state a validation (and the small rest of the second checkpoint); two before.
    assert state_bytes * VALIDATIONS <= sum(copied) < 1.5 * state_bytes * VALIDATIONS, (sum(copied), state_bytes)
    last, top = tmp_path / "checkpoints" / "last.ckpt", tmp_path / "checkpoints" / f"step{VALIDATIONS * EVERY:06d}.ckpt"
    assert sorted(os.listdir(last.parent)) == sorted([last.name, top.name])
    assert is_complete_checkpoint(str(last)) and is_complete_checkpoint(str(top))
    assert last.read_bytes() == top.read_bytes()  # one write, published under both names
    saved = torch.load(last, weights_only=False)
    for name, tensor in module.state_dict().items():
        assert torch.equal(saved["state_dict"][name], tensor), name
    momentum = saved["optimizer_states"][0]["state"]
    assert all(torch.equal(momentum[index]["momentum_buffer"], optimizer.state[parameter]["momentum_buffer"])
               for index, parameter in enumerate(module.parameters()))


def test_a_second_save_whose_callbacks_differ_keeps_its_own_callbacks_around_the_same_copy(tmp_path, monkeypatch):
    """At the first validation ``last.ckpt`` records itself as ``last_model_path`` and the top-k
    file does not: the second save is written anew from the first's copy, with its own rest."""
    import lightning.pytorch as pl

    from litscale.strategies.single import SingleStrategy

    strategy, module = SingleStrategy(), Regression.module()
    strategy.async_save = True
    copied = copied_bytes(monkeypatch)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=EVERY, val_check_interval=EVERY,
                         num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[default_model_checkpoint(tmp_path / "checkpoints")])
    trainer.fit(module, train_dataloaders=Regression.data(10), val_dataloaders=Regression.data())
    state_bytes = sum(t.numel() * t.element_size() for t in module.parameters()) * 2  # weights and momentum
    assert state_bytes <= sum(copied) < 1.5 * state_bytes
    last, top = tmp_path / "checkpoints" / "last.ckpt", tmp_path / "checkpoints" / f"step{EVERY:06d}.ckpt"
    saved = {path.name: torch.load(path, weights_only=False) for path in (last, top)}
    states = {name: next(v for k, v in checkpoint["callbacks"].items() if k.startswith("ModelCheckpoint"))
              for name, checkpoint in saved.items()}
    assert states[last.name]["last_model_path"] == str(last) and states[top.name]["last_model_path"] == ""
    for name, tensor in module.state_dict().items():
        assert torch.equal(saved[last.name]["state_dict"][name], tensor)
        assert torch.equal(saved[top.name]["state_dict"][name], tensor)


@pytest.fixture
def one_rank():
    with one_rank_group():  # FSDP's DCP saves are collective
        yield


def lightning_checkpoint(weights: dict, moment: torch.Tensor, step: int, last_model_path: str) -> dict:
    """What Lightning hands a strategy's ``save_checkpoint`` (the same tensors at each save)."""
    return {"epoch": 0, "global_step": step, "state_dict": dict(weights),
            "optimizer_states": [{"state": {0: {"exp_avg": moment}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
            "loops": {"fit_loop": {"step": step}}, "callbacks": {"ModelCheckpoint": {"last_model_path": last_model_path}}}


def read_directory(path: str, shapes: dict) -> tuple[dict, dict]:
    """A DCP checkpoint's weights and its ``meta.pt``."""
    weights = {name: torch.zeros(shape) for name, shape in shapes.items()}
    dcp.load({"state_dict": weights}, checkpoint_id=atomic_checkpoint.followed(path), no_dist=True)
    return weights, torch.load(os.path.join(atomic_checkpoint.followed(path), "meta.pt"), weights_only=False)


@pytest.mark.parametrize("publish", ["rename", "pointer"])
def test_a_sharded_directorys_second_save_of_one_step_copies_and_writes_no_shard_again(
        tmp_path, monkeypatch, one_rank, publish):
    """FSDP's DCP directory, saved as ``ModelCheckpoint`` saves at two validations: the second
    save of each links the first's shards (rename) or points to the same save (pointer, where
    its rest is the same) and writes its own ``meta.pt`` where its rest differs."""
    from litscale.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy()
    strategy.async_save, strategy.checkpoint_publish = True, publish
    strategy.parallel_devices = [torch.device("cpu")]  # the trainer sets it
    weights = {f"net.w{i}": torch.full((64, 64), float(i)) for i in range(3)}
    moment = torch.ones(64, 64)
    copied = copied_bytes(monkeypatch)
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    last, steps = str(directory / "last.ckpt"), [str(directory / f"step{s:06d}.ckpt") for s in (2, 4)]
    strategy.save_checkpoint(lightning_checkpoint(weights, moment, 2, ""), steps[0])
    strategy.save_checkpoint(lightning_checkpoint(weights, moment, 2, last), last)
    first = sum(copied)
    for tensor in (*weights.values(), moment):
        tensor.add_(10.0)  # the next steps, in place
    strategy.save_checkpoint(lightning_checkpoint(weights, moment, 4, last), steps[1])
    strategy.remove_checkpoint(steps[0])
    strategy.save_checkpoint(lightning_checkpoint(weights, moment, 4, last), last)
    strategy.checkpoint_writer.close()  # what the strategy's teardown waits for
    state_bytes = 4 * 64 * 64 * 4
    assert first == state_bytes and sum(copied) == 2 * state_bytes, copied  # once a step
    shapes = {name: tensor.shape for name, tensor in weights.items()}
    for path in (last, steps[1]):
        assert is_complete_checkpoint(path)
        saved, meta = read_directory(path, shapes)
        assert all(torch.equal(saved[name], tensor) for name, tensor in weights.items())
        assert meta["global_step"] == 4 and meta["callbacks"]["ModelCheckpoint"]["last_model_path"] == last
    if publish == "pointer":  # both names point to one save, and only it is left
        assert atomic_checkpoint.followed(last) == atomic_checkpoint.followed(steps[1]) != last
        assert sorted(os.listdir(directory)) == sorted(["last.ckpt", os.path.basename(steps[1]),
                                                        os.path.basename(atomic_checkpoint.followed(last))])
    else:  # the same shard files under both names
        assert sorted(os.listdir(directory)) == ["last.ckpt", os.path.basename(steps[1])]
        shard = next(name for name in os.listdir(last) if name.endswith(".distcp"))
        assert os.path.samefile(os.path.join(last, shard), os.path.join(steps[1], shard))
