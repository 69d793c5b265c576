"""Lightning callbacks: throughput and the run summary."""

from litscale.callbacks.throughput import ThroughputCallback

__all__ = ["ThroughputCallback"]
