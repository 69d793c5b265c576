"""Checkpoint save and load against the disk's own rate, measured in the same run.

GPT-2 small (the zoo's ``gpt`` preset ``small``, 124M parameters) with AdamW's state, after one
optimizer step, on 1, 2 and 4 gloo ranks (CPU; each rank its share of the cores' threads, as a
run gives it), saved and loaded by litscale's strategies as a run does it:

- ``file``: one ``torch.save`` file (``strategy=single`` on 1 rank, ``strategy=ddp`` on more);
- ``dcp``: a ``torch.distributed.checkpoint`` directory of shards (``strategy=fsdp``).

The save is ``Trainer.save_checkpoint`` (the state's collection, the strategy's
``save_checkpoint``: staging, write, atomic publish), timed until every rank returns and then
until its files are on disk (an ``fsync`` of each, nothing left to flush when the save synced
them itself). The load is what a resume runs on every rank: the strategy's ``load_checkpoint``,
``load_model_state_dict`` and ``load_optimizer_state_dict``, from a cold page cache (each file
of the checkpoint synced and dropped with ``posix_fadvise(DONTNEED)`` before it).

The disk's rate, in each repeat beside the checkpoint's: one file of the checkpoint's size
written in 16 MiB blocks and ``fsync``'d, dropped from the page cache the same way, read back;
probed before and after each save and load, the two averaged (the rate of a shared VM's disk
moves by 10x from minute to minute), and each ratio taken within its repeat.
Also per load, summed over the ranks of the host (all of them here), from ``/proc/self/io``:
the bytes read through read calls (``rchar``) and fetched from storage (``read_bytes``),
against the checkpoint's size: a resume should read each byte once per host.

    python experiments/checkpoints/speed.py                  # writes speed.json; about 25 min here
    python experiments/checkpoints/speed.py --ranks 1,2 --kinds file --repeats 3 --preset nano
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
SEQ_LEN = 32  # the step only makes the optimizer's state; the checkpoint's size is the model's
BLOCK = 16 * 2**20  # the disk probe's write and read size
GB = 1e9


def files_of(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]


def size_of(path: str) -> int:
    return sum(os.path.getsize(name) for name in files_of(path))


def sync_and_drop(path: str) -> None:
    """Every file under ``path`` on disk and out of the page cache: DONTNEED drops only clean
    pages, so each is synced first."""
    for name in files_of(path):
        descriptor = os.open(name, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def sync(path: str) -> None:
    for name in files_of(path):
        descriptor = os.open(name, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def disk_rates(directory: str, size: int) -> dict:
    """The disk's sequential write (to ``fsync``) and cold read of one file of ``size`` bytes, in GB/s."""
    probe = os.path.join(directory, "disk-probe")
    block = memoryview(os.urandom(BLOCK))
    started = time.perf_counter()
    descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < size:
            written += os.write(descriptor, block[:min(BLOCK, size - written)])
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    write_s = time.perf_counter() - started
    sync_and_drop(probe)
    into = memoryview(bytearray(BLOCK))
    descriptor = os.open(probe, os.O_RDONLY)
    started = time.perf_counter()
    try:
        while os.readv(descriptor, [into]):
            pass
    finally:
        os.close(descriptor)
    read_s = time.perf_counter() - started
    os.unlink(probe)
    return {"write_gbps": size / write_s / GB, "read_gbps": size / read_s / GB}


def process_io() -> dict[str, int]:
    with open("/proc/self/io") as file:
        return {key: int(value) for key, value in (line.split(": ") for line in file.read().splitlines())}


