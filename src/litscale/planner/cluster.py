"""The machines a plan runs on: devices, memory, peak FLOP/s and the links between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from litscale.constraints import Fraction, NonNegativeFloat, PositiveFloat, PositiveInt


@dataclass(frozen=True, kw_only=True)
class Link:
    """Alpha-beta figures of one kind of link: a message of ``n`` bytes takes
    ``latency_s + n / bandwidth_bytes_s``."""

    bandwidth_bytes_s: PositiveFloat
    latency_s: NonNegativeFloat
    # A collective's own figures where they were measured apart (``calibrate.py`` on this
    # machine), by kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send".
    # Gloo's collectives cost more per call than the ring's bytes and latencies say, and not
    # alike: at 2 CPU ranks a reduce-scatter takes about twice an all-gather of the same bytes.
    collectives: dict[str, Link] = field(default_factory=dict)

    def seconds(self, nbytes: float, messages: int = 1, kind: str | None = None) -> float:
        link = self.collectives.get(kind, self)
        return messages * link.latency_s + nbytes / link.bandwidth_bytes_s


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices of ``device_memory_bytes`` each.

    ``peak_flops`` by compute dtype (``float32``, ``bfloat16``; ``float8``: precision=fp8's float8
    layers, where the device has them); ``achieved_fraction`` is the share of it a model's matmuls
    reach (calibrated: measured step FLOPs / peak); the allocator keeps ``allocator_overhead``
    more than the tensors it holds."""

    name: str
    nodes: PositiveInt
    devices_per_node: PositiveInt
    device_memory_bytes: PositiveFloat
    peak_flops: dict[str, PositiveFloat]
    intra_node: Link
    inter_node: Link
    achieved_fraction: Fraction = 0.5
    allocator_overhead: NonNegativeFloat = 0.1
    overlap: Fraction = 0.5  # share of backward compute that gradient communication can hide behind
    # Time of one forward-backward that does not shrink with the batch (framework and kernel
    # launch costs): what makes many small micro-batches slower than few large ones.
    overhead_per_microbatch_s: NonNegativeFloat = 0.0
    # The optimizer step's time per parameter a rank updates (memory-bound: it reads and writes
    # each parameter, its gradient and its two moments): what sharding the optimizer saves.
    optimizer_s_per_param: NonNegativeFloat = 0.0
    # How much slower a rank computes while the node's other ranks compute too (CPU cores share
    # caches and memory bandwidth; 1: a GPU's own memory).
    contention: float = 1.0
    # One device's memory bandwidth and the share of it a memory-bound kernel reaches: what
    # precision=fp8's casts cost (``float8_cost``); 0: not costed (on CPU nothing runs in float8).
    memory_bandwidth_bytes_s: NonNegativeFloat = 0.0
    memory_bandwidth_fraction: Fraction = 0.92
    # The routed experts' grouped matmuls, as a published benchmark of the kernel measured them on
    # this device: [forward FLOPs of one expert's matmuls in one call, share of the compute dtype's
    # peak reached], the experts' FLOPs then run at the share interpolated by their size instead of
    # ``achieved_fraction`` (``moe_cost.grouped_fraction``); empty: at ``achieved_fraction``.
    grouped_matmul_fractions: list[list[float]] = field(default_factory=list)
    # True for the machine the planner runs on: a plan's forward-backward is then timed here
    # (litscale.planner.model_facts.with_profile) instead of predicted from FLOPs.
    is_this_machine: bool = False
    source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def link_for(self, group_size: int, stride: int) -> Link:
        """The slowest link a group of ``group_size`` ranks, ``stride`` apart, crosses: within a
        node when the whole group fits in one."""
        return self.intra_node if group_size * stride <= self.devices_per_node else self.inter_node

    def flops(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["float32"]) * self.achieved_fraction
