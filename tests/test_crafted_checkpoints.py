"""Nothing a checkpoint holds runs before any rank starts: whatever ``ckpt_path`` names or a
resume word chooses (a file, a DCP directory, a DeepSpeed directory) is read as tensors and plain
data only, and a file that holds more is refused in one line. Each checkpoint here carries a
pickle whose unpickling would write a file (``Path.write_text``): the file must never appear.
The real DeepSpeed files of this install read so: ``test_deepspeed_moves.py``."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import sharded_checkpoint

from litscale.errors import ConfigError

UNREADABLE = ("is not a readable checkpoint (truncated, corrupt, not a Lightning checkpoint, or holding more than "
              "tensors and plain data, which litscale never unpickles); give a checkpoint path, last, auto, here "
              "or null")


class WritesAFile:
    """Unpickled, writes ``path`` (the code a crafted checkpoint would run)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.write_text, (self.path, "ran")


def crafted_file(path: Path, marker: Path, **rest) -> Path:
    """A Lightning-looking checkpoint file that also holds the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "global_step": 1, **rest, "callbacks": {"x": WritesAFile(marker)}}, path)
    return path


def crafted_dcp(path: Path, marker: Path, *, where: str) -> Path:
    """A DCP directory saved by DCP itself, its ``meta.pt`` (Lightning's) or ``.metadata`` (DCP's,
    a plain pickle) replaced by the payload, or the payload saved by DCP among its values (as
    an optimizer's hyperparameters are: a ``torch.save`` inside a shard file)."""
    if where == "value":
        import torch.distributed.checkpoint as dcp

        dcp.save({"state_dict": {"weight": torch.ones(4)}, "optimizer_0": {"param_groups": [{"lr": WritesAFile(marker)}]}},
                 checkpoint_id=str(path))
        torch.save({"global_step": 4}, path / "meta.pt")
        return path
    sharded_checkpoint(path, step=4)
    if where == "meta.pt":
        torch.save({"global_step": 4, "loops": WritesAFile(marker)}, path / "meta.pt")
    else:
        (path / ".metadata").write_bytes(pickle.dumps(WritesAFile(marker)))
    return path


def crafted_deepspeed(path: Path, marker: Path, *, where: str) -> Path:
    """DeepSpeed's layout (``latest`` naming the tag; the model states and rank 0's optimizer
    partition), one of its files holding the payload."""
    folder = path / "checkpoint"
    folder.mkdir(parents=True)
    (path / "latest").write_text("checkpoint")
    payload = {"payload": WritesAFile(marker)}
    torch.save({"module": {}, "param_shapes": [], "dp_world_size": 1,
                "ds_config": {"zero_optimization": {"stage": 2}}, **(payload if where == "model" else {})},
               folder / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"base_optimizer_state": {"state": {}}, "param_slice_mappings": [],
                                         **(payload if where == "optimizer" else {})}},
               folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return path


def _place(form: str, outputs: Path, run_dir: Path, marker: Path) -> tuple[str, str]:
    """(``ckpt_path`` as typed, the checkpoint it resolves to), the checkpoint crafted."""
    resumed = outputs / "default" / "runs" / "earlier" / "checkpoints" / "last.ckpt"  # ``name``'s runs
    if form in ("auto", "last"):
        return form, str(crafted_file(resumed, marker))
    if form == "here":
        return form, str(crafted_file(run_dir / "checkpoints" / "last.ckpt", marker))
    if form == "file":
        path = str(crafted_file(outputs.parent / "given.ckpt", marker))
    elif form.startswith("dcp"):
        path = str(crafted_dcp(outputs.parent / "given_dcp", marker, where=form.split("-", 1)[1]))
    else:
        path = str(crafted_deepspeed(outputs.parent / "given_ds", marker, where=form.split("-", 1)[1]))
    return path, path


