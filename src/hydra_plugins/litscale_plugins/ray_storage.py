"""A run dir kept in URI storage (``hydra.launcher.storage=s3://bucket/prefix``, ``gs://``,
``file://``, ... through ``pyarrow.fs``, which Ray brings).

Workers write the run dir on their node's disk, as any run does, and copy it to storage: the
checkpoints rank 0 publishes as they appear, everything else when the rank ends (a file that
rank 0's node writes too, such as ``train.log``, is its copy). A restarted
attempt starts from the storage copy (so every node resumes from the same newest complete
checkpoint), and the driver takes the copy less its checkpoints back into the sweep dir, where
the sweep reads ``summary.json``. Write times are kept on the way back: the resume search picks
the newest checkpoint by them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CHECKPOINTS = "checkpoints"


def snapshot(local_dir: str, under: str = "") -> dict[str, tuple[int, int]]:
    """``{path relative to local_dir: (size, mtime_ns)}`` of the files a copy may carry: not
    the hidden staging of a save in progress (``.<name>.saving``); ``.hydra/`` is carried."""
    root = Path(local_dir)
    files: dict[str, tuple[int, int]] = {}
    for path in sorted((root / under).rglob("*")) if (root / under).is_dir() else ():
        relative = path.relative_to(root).as_posix()
        if path.is_file() and not any(part.startswith(".") and part != ".hydra" for part in relative.split("/")):
            stat = path.stat()
            files[relative] = (stat.st_size, stat.st_mtime_ns)
    return files


class StoredRunDir:
    """``local_dir`` and its copy at ``uri``."""

    def __init__(self, uri: str, local_dir: str) -> None:
        from pyarrow import fs

        self.filesystem, self.remote = fs.FileSystem.from_uri(uri)
        self.remote = self.remote.rstrip("/")
        self.local = local_dir
        self.copied: dict[str, tuple[int, int]] = {}

    def download(self, *, skip: tuple[str, ...] = ()) -> int:
        """Replace the local dir by the storage copy (less the top-level names in ``skip``);
        the number of files copied."""
        from pyarrow import fs

        shutil.rmtree(self.local, ignore_errors=True)
        os.makedirs(self.local, exist_ok=True)
        selector = fs.FileSelector(self.remote, recursive=True, allow_not_found=True)
        copied = 0
        for info in self.filesystem.get_file_info(selector):
            relative = info.path[len(self.remote) + 1:]
            if info.type != fs.FileType.File or relative.split("/")[0] in skip:
                continue
            target = os.path.join(self.local, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with self.filesystem.open_input_stream(info.path) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            if info.mtime_ns is not None:
                os.utime(target, ns=(info.mtime_ns, info.mtime_ns))
            copied += 1
        self.copied = snapshot(self.local)
        return copied

    def upload_changed(self, under: str = "", *, only_new: bool = False) -> int:
        """Copy the files under ``under`` written since the last copy, oldest first (storage
        stamps them in that order); with ``only_new``, those storage does not hold yet. The
        number copied."""
        from pyarrow import fs

        current = snapshot(self.local, under)
        changed = sorted((path for path, stamp in current.items() if self.copied.get(path) != stamp),
                         key=lambda path: current[path][1])
        if only_new:
            changed = [path for path in changed
                       if self.filesystem.get_file_info(f"{self.remote}/{path}").type == fs.FileType.NotFound]
        for relative in changed:
            target = f"{self.remote}/{relative}"
            self.filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
            with open(os.path.join(self.local, relative), "rb") as source, \
                    self.filesystem.open_output_stream(target) as out:
                shutil.copyfileobj(source, out, 1 << 20)
            self.copied[relative] = current[relative]
        return len(changed)
