"""Fault-injection soak: kill or break a rank at random steps and check what the user gets.

    python experiments/reliability/soak.py      # 20 restarts, 10 preemptions, 20 failures
    python experiments/reliability/soak.py --restarts 3 --preemptions 3 --failures 3 --seed 7

- restarts: ``torchrun --standalone --nproc-per-node=2 --max-restarts=1 train.py ... ckpt_path=auto``
  with a fault (SIGKILL or an exception) on a random rank at a random step. Each must finish
  (exit 0) with the uninterrupted run's final train loss, validation loss and weights, bit
  for bit (dropout on, so the RNG state must be restored too).
- preemptions: ``python train.py strategy=ddp trainer.devices=2`` (litscale's launcher) gets
  SIGTERM or SIGUSR1 (as SLURM sends them) at a random step, then runs again with
  ``ckpt_path=auto``. The first must exit 0 with ``last.ckpt`` saved by both ranks after one
  agreed step, the second must finish with the uninterrupted result, bit for bit.
- failures: ``python train.py strategy=ddp trainer.devices=2`` (litscale's launcher, no
  restarts) with an exception on a random rank, in a training step or in validation. Each
  must exit 1, the whole run (start-up included) within 60 s, with one ``error:`` line naming
  the injected fault, its traceback once, and no rank left running.

Results: ``results.json`` and the tables in ``README.md`` (between the results markers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.cli import run_in_own_group  # noqa: E402  (runs as the tests run them)

STEPS, CHECKPOINT_EVERY = 24, 4
RUN = ("trainer.accelerator=cpu", "trainer.devices=2", "strategy=ddp", "data.batch_size=8",
       f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={CHECKPOINT_EVERY}",
       "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "data.seq_len=32",
       "data.max_bytes=400000", "model.net.dropout=0.1", "trainer.enable_progress_bar=false")
FAULT = "+callbacks.fault._target_=litscale.callbacks.faults.InjectFault"
TIMEOUT_S = 300


def run(command: list[str], outputs: Path) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """The process, its seconds, and the processes that outlived it (stray ranks)."""
    return run_in_own_group(command, outputs=outputs, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                            timeout=TIMEOUT_S)


def torchrun(*overrides: str, outputs: Path, name: str):
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=1", "--monitor-interval=0.5", str(REPO / "train.py"), *RUN,
                *overrides, f"name={name}", f"hydra.run.dir={outputs}/{name}"], outputs)


def outcome(outputs: Path, name: str) -> dict | None:
    """Final losses and a hash of the final weights of a finished run, else None."""
    path = outputs / name / "summary.json"
    if not path.exists():
        return None
    import torch

    summary = json.loads(path.read_text())
    state = torch.load(summary["checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    digest = hashlib.sha256()
    for key in sorted(k for k in state if k.startswith("net.")):
        digest.update(key.encode())
        digest.update(state[key].numpy().tobytes())
    return {"train/loss": summary["train/loss"], "val/loss": summary["val/loss"],
            "weights_sha256": digest.hexdigest()[:16], "steps": summary["steps"]}


def restart_trial(rng: random.Random, outputs: Path, index: int, reference: dict) -> dict:
    # Not on a checkpoint step: the fault fires before that step's checkpoint is written.
    step = rng.choice([s for s in range(CHECKPOINT_EVERY + 1, STEPS) if s % CHECKPOINT_EVERY])
    kind, rank = rng.choice(["sigkill", "exception"]), rng.choice([0, 1])
    name = f"restart{index:02d}"
    process, seconds, stray = torchrun("ckpt_path=auto", FAULT, f"+callbacks.fault.at_step={step}",
                                       f"+callbacks.fault.kind={kind}", f"+callbacks.fault.rank={rank}",
                                       outputs=outputs, name=name)
    result = outcome(outputs, name)
    output = process.stdout + process.stderr
    return {"fault": f"{kind} on rank {rank} at step {step}", "exit": process.returncode,
            "seconds": round(seconds, 1), "stray": stray,
            "resumed": output.count("Restored all states from the checkpoint at"),
            "same_result": result == reference, "result": result}


def train(*overrides: str, outputs: Path, name: str):
    return run([sys.executable, str(REPO / "train.py"), *RUN, *overrides, f"name={name}",
                f"hydra.run.dir={outputs}/{name}"], outputs)


def preemption_trial(rng: random.Random, outputs: Path, index: int, reference: dict) -> dict:
    step, signal_name = rng.randint(2, STEPS - 6), rng.choice(["sigterm", "sigusr1"])
    name = f"preemption{index:02d}"
    stopped, seconds, stray = train(FAULT, f"+callbacks.fault.at_step={step}",
                                    f"+callbacks.fault.kind={signal_name}", "+callbacks.fault.rank=0",
                                    "callbacks.preemption.check_every_n_steps=2",
                                    outputs=outputs, name=name)
    checkpoint = outputs / name / "checkpoints" / "last.ckpt"
    import torch

    saved_at = (torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]
                if checkpoint.exists() else None)
    resumed, more_seconds, more_stray = train("ckpt_path=auto", outputs=outputs, name=name)
    result = outcome(outputs, name)
    return {"fault": f"{signal_name.upper()} after step {step}", "exit": stopped.returncode,
            "saved_at_step": saved_at, "resume_exit": resumed.returncode,
            "seconds": round(seconds + more_seconds, 1), "stray": stray + more_stray,
            "same_result": result == reference, "result": result}


def failure_trial(rng: random.Random, outputs: Path, index: int) -> dict:
    step, rank = rng.randint(2, STEPS - 2), rng.choice([0, 1])
    during = rng.choice(["train", "validation"])
    name = f"failure{index:02d}"
    process, seconds, stray = train(FAULT, f"+callbacks.fault.at_step={step}",
                                    f"+callbacks.fault.rank={rank}", f"+callbacks.fault.during={during}",
                                    outputs=outputs, name=name)
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    expected = f"error: rank {rank} failed: InjectedFault: injected fault"
    return {"fault": f"exception on rank {rank} at step {step} ({during})", "exit": process.returncode,
            "seconds": round(seconds, 1), "stray": stray, "error_lines": len(errors),
            "names_the_cause": len(errors) == 1 and errors[0].startswith(expected),
            "tracebacks": process.stderr.count("Traceback (most recent call last)")}


def machine() -> str:
    import torch

    return (f"{os.cpu_count()} cores, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def tables(results: dict) -> str:
    restarts, preemptions, failures = results["restarts"], results["preemptions"], results["failures"]
    ok = sum(t["exit"] == 0 and t["same_result"] and t["resumed"] == 1 and not t["stray"] for t in restarts)
    preempted = sum(t["exit"] == 0 and t["resume_exit"] == 0 and t["same_result"] and not t["stray"]
                    for t in preemptions)
    named = sum(t["exit"] == 1 and t["names_the_cause"] and t["tracebacks"] == 1 and not t["stray"]
                for t in failures)
    lines = [
        f"Machine: {results['machine']}. Command: `{results['command']}` ({results['date']}).", "",
        f"Reference (no fault): train/loss {results['reference']['train/loss']:.6f}, val/loss "
        f"{results['reference']['val/loss']:.6f}, weights {results['reference']['weights_sha256']}.", "",
        f"### Elastic restarts: {ok}/{len(restarts)} resumed to the reference result, bit for bit", "",
        "| fault | exit | resumed | same losses and weights | stray ranks | s |",
        "| --- | --- | --- | --- | --- | --- |",
        *(f"| {t['fault']} | {t['exit']} | {t['resumed']} | {'yes' if t['same_result'] else 'NO'} | "
          f"{'YES' if t['stray'] else 'none'} | {t['seconds']} |" for t in restarts),
        "",
        f"### Preemption, then `ckpt_path=auto`: {preempted}/{len(preemptions)} stopped cleanly and "
        "resumed to the reference result, bit for bit", "",
        "Ranks agree on the signal every 2 steps (`callbacks.preemption.check_every_n_steps=2`).", "",
        "| signal | exit | checkpoint at step | resumed run's exit | same losses and weights | stray ranks | s (both runs) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {t['fault']} | {t['exit']} | {t['saved_at_step']} | {t['resume_exit']} | "
          f"{'yes' if t['same_result'] else 'NO'} | {'YES' if t['stray'] else 'none'} | {t['seconds']} |"
          for t in preemptions),
        "",
        f"### Failing rank, no restarts: {named}/{len(failures)} exited 1 with the cause shown once", "",
        f"Whole-run seconds (start-up, steps up to the fault, stop): median "
        f"{statistics.median(t['seconds'] for t in failures):.1f}, max "
        f"{max(t['seconds'] for t in failures):.1f}.", "",
        "| fault | exit | `error:` lines | names the cause | tracebacks | stray ranks | s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {t['fault']} | {t['exit']} | {t['error_lines']} | {'yes' if t['names_the_cause'] else 'NO'} | "
          f"{t['tracebacks']} | {'YES' if t['stray'] else 'none'} | {t['seconds']} |" for t in failures),
        "",
    ]
    return "\n".join(lines)


def write_readme(results: dict) -> None:
    readme = HERE / "README.md"
    begin, end = "<!-- results: written by soak.py -->", "<!-- end results -->"
    head, _, rest = readme.read_text().partition(begin)
    _, _, tail = rest.partition(end)
    readme.write_text(f"{head}{begin}\n{tables(results)}{end}{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--preemptions", type=int, default=10)
    parser.add_argument("--failures", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        outputs = Path(tmp)
        process, _, _ = torchrun(outputs=outputs, name="reference")
        reference = outcome(outputs, "reference")
        if process.returncode or reference is None:
            sys.exit(f"the reference run failed:\n{process.stderr[-3000:]}")
        restarts, preemptions, failures = [], [], []
        for index in range(args.restarts):
            restarts.append(restart_trial(rng, outputs, index, reference))
            print(f"restart {index}: {restarts[-1]}", flush=True)
        for index in range(args.preemptions):
            preemptions.append(preemption_trial(rng, outputs, index, reference))
            print(f"preemption {index}: {preemptions[-1]}", flush=True)
        for index in range(args.failures):
            failures.append(failure_trial(rng, outputs, index))
            print(f"failure {index}: {failures[-1]}", flush=True)
    command = "python experiments/reliability/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {"machine": machine(), "command": command.strip(), "date": time.strftime("%Y-%m-%d"),
               "reference": reference, "restarts": restarts, "preemptions": preemptions,
               "failures": failures}
    print(tables(results))
    if not args.no_write:
        (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        write_readme(results)


if __name__ == "__main__":
    main()
