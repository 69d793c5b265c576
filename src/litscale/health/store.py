"""The key-value store the ranks of a job share for health reports.

NOTE: every launcher litscale runs under already hosts a ``TCPStore`` for the process
group's rendezvous (torch's elastic agent for litscale's launcher and torchrun; rank 0 under
srun), and exports its address as ``MASTER_ADDR`` / ``MASTER_PORT`` once the group exists.
Heartbeats are extra clients of that store under their own prefix: no new port, no
collective, and a rank stuck inside a collective can still be read and told to stop.
"""

from __future__ import annotations

import os
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore


def health_store(connect_timeout_s: float = 60.0) -> Store:
    """A client of the job's store, with keys under ``litscale/health/<attempt>/`` (a restart
    of an elastic job keeps the store, so each attempt has its own keys)."""
    client = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=timedelta(seconds=connect_timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"litscale/health/{attempt}/", client)


def read_json_keys(store: Store, keys: list[str]) -> list[bytes | None]:
    """The values of ``keys``, None for a key not (yet) set: one round trip per key present."""
    present = [store.check([key]) for key in keys]
    return [store.get(key) if ok else None for key, ok in zip(keys, present, strict=True)]
