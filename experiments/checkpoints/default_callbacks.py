"""How long a validation's saves block training under the default callbacks, synchronous
against ``checkpoint.async_save=true``.

``callbacks=default`` saves twice at each validation (``ModelCheckpoint``'s top-k file, then
``last.ckpt``). Each run is ``python train.py`` on CPU with the model and the validation
interval below; the blocked time of a validation is the time in ``ModelCheckpoint``'s
``on_validation_end`` on the training thread (both saves, the collection of the state
included). Medians over the validations after the first of ``--runs`` runs; the first
validation's (the background save's copies are allocated there) apart.

    python experiments/checkpoints/default_callbacks.py                  # writes default_callbacks.json
    python experiments/checkpoints/default_callbacks.py --preset nano --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUN = ("data.seq_len=32", "data.batch_size=2", "trainer.accelerator=cpu", "trainer.max_steps=8",
       "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "logger=csv",
       "trainer.enable_progress_bar=false")


def timed_run(out: str, overrides: list[str]) -> None:
    """One ``train.py`` run in this process, each validation's saves timed (the child's part)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    blocked: list[float] = []
    saving = ModelCheckpoint.on_validation_end

    def timed(self, trainer, module):
        started = time.perf_counter()
        saving(self, trainer, module)
        if not trainer.sanity_checking:  # which saves nothing
            blocked.append(time.perf_counter() - started)

    ModelCheckpoint.on_validation_end = timed
    sys.argv = ["train.py", *overrides]
    os.chdir(REPO)
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    except SystemExit as stop:
        if stop.code:
            raise
    Path(out).write_text(json.dumps(blocked))


def run(preset: str, asynchronous: bool, extra: list[str]) -> list[float]:
    out = tempfile.mktemp(suffix=".json")
    overrides = [*RUN, f"model.net.preset={preset}", f"checkpoint.async_save={str(asynchronous).lower()}",
                 f"paths.output_dir={tempfile.mkdtemp(prefix='litscale-saves-')}", *extra]
    subprocess.run([sys.executable, __file__, "--child", out, *overrides], check=True, cwd=REPO)
    return json.loads(Path(out).read_text())


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        timed_run(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="micro")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "default_callbacks.json"))
    parser.add_argument("--label", default="", help="what code this measured (recorded with the figures)")
    parser.add_argument("overrides", nargs="*", help="more train.py overrides")
    args = parser.parse_args()
    load_before, rows = os.getloadavg()[0], []
    for asynchronous in (False, True):
        runs = [run(args.preset, asynchronous, args.overrides) for _ in range(args.runs)]
        first, later = [r[0] for r in runs], [s for r in runs for s in r[1:]]
        row = {"preset": args.preset, "async_save": asynchronous, "validations": sum(map(len, runs)),
               "blocked_s": round(statistics.median(later), 3), "first_blocked_s": round(statistics.median(first), 3),
               "all_s": [[round(s, 3) for s in r] for r in runs]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.append({"async_over_sync": round(rows[1]["blocked_s"] / rows[0]["blocked_s"], 3)})
    print(json.dumps(rows[-1]))
    record = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else []
    record.append({"label": args.label, "cores": os.cpu_count(), "load_before": load_before,
                   "overrides": [*RUN, *args.overrides], "rows": rows})
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
