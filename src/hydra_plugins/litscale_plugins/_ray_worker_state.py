"""The state a Ray worker process keeps for the job it runs (``ray_worker``).

NOTE: apart because Hydra's plugin scan executes every module under ``hydra_plugins`` again in
each process that runs a job (a Ray worker too, inside ``run_job``), which would reset it
mid-job; the scan skips modules whose names start with one ``_``.
"""

from __future__ import annotations

import threading
from typing import Any

# Set by the SIGTERM handler on the worker's main thread; read by the training thread.
stop_requested = threading.Event()
previous_handler: Any = None
# This rank's run dir and its copy in URI storage (``ray_storage.StoredRunDir``), if any.
stored_run_dir: Any = None
# The step at which this rank stopped to save on SIGTERM; None: it did not.
stopped_at_step: int | None = None