def _measure_callback(*, directory: str, repeats: int, out: str):
    """A callback that, after the first optimizer step, saves and loads ``repeats`` times."""
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    class Measure(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step != 1:
                return
            strategy, zero = trainer.strategy, trainer.is_global_zero
            path = os.path.join(directory, "last.ckpt")

            def barrier() -> None:
                if dist.is_initialized():
                    dist.barrier()

            def summed(values: list[int]) -> list[int]:
                if not dist.is_initialized():
                    return values
                total = torch.tensor(values, dtype=torch.float64)
                dist.all_reduce(total)
                return [int(v) for v in total.tolist()]

            trainer.save_checkpoint(path)  # the first save: imports, the staging path's first use
            barrier()
            size = size_of(path) if zero else 0
            rows, disk = [], disk_rates(directory, size) if zero else None
            for _ in range(repeats):
                barrier()
                before = process_io()
                started = time.perf_counter()
                trainer.save_checkpoint(path)
                barrier()
                returned = time.perf_counter() - started
                if zero:
                    sync(path)
                barrier()
                durable = time.perf_counter() - started
                after = process_io()
                written = summed([after["wchar"] - before["wchar"], after["write_bytes"] - before["write_bytes"]])
                if zero:
                    sync_and_drop(path)
                barrier()
                before = process_io()
                started = time.perf_counter()
                checkpoint = strategy.load_checkpoint(path)
                strategy.load_model_state_dict(checkpoint, strict=module.strict_loading)
                strategy.load_optimizer_state_dict(checkpoint)
                del checkpoint
                barrier()
                loaded = time.perf_counter() - started
                after = process_io()
                read = summed([after["rchar"] - before["rchar"], after["read_bytes"] - before["read_bytes"]])
                if zero:  # the disk's rate before and after this save and load, averaged
                    before_disk, disk = disk, disk_rates(directory, size)
                    rows.append({"write_gbps": (before_disk["write_gbps"] + disk["write_gbps"]) / 2,
                                 "read_gbps": (before_disk["read_gbps"] + disk["read_gbps"]) / 2,
                                 "disk_probes": [before_disk, disk], "save_returned_s": returned, "save_durable_s": durable, "load_s": loaded,
                                 "written_calls_bytes": written[0], "written_storage_bytes": written[1],
                                 "read_calls_bytes": read[0], "read_storage_bytes": read[1]})
                    print(json.dumps(rows[-1]), flush=True)
            if zero:
                Path(out).write_text(json.dumps({"bytes": size, "repeats": rows}))

    return Measure()


def _rank(local_rank: int, world_size: int, port: int, kind: str, preset: str, repeats: int, directory: str,
          out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # each rank's share, as a run gives it
    import lightning as L

    from litscale.data.synthetic import SyntheticDataModule
    from litscale.models.gpt import build_gpt
    from litscale.modules import CausalLMModule
    from litscale.strategies import DDPStrategy, FSDPStrategy, SingleStrategy

    torch.manual_seed(0)
    net = build_gpt(preset=preset, block_size=SEQ_LEN)
    module = CausalLMModule(net=net, optimizer=partial(torch.optim.AdamW, lr=1e-4), weight_decay=0.1)
    data = SyntheticDataModule(batch_size=1, num_samples=64, val_samples=8, seq_len=SEQ_LEN,
                               vocab_size=net.config.vocab_size)
    strategy = FSDPStrategy() if kind == "dcp" else DDPStrategy() if world_size > 1 else SingleStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[_measure_callback(directory=directory, repeats=repeats, out=out)])
    trainer.fit(module, datamodule=data)


def measure(kind: str, ranks: int, preset: str, repeats: int, root: str) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    directory = tempfile.mkdtemp(prefix=f"litscale-speed-{kind}{ranks}-", dir=root)
    out = os.path.join(directory, "result.json")
    try:
        load_before = os.getloadavg()[0]
        mp.spawn(_rank, args=(ranks, port, kind, preset, repeats, directory, out), nprocs=ranks, join=True)
        return {**json.loads(Path(out).read_text()), "load_average": [load_before, os.getloadavg()[0]]}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def summarize(kind: str, ranks: int, raw: dict) -> dict:
    """Medians over the repeats; each ratio is taken within its repeat (the disk's rate beside
    the save's and load's) and its median reported."""
    median, size = statistics.median, raw["bytes"]
    rows = raw["repeats"]
    saves = [size / row["save_durable_s"] / GB for row in rows]
    loads = [size / row["load_s"] / GB for row in rows]
    return {
        "kind": kind, "ranks": ranks, "checkpoint_gb": round(size / GB, 3),
        "disk_write_gbps": round(median(row["write_gbps"] for row in rows), 3),
        "save_gbps": round(median(saves), 3),
        "save_over_disk_write": round(median(s / row["write_gbps"] for s, row in zip(saves, rows, strict=True)), 2),
        "save_returned_gbps": round(median(size / row["save_returned_s"] / GB for row in rows), 3),
        "disk_read_gbps": round(median(row["read_gbps"] for row in rows), 3),
        "load_gbps": round(median(loads), 3),
        "load_over_disk_read": round(median(s / row["read_gbps"] for s, row in zip(loads, rows, strict=True)), 2),
        "save_written_calls_over_size": round(median(row["written_calls_bytes"] for row in rows) / size, 2),
        "save_written_storage_over_size": round(median(row["written_storage_bytes"] for row in rows) / size, 2),
        "load_read_calls_over_size": round(median(row["read_calls_bytes"] for row in rows) / size, 2),
        "load_read_storage_over_size": round(median(row["read_storage_bytes"] for row in rows) / size, 2),
        "repeats": len(rows), "load_average_before_after": [round(value, 1) for value in raw["load_average"]],
        "raw": rows,
    }


def table(rows: list[dict]) -> str:
    lines = ["| checkpoint | ranks | size (GB) | disk write (GB/s) | save (GB/s) | save / disk | disk read (GB/s) "
             "| load (GB/s) | load / disk | read calls / size | read from storage / size |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['kind']} | {row['ranks']} | {row['checkpoint_gb']:.2f} | {row['disk_write_gbps']:.3f} "
                     f"| {row['save_gbps']:.3f} | **{row['save_over_disk_write']:.2f}** | {row['disk_read_gbps']:.3f} "
                     f"| {row['load_gbps']:.3f} | **{row['load_over_disk_read']:.2f}** "
                     f"| {row['load_read_calls_over_size']:.2f} | {row['load_read_storage_over_size']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--kinds", default="file,dcp")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints and the probe go")
    parser.add_argument("--out", default=str(HERE / "speed.json"))
    args = parser.parse_args()
    rows = []
    for kind in args.kinds.split(","):
        for ranks in map(int, args.ranks.split(",")):
            row = summarize(kind, ranks, measure(kind, ranks, args.preset, args.repeats, args.dir))
            rows.append(row)
            print(json.dumps({key: value for key, value in row.items() if key != "raw"}), flush=True)
    record = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]),
              "torch": torch.__version__, "cores": os.cpu_count(), "kernel": platform.release(),
              "preset": args.preset, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
