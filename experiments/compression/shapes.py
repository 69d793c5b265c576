"""Bytes each hook sends for one step of a GPT preset's gradients, without training.

The hooks run for real (a 1-rank gloo group, so collectives complete) on random gradients
laid out in DDP-like buckets (reverse parameter order, 25 MB each); what they count is what
they handed to collectives. ``python -c "import shapes; shapes.main('small')"`` prints JSON.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from litscale import compression
from litscale.models.gpt import build_gpt

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class Bucket:
    """The parts of ``dist.GradBucket`` the hooks use, over views of one flat buffer."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], last: bool) -> None:
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.randn(sum(p.numel() for p in params)) * 1e-3
        self._grads = [g.view_as(p) for g, p in zip(
            self._buffer.split([p.numel() for p in params]), params, strict=True)]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def buckets(net: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    groups, current, size = [], [], 0
    for param in reversed(list(net.parameters())):
        if current and size + param.numel() * 4 > BUCKET_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel() * 4
    return [*groups, current]


HOOKS = {
    "fp16": compression.fp16,
    "powersgd rank 4": lambda: compression.powersgd(rank=4, start_iteration=2),
    "topk 1% + EF": lambda: compression.topk(ratio=0.01),
    "qsgd 7 levels": compression.qsgd,
    "terngrad": compression.terngrad,
    "signsgd + EF": compression.signsgd,
}


def measure(net: torch.nn.Module, name: str) -> dict:
    hook = HOOKS[name]()
    hook.state.bind(net)
    groups = buckets(net)
    for _ in range(3 if name.startswith("powersgd") else 1):  # PowerSGD: dense for 2 steps
        before_sent, before_dense = hook.state.bytes_sent, hook.state.dense_bytes
        for index, params in enumerate(groups):
            hook.hook(hook.state, Bucket(index, params, last=index == len(groups) - 1)).wait()
    return {"method": name, "dense": hook.state.dense_bytes - before_dense,
            "sent": hook.state.bytes_sent - before_sent}


def main(preset: str) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    net = build_gpt(preset=preset)
    print(json.dumps([measure(net, name) for name in HOOKS]))
    dist.destroy_process_group()
