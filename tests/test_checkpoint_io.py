"""How a checkpoint's bytes reach the disk and come back (``litscale.checkpoint.file_io``, the publish
of ``litscale.checkpoint.atomic``): a file save is written once, at its staging path, and every
save's files are on disk before it is published; the ranks of one host resuming from a file
read its bytes from storage once between them, and keep nothing mapped from it.

The references are the tensors handed to the save and the file's own size, never a figure of
the code under test.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from helpers.distributed import one_rank_group

MIB = 2**20


def lightning_checkpoint(version: float) -> dict:
    """What Lightning hands a strategy's ``save_checkpoint``: 12 MiB of weights, 8 of optimizer state."""
    weights = {f"net.w{i}": torch.full((512, 1024), version + i) for i in range(6)}
    moments = {i: {"exp_avg": torch.full((512, 1024), -version - i), "step": torch.tensor(float(i))}
               for i in range(4)}
    return {"state_dict": weights, "optimizer_states": [{"state": moments, "param_groups": [{"lr": 0.1}]}],
            "global_step": int(version), "loops": {}}


def record_syncs_and_renames(monkeypatch) -> list[tuple[str, str]]:
    """Every ``fsync`` (by the path its descriptor opens) and every rename, in order."""
    events: list[tuple[str, str]] = []
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def synced(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        return fsync(descriptor)

    def renamed(move):
        def moved(source, destination, *args, **kwargs):
            events.append(("rename", os.fspath(destination)))
            return move(source, destination, *args, **kwargs)
        return moved

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "rename", renamed(rename))
    monkeypatch.setattr(os, "replace", renamed(replace))
    return events


def strategy_and_group(kind: str):
    if kind == "file":
        from contextlib import nullcontext

        from litscale.strategies.single import SingleStrategy

        return SingleStrategy(), nullcontext()
    from litscale.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy()
    strategy.parallel_devices = [torch.device("cpu")]  # the trainer sets it
    return strategy, one_rank_group()  # DCP's save is collective


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_save_is_written_once_at_its_staging_path_and_on_disk_before_it_is_published(tmp_path, monkeypatch,
                                                                                        kind):
    """A file save is written at its staging path (Lightning's own save wrote a temporary file
    in the system's temporary directory and moved it there: a second write of every byte where
    that is another file system), and every file of a save, a file's or a DCP
    directory's ``meta.pt`` (neither ``torch.save`` nor Lightning syncs), is flushed to disk
    before the rename that publishes it: the rename is synced, so a power cut after it must
    find the bytes it names."""
    from litscale.checkpoint.atomic import staging_path

    path = str(tmp_path / "checkpoints" / "last.ckpt")
    os.makedirs(os.path.dirname(path))
    strategy, group = strategy_and_group(kind)
    with group:
        events = record_syncs_and_renames(monkeypatch)
        strategy.save_checkpoint(lightning_checkpoint(1.0), path)
        monkeypatch.undo()
    staging = staging_path(path)
    published = events.index(("rename", path))
    files = ["."] if os.path.isfile(path) else [
        os.path.relpath(os.path.join(root, name), path) for root, _, names in os.walk(path) for name in names]
    synced = {os.path.relpath(target, staging) for event, target in events[:published] if event == "fsync"}
    assert set(files) <= synced, (files, events)
    if kind == "file":  # written where it is published from, not moved there
        assert [event for event in events if event[0] == "rename"] == [("rename", path)], events
        assert torch.load(path, weights_only=True)["state_dict"]["net.w5"][0, 0] == 6.0


def process_io() -> dict[str, int]:
    with open("/proc/self/io") as file:
        return {key: int(value) for key, value in (line.split(": ") for line in file.read().splitlines())}


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """The address ranges of this process that map the file at ``path``."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == path:
                start, end = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def drop_from_page_cache(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts the reads in /proc/self/io (Linux)")
@pytest.mark.slow  # over half a second alone
def test_the_ranks_of_a_host_resuming_from_a_file_read_it_once_and_keep_nothing_mapped(tmp_path):
    """Two ranks of one host load a DDP checkpoint file as a resume does (the strategy's
    ``load_checkpoint``, one after the other in this process): between them they read its bytes
    once, from storage (within what else the process reads meanwhile), and none through read calls (Lightning's load read the whole file
    through read calls on every rank: twice its size here). What the load returns holds the
    saved values; only the module's weights, which the strategy copies into the parameters,
    still view the file, and once they are dropped nothing maps it."""
    from litscale.strategies.ddp import DDPStrategy

    saved = lightning_checkpoint(3.0)
    path = str(tmp_path / "last.ckpt")
    torch.save(saved, path)
    size = os.path.getsize(path)
    drop_from_page_cache(path)
    strategy, before, loads = DDPStrategy(), process_io(), []
    for _rank in range(2):
        loads.append(strategy.load_checkpoint(path))
    after = process_io()
    read_calls, from_storage = after["rchar"] - before["rchar"], after["read_bytes"] - before["read_bytes"]
    assert read_calls < 0.1 * size, f"{read_calls / MIB:.1f} MiB read through read calls from a {size / MIB:.1f} MiB file"
    assert from_storage < 1.5 * size, f"{from_storage / MIB:.1f} MiB read from storage for a {size / MIB:.1f} MiB file"
    mapped = mapped_ranges(os.path.realpath(path))
    assert mapped  # the weights, until the strategy has copied them into the parameters

    def in_the_file(tensor: torch.Tensor) -> bool:
        return any(start <= tensor.data_ptr() < end for start, end in mapped)

    for loaded in loads:
        assert all(torch.equal(loaded["state_dict"][name], tensor) for name, tensor in saved["state_dict"].items())
        moments = loaded["optimizer_states"][0]["state"]
        for index, state in saved["optimizer_states"][0]["state"].items():
            assert all(torch.equal(moments[index][key], value) and not in_the_file(moments[index][key])
                       for key, value in state.items())
    del loads, loaded, moments
    gc.collect()
    assert not mapped_ranges(os.path.realpath(path))
