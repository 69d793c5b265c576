"""A checkpoint is complete or invisible on an object-store mount too (``checkpoint.publish``,
``litscale.checkpoint.atomic``).

The mount is played by ``ObjectStoreMount``: a file's rename is one object's copy (whole or not
at all), a directory's rename copies its files one by one and then deletes them, and the
machine is preempted before any one of those operations. A sharded (DCP) ``last.ckpt`` is saved
as version 1, then as version 2 with a preemption at every point of the second save in turn;
after each, what ``ckpt_path=auto`` resumes must load whole, as version 1 or 2 in every tensor.
The reference is the tensors each version was saved with, filled with its number.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.distributed import one_rank_group

from litscale.checkpoint import atomic as atomic_checkpoint
from litscale.checkpoint.resume import is_complete_checkpoint, resolve_ckpt_path

TENSORS, SHAPE = 3, (64, 64)


class Preempted(BaseException):
    """The machine went away (nothing after it runs, as after a SIGKILL)."""


class ObjectStoreMount:
    """A bucket under ``root`` as gcsfuse, s3fs, goofys or rclone show it to a process: a
    directory's rename is a copy of its files then their deletion, the small files first (a
    parallel copy: DCP's ``.metadata`` and Lightning's ``meta.pt`` land before the shards);
    ``renameat2``'s exchange is refused. Counts the operations a save makes from the first
    ``os.rename``/``os.replace``/``os.unlink``/``os.rmdir`` on, and raises ``Preempted`` before
    the ``preempt_at``-th."""

    def __init__(self, root, monkeypatch, preempt_at: int | None = None) -> None:
        self.root, self.preempt_at, self.operations, self.preempted = str(root), preempt_at, 0, False
        self.real = {name: getattr(os, name) for name in ("rename", "replace", "unlink", "rmdir")}
        for name in ("rename", "replace"):
            monkeypatch.setattr(os, name, self._rename)
        for name in ("unlink", "rmdir"):
            monkeypatch.setattr(os, name, lambda *args, _name=name, **kwargs: self._operation(_name, *args, **kwargs))
        monkeypatch.setattr(os, "remove", os.unlink)
        monkeypatch.setattr(atomic_checkpoint, "_exchange", lambda first, second: False)

    def _step(self) -> None:
        if self.operations == self.preempt_at:
            self.preempted = True
            raise Preempted
        self.operations += 1

    def _operation(self, name: str, *args, **kwargs):
        self._step()
        return self.real[name](*args, **kwargs)

    def _rename(self, source, destination, **kwargs):
        source, destination = os.fspath(source), os.fspath(destination)
        if not (os.path.isdir(source) and source.startswith(self.root)):
            return self._operation("replace", source, destination, **kwargs)  # one object: atomic
        if os.path.exists(destination) and os.listdir(destination):
            raise OSError(39, "Directory not empty", destination)
        files = sorted(os.listdir(source), key=lambda name: os.path.getsize(os.path.join(source, name)))
        os.makedirs(destination, exist_ok=True)
        for name in files:
            self._step()
            shutil.copy2(os.path.join(source, name), os.path.join(destination, name))  # keeps mtimes, as gcsfuse
        for name in files:
            os.unlink(os.path.join(source, name))
        os.rmdir(source)
        return None


@pytest.fixture
def one_rank():
    with one_rank_group():  # FSDP's DCP saves are collective
        yield


def checkpoint(version: int) -> dict:
    weights = {f"net.w{i}": torch.full(SHAPE, float(version)) for i in range(TENSORS)}
    return {"state_dict": weights, "optimizer_states": [], "version": version}


def save(path, version: int, *, publish: str) -> None:
    """A synchronous save through litscale's FSDP strategy (a DCP directory), as a run makes it."""
    from litscale.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy()
    strategy.checkpoint_publish = publish  # the run sets it from checkpoint.publish
    strategy.save_checkpoint(checkpoint(version), str(path))


def resumed_version(run) -> int | str:
    """The version ``ckpt_path=auto`` resumes from, checked in every tensor, or what is wrong."""
    found = resolve_ckpt_path("auto", search_dir=str(run))
    if found is None:
        return "nothing to resume"
    version = torch.load(os.path.join(found, "meta.pt"), weights_only=True)["version"]
    weights = {f"net.w{i}": torch.zeros(SHAPE) for i in range(TENSORS)}
    try:
        dcp.load({"state_dict": weights}, checkpoint_id=found, no_dist=True)
    except BaseException as error:  # noqa: BLE001 - DCP raises its CheckpointException, a BaseException
        return f"{os.path.basename(found)} does not load: {type(error).__name__}"
    if any(not torch.equal(tensor, torch.full(SHAPE, float(version))) for tensor in weights.values()):
        return f"{os.path.basename(found)} is torn"
    return version


