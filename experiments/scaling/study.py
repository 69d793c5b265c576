"""The scaling study: throughput and efficiency vs devices for every litscale strategy.

Runs ``train.py`` sweeps over ``trainer.devices`` for ddp, fsdp, tensor_parallel and ddp with
PowerSGD compression (each variant's 1-device job is its baseline), and a pipeline on 2
devices (which has no 1-device form) against the single-process run; then writes the report
(``results.md``, ``results.json``, ``scaling.png``) here, and each run's summary.json under
``summaries/`` for the notebook.

    python experiments/scaling/study.py                 # CPU: devices 1 and 2, GPT-nano
    python experiments/scaling/study.py --gpu           # every visible GPU: 1, 2, 4, ... bf16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "src"))

from litscale.app.report import load_summaries, markdown_table, plot, scaling_rows  # noqa: E402

VARIANTS = [["strategy=ddp"], ["strategy=fsdp"], ["strategy=tensor_parallel"],
            ["strategy=ddp", "compression=powersgd"]]


def train(*overrides: str, outputs: Path) -> None:
    env = {**os.environ, "LITSCALE_OUTPUTS": str(outputs)}
    command = [sys.executable, str(REPO / "train.py"), *overrides]
    print("$ python train.py " + " ".join(overrides), flush=True)
    process = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if process.returncode:
        sys.exit(f"failed:\n{process.stdout[-2000:]}\n{process.stderr[-3000:]}")


def device_counts(gpu: bool) -> list[int]:
    if not gpu:
        return [1, 2]
    import torch

    available = torch.cuda.device_count()
    return [n for n in (1, 2, 4, 8) if n <= available]


def run_study(args: argparse.Namespace, outputs: Path) -> None:
    common = [f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
              "trainer.limit_val_batches=4", "trainer.enable_progress_bar=false", "logger=none",
              f"data.batch_size={args.batch_size}", f"data.seq_len={args.seq_len}",
              f"model.net.preset={args.preset}", "callbacks.throughput.warmup_steps=10"]
    common += ["trainer=gpu", "precision=bf16_mixed"] if args.gpu else ["trainer.accelerator=cpu"]
    devices = ",".join(map(str, device_counts(args.gpu)))
    for variant in VARIANTS:
        train("-m", f"trainer.devices={devices}", *variant, *common, "name=study", outputs=outputs)
    single = next(s for s in load_summaries(str(outputs)) if s["choices"]["strategy"] == "ddp"
                  and s["world_size"] == 1 and "compression=powersgd" not in s["overrides"])
    train("strategy=pipeline", "trainer.devices=2", *common, "name=study",
          f"scaling.baseline={single['run_dir']}", outputs=outputs)


def record(outputs: Path, args: argparse.Namespace) -> None:
    summaries = load_summaries(str(outputs))
    rows = scaling_rows(summaries)
    keep = HERE / "summaries"
    shutil.rmtree(keep, ignore_errors=True)
    for summary in summaries:
        name = f"{summary['choices']['strategy']}-{summary['choices']['compression']}-" \
               f"{summary['world_size']}"
        target = keep / name
        target.mkdir(parents=True)
        public = {k: v for k, v in summary.items() if k not in ("run_dir", "output_dir",
                                                                 "checkpoint", "export")}
        # the baseline's temporary run dir, as the summary kept here
        public["overrides"] = ["scaling.baseline=summaries/ddp-none-1"
                               if o.startswith("scaling.baseline=") else o for o in summary["overrides"]]
        (target / "summary.json").write_text(json.dumps(public, indent=2))
    plot(rows, str(HERE / "scaling.png"))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    (HERE / "results.json").write_text(json.dumps({
        "machine": machine, "args": vars(args), "date": time.strftime("%Y-%m-%d"),
        "rows": [{k: v for k, v in row.items() if k != "run_dir"} for row in rows]}, indent=2))
    (HERE / "results.md").write_text(
        f"Machine: {machine}. Command: `python experiments/scaling/study.py "
        f"{' '.join(sys.argv[1:])}`\n\n" + markdown_table(rows))
    print(markdown_table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="every visible GPU, bf16")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="per device (weak scaling)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--preset", default="nano")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as outputs:
        run_study(args, Path(outputs))
        record(Path(outputs), args)


if __name__ == "__main__":
    main()
