"""What a lost worker costs: replica groups (``fault_tolerance=replicas``) against restarting the
whole job from its checkpoint (``torchrun --max-restarts``), on the same fault.

Both jobs train GPT-nano on the same global batch of 24 (3 x 8) for 120 steps on CPU, and one
rank is SIGKILLed at the start of step 30 (at 60 steps, the lost group's restart, 12-50 s on 2
shared cores, outlasted the others' remaining 30 steps):

- **replica groups**: 3 groups of 1 rank (``strategy=single``); group 2 is killed, its agent
  starts it again, it rejoins from a live group's state while groups 0 and 1 train on;
- **restart**: ``torchrun --nproc-per-node=3 --max-restarts=1`` of ``strategy=ddp`` with a
  validation and checkpoint every ``--every`` steps and ``ckpt_path=here`` (its run dir's newest); rank 2 is killed, torchrun stops
  the others and starts all three again, and they resume from the last checkpoint.

Each is also run without the fault; the table gives, for each: wall seconds, the seconds the
fault added, the steps trained again (restart) or dropped and taken with fewer groups (replica
groups), the longest pause of a rank that was not killed, and the final validation loss
against one process with the whole global batch (the replica-group run's steps with 2 of 3
groups use a smaller batch, so its loss differs; the stated tolerance: 3%, which
``tests/test_fault_tolerance.py`` uses).

    python experiments/reliability/replica_loss.py            # about 15 min on 2 cores

Results: ``replica_loss.json`` and the table in ``README.md`` here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOLERANCE = 0.03  # of the final validation loss, replica groups with a fault vs one process
COMMON = ["trainer.accelerator=cpu", "data.batch_size=8", "data.seq_len=32", "data.max_bytes=400000",
          "trainer.max_steps=120", "trainer.val_check_interval=120", "trainer.limit_val_batches=2",
          "trainer.enable_progress_bar=false", "logger=csv"]
FAULT = ["+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.at_step=30",
         "+callbacks.fault.kind=sigkill"]


def run(command: list[str], outputs: Path, env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    print(f"running: {outputs.name} ...", end="", flush=True)  # each job takes 1-5 minutes
    started = time.monotonic()
    process = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800,
                             env={**os.environ, "LITSCALE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1",
                                  **(env or {})})
    if process.returncode != 0:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n{process.stdout[-1500:]}{process.stderr[-1500:]}")
    print(f" {time.monotonic() - started:.0f} s", flush=True)
    return time.monotonic() - started, process


def job_summary(outputs: Path) -> dict:
    (path,) = [p for p in outputs.glob("**/summary.json") if "replicas" not in p.parts]
    return json.loads(path.read_text())


def replica_groups(outputs: Path, fault: bool) -> dict:
    # Each group validates alone: 6 batches of 8 are the 48 samples one process takes in 2 of 24.
    seconds, process = run([sys.executable, "train.py", "fault_tolerance=replicas", "strategy=single",
                            "trainer.devices=1", "launcher.oversubscribe=true",
                            *[o for o in COMMON if not o.startswith("trainer.limit_val_batches")],
                            "trainer.limit_val_batches=6", *(FAULT + ["+callbacks.fault.replica_group=2"] if fault else [])],
                           outputs)
    summary = job_summary(outputs)
    cost = summary["fault_tolerance"]
    return {"seconds": seconds, "val_loss": summary["val/loss"], "steps_retrained": 0,
            "steps_dropped": cost["steps_dropped"], "steps_with_fewer_groups": cost["steps_with_fewer_groups"],
            "longest_pause_s": cost["longest_pause_s"], "rejoined_at_step": cost["rejoined_at_step"],
            "seconds_to_rejoin": cost["seconds_to_rejoin"],
            "finished_groups": cost["finished"]}


def restart(outputs: Path, fault: bool, every: int) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
               "--max-restarts=1", "--monitor-interval=0.5", "train.py", "strategy=ddp", "trainer.devices=3",
               "launcher.oversubscribe=true",
               *[o for o in COMMON if not o.startswith("trainer.val_check_interval")], "ckpt_path=here",
               f"trainer.val_check_interval={every}",  # a checkpoint at each validation
               *(FAULT + ["+callbacks.fault.rank=2"] if fault else []), "hydra.run.dir=" + str(outputs / "run")]
    seconds, process = run(command, outputs, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    restored = re.findall(r"Restored all states from the checkpoint at \S+?step=(\d+)", process.stdout + process.stderr)
    resumed_at = int(restored[0]) if restored else (30 // every * every if fault else None)
    return {"seconds": seconds, "val_loss": job_summary(outputs)["val/loss"],
            "steps_retrained": (30 - resumed_at) if fault else 0, "steps_dropped": 0, "steps_with_fewer_groups": 0,
            "longest_pause_s": None, "resumed_at_step": resumed_at}


def one_process(outputs: Path) -> float:
    _, _ = run([sys.executable, "train.py", "strategy=single", "trainer.devices=1",
                *[o for o in COMMON if not o.startswith("data.batch_size")], "data.batch_size=24"], outputs)
    return job_summary(outputs)["val/loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps (the restart job)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        reference = one_process(root / "one")
        rows = {"replica groups, no fault": replica_groups(root / "rg_clean", False),
                "replica groups, group 2 killed at step 30": replica_groups(root / "rg_fault", True),
                f"restart (checkpoint every {args.every}), no fault": restart(root / "rs_clean", False, args.every),
                f"restart (checkpoint every {args.every}), rank 2 killed at step 30": restart(root / "rs_fault", True,
                                                                                           args.every)}
    for name, row in rows.items():
        clean = rows[name.replace("group 2 killed at step 30", "no fault").replace("rank 2 killed at step 30", "no fault")]
        row["seconds_added"] = row["seconds"] - clean["seconds"]
        row["val_loss_vs_one_process"] = row["val_loss"] / reference - 1
    record = {"machine": f"{os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}, "
                         f"torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d"), "command": "python experiments/reliability/replica_loss.py "
                                                            f"--every {args.every}",
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "one_process_val_loss": reference, "tolerance": TOLERANCE, "rows": rows}
    (HERE / "replica_loss.json").write_text(json.dumps(record, indent=1) + "\n")
    write_readme(table(record))
    print(table(record))


def write_readme(text: str) -> None:
    """The table between this script's markers in README.md."""
    readme = HERE / "README.md"
    start, end = "<!-- replica_loss: written by replica_loss.py -->", "<!-- end replica_loss -->"
    content = readme.read_text()
    before, _, rest = content.partition(start)
    _, _, after = rest.partition(end)
    readme.write_text(f"{before}{start}\n{text}\n{end}{after}")


