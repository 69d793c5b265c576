"""``python -m litscale.doctor <run dir>``: which collective, on which rank, from which line,
broke a multi-rank job.

Reads the Flight Recorder dumps a run leaves in ``<run dir>/flight_recorder/`` (written when
the hang watchdog stops a job, and by a rank that fails) and prints one line naming the first
collective the ranks disagree on, then each rank's stack at that call.
"""

from __future__ import annotations

import argparse
import sys

from litscale.health.doctor import UnsafeDumpError, diagnose, load_dumps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m litscale.doctor", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", help="a run's output dir (or its flight_recorder/ dir)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks the job had (names ranks that left no dump)",
    )
    args = parser.parse_args(argv)
    try:
        dumps = load_dumps(args.run_dir)
    except UnsafeDumpError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not dumps:
        print(
            f"error: no Flight Recorder dumps in {args.run_dir} (flight_recorder/rank<N>): a run writes them "
            "when the hang watchdog stops it or a rank fails",
            file=sys.stderr,
        )
        return 2
    diagnosis = diagnose(dumps, args.world_size)
    print(diagnosis.report())
    return 1 if diagnosis.mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
