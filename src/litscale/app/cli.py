"""The Hydra job behind ``train.py``: errors a user can act on become one line and an exit code."""

from __future__ import annotations

import sys
import traceback

from omegaconf import DictConfig

from litscale.app.launch import RankFailure, external_rank, is_knock_on_failure
from litscale.app.preflight import EXIT_BAD_CONFIG
from litscale.app.run_log import log_printed_lines
from litscale.errors import ConfigError


def run_job(cfg: DictConfig) -> float | None:
    """Train one job; return its final validation loss, or exit non-zero with one line."""
    with log_printed_lines():  # the printed lines in Hydra's train.log too
        return _run(cfg)


def _run(cfg: DictConfig) -> float | None:
    from litscale.app.run import train

    try:
        summary = train(cfg)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_CONFIG) from None
    except RankFailure as error:  # its traceback was printed by the launcher
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Exception as error:  # this process's own failure: one run, or one rank of torchrun/srun
        report_failure(error)
        raise SystemExit(1) from None
    if summary.get("preempted"):
        steps = f" after {summary['steps']} steps" if "steps" in summary else ""
        print(f"litscale: preempted{steps}; last.ckpt saved; run again with ckpt_path=auto to "
              "resume", flush=True)
        return None
    return summary.get("val/loss")


def report_failure(error: BaseException) -> None:
    """The traceback and one ``error:`` line, as litscale's launcher reports a failed rank.

    Under torchrun or srun every rank reports for itself: a rank whose error only says that a
    peer died (the peer's own report is the cause) prints one line and no traceback.
    """
    rank = external_rank()
    if rank is not None and is_knock_on_failure(error):
        print(f"litscale: rank {rank} stopped: another rank failed ({_first_line(error)})",
              file=sys.stderr, flush=True)
        return
    traceback.print_exc()
    where = "" if rank is None else f"rank {rank} failed: "
    print(f"error: {where}{type(error).__name__}: {_first_line(error)}", file=sys.stderr, flush=True)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]