def table(record: dict) -> str:
    lines = [f"Machine: {record['machine']}. Command: `{record['command']}` ({record['date']}). One process, "
             f"global batch 24: val/loss {record['one_process_val_loss']:.4f}. Load average (1, 5, 15 min) "
             f"{' / '.join(f'{x:.1f}' for x in record['load_average']['before'])} before, "
             f"{' / '.join(f'{x:.1f}' for x in record['load_average']['after'])} after: other work shared "
             "the cores, so the seconds move by tens between runs.", "",
             "| job | wall s | s added by the fault | steps trained again | steps dropped | steps with fewer "
             "groups | s from the kill to the rejoin | longest step of a live rank, s | val/loss (vs one process) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in record["rows"].items():
        pause = "n/a (all stop)" if row["longest_pause_s"] is None else f"{row['longest_pause_s']:.1f}"
        rejoin = ", ".join(f"{s:.1f}" for s in (row.get("seconds_to_rejoin") or {}).values()) or "-"
        lines.append(f"| {name} | {row['seconds']:.0f} | {row['seconds_added']:+.0f} | {row['steps_retrained']} | "
                     f"{row['steps_dropped']} | {row['steps_with_fewer_groups']} | {rejoin} | {pause} | "
                     f"{row['val_loss']:.4f} ({row['val_loss_vs_one_process']:+.2%}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
