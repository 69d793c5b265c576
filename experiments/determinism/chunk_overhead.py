"""The compute side of the layout-invariant step, timed in one process: one forward and
backward of GPT-nano on the global batch, against one per chunk with the chunk gradients
summed in the pairwise tree. Alternates the two (A, B, A, B, ...) so that a machine's load
drifting over the minute weighs on both alike; prints the medians and their ratio.

    python experiments/determinism/chunk_overhead.py [--chunks 8] [--batch 16] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from litscale.models.gpt import build_gpt
from litscale.reliability.determinism import _Subtree

SEQ, VOCAB = 32, 256


def whole(net, tokens, targets) -> None:
    loss = F.cross_entropy(net(tokens).flatten(0, 1), targets.flatten())
    torch.autograd.grad(loss, list(net.parameters()))


def chunked(net, tokens, targets, chunks: int) -> None:
    subtree, size = _Subtree(), tokens.shape[0] // chunks
    for index in range(chunks):
        rows = slice(index * size, (index + 1) * size)
        loss = F.cross_entropy(net(tokens[rows]).flatten(0, 1), targets[rows].flatten())
        subtree.add(list(torch.autograd.grad(loss, list(net.parameters()))))
    subtree.total()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_gpt(preset="nano", vocab_size=VOCAB, block_size=SEQ)
    tokens = torch.randint(0, VOCAB, (args.batch, SEQ + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    times = {"whole": [], "chunked": []}
    for rep in range(args.reps + 2):  # the first two of each: warm-up, not counted
        for name, step in (
            ("whole", lambda: whole(net, x, y)),
            ("chunked", lambda: chunked(net, x, y, args.chunks)),
        ):
            started = time.perf_counter()
            step()
            if rep >= 2:
                times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        json.dumps(
            {
                "batch": args.batch,
                "chunks": args.chunks,
                "threads": 1,
                "median_s": medians,
                "ratio": medians["chunked"] / medians["whole"],
            }
        )
    )


if __name__ == "__main__":
    main()
