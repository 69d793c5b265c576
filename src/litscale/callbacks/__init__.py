"""Lightning callbacks, one concern each: throughput and MFU (``throughput``), memory, the
bytes on the wire (``communication``), MoE routing (``moe``), numerics, float8, profiling,
stragglers, the hang watchdog, RNG state and preemption saves for exact resume, injected
faults for the tests, and Optuna pruning. What they measure goes to the run's summary."""

from litscale.callbacks.throughput import ThroughputCallback

__all__ = ["ThroughputCallback"]
