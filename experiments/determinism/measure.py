"""The cost of determinism=layout_invariant against the normal mode: step time and peak memory
(the largest process's RSS) from short train.py runs, and gradient bytes on the wire per step per rank.

    python experiments/determinism/measure.py            # writes results.json beside it

Each cell is one run of GPT-nano (0.86M parameters) on 2 CPU ranks, global batch 16,
sequence 32, 30 steps (steady state from step 10); step time is the run's own steady-state perf/step_time_s. Bytes are
counted from the algorithms: DDP's ring all-reduce sends 2 (W-1)/W x gradient bytes per rank;
the layout-invariant step all-gathers every rank's subtree sum, (W-1)/W x W x gradient bytes
(ring all-gather), plus one loss value; FSDP's reduce-scatter sends (W-1)/W x gradient bytes,
and the layout-invariant step adds the all-gather of the weights into the replica.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BASE = [
    "trainer.accelerator=cpu",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "trainer.max_steps=30",
    "trainer.val_check_interval=1000",
    "trainer.enable_progress_bar=false",
    "callbacks.watchdog.timeout_s=600",
]
PEAK_RSS = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)
CELLS = [  # (strategy, devices, micro batch)
    ("ddp", 2, 8),
    ("fsdp", 2, 8),
]


def run(strategy: str, devices: int, micro: int, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            str(REPO / "train.py"),
            f"strategy={strategy}",
            f"trainer.devices={devices}",
            f"data.batch_size={micro}",
            f"determinism={mode}",
            f"hydra.run.dir={out}",
            *BASE,
        ]
        # a wrapper process per run: its children's peak RSS is this run's largest process
        wrapper = [sys.executable, "-c", PEAK_RSS, *command]
        done = subprocess.run(wrapper, cwd=REPO, check=True, capture_output=True, text=True)
        peak_kib = int(done.stdout.strip().splitlines()[-1])
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {
        "strategy": strategy,
        "devices": devices,
        "mode": mode,
        "step_time_s": summary["perf/step_time_s"],
        "gradient_bytes": summary["memory/estimate_grads_bytes"],
        "peak_rss_mib": peak_kib / 1024,
    }


def wire_bytes(strategy: str, devices: int, mode: str, gradient_bytes: float) -> float:
    """Bytes each rank sends per step for its gradients (and, layout-invariant, the weights)."""
    w = devices
    if w == 1:
        return 0.0
    if mode == "layout_invariant":
        sent = (w - 1) * gradient_bytes  # ring all-gather of w gradient-sized subtree sums
        return sent + (
            (w - 1) / w * gradient_bytes if strategy == "fsdp" else 0.0
        )  # + weights gathered
    return (2 if strategy == "ddp" else 1) * (w - 1) / w * gradient_bytes


REPEATS = 3  # each cell's two modes alternated, medians reported (a shared machine is noisy)


def main() -> None:
    import statistics

    results = []
    for strategy, devices, micro in CELLS:
        runs: dict[str, list[dict]] = {"none": [], "layout_invariant": []}
        for _ in range(REPEATS):
            for mode in runs:
                runs[mode].append(run(strategy, devices, micro, mode))
        for mode, cells in runs.items():
            cell = {**cells[0],
                    "step_time_s": statistics.median(c["step_time_s"] for c in cells),
                    "step_times_s": [c["step_time_s"] for c in cells],
                    "peak_rss_mib": statistics.median(c["peak_rss_mib"] for c in cells)}
            # the whole gradient's bytes (FSDP's estimate is one rank's shard of it)
            whole = cell["gradient_bytes"] * (devices if strategy == "fsdp" else 1)
            cell["wire_bytes_per_step"] = wire_bytes(strategy, devices, mode, whole)
            results.append(cell)
            print(json.dumps(cell), flush=True)
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
