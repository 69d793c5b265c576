"""``python train.py <args>`` many times at the cost of one interpreter's imports.

Importing torch + Lightning costs ~6 CPU-seconds per interpreter, far more than a refusal
itself. The server pays it once, then runs each job as ``python train.py <args>`` would: a
forked child with its own stdout/stderr files, environment and argv runs train.py as
``__main__``. Only for runs that end before any rank starts (a fork after a process group or
threads would not be a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.configs import REPO_ROOT

FORK_SERVER = r"""
import contextlib, json, os, runpy, sys, traceback
from litscale.app.preflight import check_command_line

# Warm up: checking the default command line imports what every case needs.
with contextlib.redirect_stdout(sys.stderr), contextlib.suppress(BaseException):
    check_command_line([], config_dir=os.path.abspath("conf"), config_name="train")

for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            os.environ.update(job["env"])
            sys.argv = ["train.py", *job["args"]]
            runpy.run_path("train.py", run_name="__main__")
            code = 0
        except SystemExit as exit:
            if isinstance(exit.code, str):
                print(exit.code, file=sys.stderr)
            code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class ForkServer:
    """One server process (``with ForkServer(env) as server: server.run(...)``): its jobs run
    one after another."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", FORK_SERVER], cwd=REPO_ROOT, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, args: list[str], directory: Path, env: dict[str, str]) -> tuple[int, str, str]:
        """``(exit code, stdout, stderr)`` of ``train.py <args>`` with ``env`` added, its output
        kept in ``directory``."""
        out, err = directory / "stdout.txt", directory / "stderr.txt"
        job = {"args": args, "stdout": str(out), "stderr": str(err), "env": env}
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline())
        return reply["returncode"], out.read_text(), err.read_text()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