def preempted_saves(tmp_path, monkeypatch, *, publish: str, mounts) -> dict[int, int | str]:
    """Version 2 saved over version 1 on the mount, preempted before each operation in turn:
    what ``ckpt_path=auto`` resumes after each, by the operation it was preempted at."""
    monkeypatch.setattr(atomic_checkpoint, "MOUNTS", str(mounts), raising=False)
    outcomes: dict[int, int | str] = {}
    point = 0
    while True:
        run = tmp_path / "bucket" / f"preempted{point}"
        last = run / "checkpoints" / "last.ckpt"
        last.parent.mkdir(parents=True)
        save(last, 1, publish=publish)
        with monkeypatch.context() as patches:
            mount = ObjectStoreMount(tmp_path / "bucket", patches, preempt_at=point)
            try:
                save(last, 2, publish=publish)
            except BaseException:  # DCP hands a preemption in its own save on as its CheckpointException
                if not mount.preempted:
                    raise
            else:
                break  # no operation left to be preempted at
        outcomes[point] = resumed_version(run)
        assert mount.operations == point
        point += 1
    outcomes[point] = resumed_version(run)  # the save that ran to its end
    return outcomes


@pytest.fixture
def bucket_mounts(tmp_path):
    """A /proc/mounts that lists ``tmp_path/bucket`` as a gcsfuse mount."""
    (tmp_path / "bucket").mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw,relatime 0 0\nlitscale-outputs {tmp_path / 'bucket'} fuse.gcsfuse "
                      "rw,nosuid,nodev,relatime,user_id=0,group_id=0 0 0\n")
    return mounts


def test_on_an_object_store_mount_a_resume_word_never_picks_a_half_published_directory(
        tmp_path, monkeypatch, one_rank, bucket_mounts):
    """``checkpoint.publish=auto`` (the default) sees the mount and publishes by a pointer."""
    outcomes = preempted_saves(tmp_path, monkeypatch, publish="auto", mounts=bucket_mounts)
    print(f"pointer: resumed version by the operation preempted at: {outcomes}")
    assert set(outcomes.values()) <= {1, 2}, outcomes
    assert outcomes[0] == 1 and outcomes[max(outcomes)] == 2, outcomes
    # After the last save, last.ckpt is a pointer to the one save left; the replaced one is gone.
    checkpoints = tmp_path / "bucket" / f"preempted{max(outcomes)}" / "checkpoints"
    saved = atomic_checkpoint.pointer_target(str(checkpoints / "last.ckpt"))
    assert saved is not None and is_complete_checkpoint(str(checkpoints / "last.ckpt"))
    assert sorted(os.listdir(checkpoints)) == sorted(["last.ckpt", os.path.basename(saved)])


@pytest.mark.slow  # over half a second alone
def test_a_rename_there_leaves_a_half_copied_directory_that_a_resume_word_picks(
        tmp_path, monkeypatch, one_rank, bucket_mounts):
    """Why the mount needs the pointer, and the proof that the mount played here can catch a
    publish that is not atomic (else the test above would pass whatever it published by):
    ``checkpoint.publish=rename`` copies ``last.ckpt/`` file by file, and a preemption between a
    small file and a shard leaves a directory the completeness checks take for whole (its
    markers are there, and only a shard is missing)."""
    outcomes = preempted_saves(tmp_path, monkeypatch, publish="rename", mounts=bucket_mounts)
    print(f"rename: resumed version by the operation preempted at: {outcomes}")
    assert any(outcome not in (1, 2) for outcome in outcomes.values()), outcomes


def test_auto_points_on_a_fuse_mount_and_renames_elsewhere(tmp_path, monkeypatch, bucket_mounts):
    monkeypatch.setattr(atomic_checkpoint, "MOUNTS", str(bucket_mounts))
    on_bucket, on_disk = str(tmp_path / "bucket" / "run" / "checkpoints" / "last.ckpt"), "/home/x/last.ckpt"
    assert atomic_checkpoint.mount_type(os.path.dirname(on_bucket)) == "fuse.gcsfuse"
    assert atomic_checkpoint.publishes_by_pointer(on_bucket, "auto")
    assert not atomic_checkpoint.publishes_by_pointer(on_disk, "auto")
    assert atomic_checkpoint.publishes_by_pointer(on_disk, "pointer")
    assert not atomic_checkpoint.publishes_by_pointer(on_bucket, "rename")


def test_a_pointer_names_only_a_save_beside_it(tmp_path):
    """A crafted pointer cannot send a resume elsewhere: it is not a pointer at all."""
    pointer = tmp_path / "last.ckpt"
    for name in ("../elsewhere.saved", "/etc/x.saved", "visible.saved", ".x.ckpt.old"):
        pointer.write_text(f"{atomic_checkpoint.POINTER_HEADER}\n{name}\n")
        assert atomic_checkpoint.pointer_target(str(pointer)) is None, name
    pointer.write_text(f"{atomic_checkpoint.POINTER_HEADER}\n.last.ckpt.0a1b.saved\n")
    assert atomic_checkpoint.pointer_target(str(pointer)) == str(tmp_path / ".last.ckpt.0a1b.saved")


def test_a_pointer_typed_as_ckpt_path_resumes_the_save_it_names(tmp_path, monkeypatch, one_rank, bucket_mounts):
    """``ckpt_path=<run>/checkpoints/last.ckpt`` typed by hand, where last.ckpt is a pointer."""
    from litscale.checkpoint.resume import resolve_ckpt_path

    monkeypatch.setattr(atomic_checkpoint, "MOUNTS", str(bucket_mounts), raising=False)
    last = tmp_path / "bucket" / "run" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    save(last, 1, publish="auto")
    saved = atomic_checkpoint.pointer_target(str(last))
    assert saved is not None
    assert resolve_ckpt_path(str(last), search_dir=str(tmp_path)) == saved
