"""Writing a cache file whole or not at all, so ranks or jobs that build the same cache at
once, or a run killed while building it, never leave a half-written file under its name."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[BinaryIO]:
    """A binary handle on a temporary file beside ``path``, renamed to ``path`` when the block
    ends without an error and removed when it raises. The file is made readable to all
    (``mkstemp`` makes it private): a cache may be shared."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