def outcome(call) -> Exception | None:
    """What ``call`` raised (None: nothing), so that what it ran is checked first."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test asserts which
        return error
    return None


FORMS = {  # form -> the strategy it resumes under (the payloads that validation reached there)
    "file": "single", "auto": "single", "last": "single", "here": "single",
    "dcp-meta.pt": "single", "dcp-.metadata": "single", "dcp-value": "single",
    "deepspeed-optimizer": "single", "deepspeed-model": "deepspeed_zero",
}


@pytest.mark.slow  # composes and validates a job, and a DeepSpeed directory imports DeepSpeed
@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
@pytest.mark.parametrize("form", list(FORMS))
def test_a_crafted_checkpoint_under_any_form_of_ckpt_path_runs_nothing_and_is_refused_in_one_line(
        tmp_path, outputs_root, form):
    from helpers.configs import compose_job

    from litscale.app.checks.validation import validate

    marker, run_dir = tmp_path / "MARKER", tmp_path / "run"
    typed, resolved = _place(form, outputs_root, run_dir, marker)
    cfg, choices = compose_job([f"strategy={FORMS[form]}", "trainer.accelerator=cpu", "trainer.devices=1",
                                f"ckpt_path={typed}"], run_dir)
    refused = outcome(lambda: validate(cfg, choices=choices, this_machine=False))
    assert not marker.exists(), "validation ran what the checkpoint holds"
    shown = repr(typed) if typed == resolved else f"{typed} ({resolved})"
    assert isinstance(refused, ConfigError) and str(refused) == f"ckpt_path={shown} {UNREADABLE}", refused


@pytest.mark.slow  # imports DeepSpeed
@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
@pytest.mark.parametrize("reader", ["read_as_file", "directory_as_file_checkpoint", "deepspeed_as_file_checkpoint",
                                    "why_not_movable", "saved_layout", "saved_state_kinds"])
def test_the_readers_that_move_a_checkpoint_run_nothing_it_holds(tmp_path, reader):
    """The ranks' own reads of a checkpoint of another kind (``checkpoint_moves``,
    ``deepspeed_moves``) are weights-only too: a crafted file is an unpickling error."""
    from litscale.checkpoint import deepspeed as deepspeed_moves
    from litscale.checkpoint import moves as checkpoint_moves

    marker = tmp_path / "MARKER"
    path = {"read_as_file": lambda: crafted_file(tmp_path / "given.ckpt", marker),
            "directory_as_file_checkpoint": lambda: crafted_dcp(tmp_path / "dcp", marker, where="meta.pt"),
            "saved_layout": lambda: crafted_deepspeed(tmp_path / "ds", marker, where="model")}.get(
        reader, lambda: crafted_deepspeed(tmp_path / "ds", marker, where="optimizer"))()
    read = getattr(deepspeed_moves if hasattr(deepspeed_moves, reader) else checkpoint_moves, reader)
    raised = outcome(lambda: read(str(path)))
    assert not marker.exists(), f"{reader} ran what the checkpoint holds"
    assert isinstance(raised, pickle.UnpicklingError), raised


@pytest.mark.slow  # over half a second alone: imports and saves with DCP
@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
def test_dcp_metadata_is_read_without_running_code(tmp_path):
    """DCP's ``.metadata`` is a plain pickle that torch's weights-only unpickler cannot read
    (protocol 5): litscale's restricted one reads DCP's own, and refuses the payload."""
    from litscale.checkpoint.reading import is_readable_checkpoint, read_dcp_metadata

    path = sharded_checkpoint(tmp_path / "dcp", step=4)
    assert list(read_dcp_metadata(str(path)).state_dict_metadata) == ["state_dict.weight"]
    assert is_readable_checkpoint(str(path))
    (path / ".metadata").write_bytes(pickle.dumps(WritesAFile(tmp_path / "MARKER")))
    assert not is_readable_checkpoint(str(path)) and not (tmp_path / "MARKER").exists()


def test_a_deepspeed_checkpoint_without_deepspeed_installed_is_one_line_naming_the_install(tmp_path, monkeypatch):
    from litscale.checkpoint import reading as checkpoint_reading
    from litscale.checkpoint.resume import resolve_ckpt_path

    def missing():
        raise ModuleNotFoundError("No module named 'deepspeed'")

    monkeypatch.setattr(checkpoint_reading, "deepspeed_classes", missing)
    path = str(crafted_deepspeed(tmp_path / "ds", tmp_path / "MARKER", where="none"))
    with pytest.raises(ConfigError) as refused:
        resolve_ckpt_path(path, search_dir=str(tmp_path))
    assert str(refused.value) == (
        f"ckpt_path={path!r} is a DeepSpeed checkpoint, read only with the deepspeed package, which is not "
        "installed; install it with: pip install 'litscale[extras]'")
