"""Peak memory of one context-parallel rank's attention, forward and backward, on CPU: the
masked path context parallel had before (kept here, not in ``src/``) against the chunked one
(``litscale.strategies.context_attention``). See README.md for what is measured and why.

    python experiments/cp_memory/run.py                  # seq_len 8192, CP 2, 3 runs per path
    python experiments/cp_memory/run.py --runs 3 --seq-len 4096
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from litscale.strategies.context_attention import causal_attention_of_chunks
from litscale.strategies.context_parallel import chunks_of, in_sequence_order

HERE = Path(__file__).resolve().parent
PATHS = ("masked", "masked_math", "chunked")


def masked_attention(q, gathered_k, gathered_v, rank, size):
    """Context parallel's attention before the chunked kernels, from the all-gather's output on:
    each query chunk over a copy of the key chunks up to its own, under a boolean mask."""
    chunk = q.shape[2] // 2
    pieces = {}
    for name, gathered in (("k", gathered_k.chunk(2 * size, dim=2)), ("v", gathered_v.chunk(2 * size, dim=2))):
        pieces[name] = [None] * (2 * size)
        for j in range(size):
            for piece, g in zip(gathered[2 * j:2 * j + 2], chunks_of(j, size), strict=True):
                pieces[name][g] = piece
    outputs = []
    for queries, g in zip(q.split(chunk, dim=2), chunks_of(rank, size), strict=True):
        keys = torch.cat(pieces["k"][:g + 1], dim=2)
        values = torch.cat(pieces["v"][:g + 1], dim=2)
        mask = torch.ones(chunk, (g + 1) * chunk, dtype=torch.bool, device=q.device).tril(g * chunk)
        outputs.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True))
    return torch.cat(outputs, dim=2)


def chunked_attention(q, gathered_k, gathered_v, rank, size):
    keys, values = in_sequence_order(gathered_k, size), in_sequence_order(gathered_v, size)
    return causal_attention_of_chunks(q, keys, values, chunks_of(rank, size))


def attend(path, *args):
    if path == "chunked":
        return chunked_attention(*args)
    if path == "masked_math":
        # The kernel CUDA's SDPA is left with for a boolean mask with enable_gqa (flash takes no
        # mask, efficient no GQA), run on CPU to see what it holds.
        with sdpa_kernel(SDPBackend.MATH):
            return masked_attention(*args)
    return masked_attention(*args)


def peak_of(prof) -> int:
    """Highest sum of torch's CPU allocations less frees, in time order, above the start."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_once(path: str, seq_len: int, batch: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """One measurement, meant for a fresh process: rank 0 of CP 2's queries (chunks 0 and 3),
    the gathered keys and values as leaves (what the all-gather hands over), forward+backward."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    size, rank = 2, 0
    q = torch.randn(batch, heads, seq_len // size, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, requires_grad=True) for _ in range(2))
    grad_out = torch.randn_like(q)
    resident_before = resident_bytes()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        attend(path, q, k, v, rank, size).backward(grad_out)
    seconds = time.perf_counter() - start
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"path": path, "profiler_peak_bytes": peak_of(prof),
            "resident_growth_bytes": high_water - resident_before, "seconds": seconds}


def _measure_in_child(connection, path: str, shape: dict) -> None:
    connection.send(measure_once(path, **shape))
    connection.close()


def measure_in_fresh_process(path: str, shape: dict) -> dict:
    """``measure_once`` in a forked child: its own allocations and resident high-water mark
    (Linux starts a child's at its resident size at the fork), without importing torch and
    litscale again for every measurement."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_measure_in_child, args=(sender, path, shape))
    child.start()
    record = receiver.recv()
    child.join()
    return record


def run_all(args) -> dict:
    shape = {"seq_len": args.seq_len, "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads,
             "head_dim": args.head_dim}
    records = []
    for run in range(args.runs):
        for path in PATHS:  # interleaved, so that a busy spell on the machine hits every path
            records.append(measure_in_fresh_process(path, shape))
            print(f"run {run + 1}/{args.runs} {path}: {records[-1]}", flush=True)
    medians = {path: {key: statistics.median(r[key] for r in records if r["path"] == path)
                      for key in ("profiler_peak_bytes", "resident_growth_bytes", "seconds")}
               for path in PATHS}
    return {"shape": shape, "runs": args.runs, "torch": torch.__version__, "records": records, "medians": medians}


def report(results: dict) -> None:
    medians = results["medians"]
    new = medians["chunked"]
    print("| path | profiler peak (MiB) | resident growth (MiB) | seconds | profiler peak / chunked |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for path in PATHS:
        m = medians[path]
        print(f"| {path} | {m['profiler_peak_bytes'] / 2**20:.1f} | {m['resident_growth_bytes'] / 2**20:.1f} "
              f"| {m['seconds']:.2f} | {m['profiler_peak_bytes'] / new['profiler_peak_bytes']:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    results = run_all(args)
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report(results)


if __name__ == "__main__":
    main()
