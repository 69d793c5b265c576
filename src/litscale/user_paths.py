"""Paths as a user types them: in a config key (``model.net.path``, ``data.paths``,
``ckpt_path``, ``plan.calibrate_from``, ``paths.root_dir``, ...) or an environment variable
(``LITSCALE_OUTPUTS``, ``LITSCALE_CACHE``), ``~`` is the home directory, as a shell would have
expanded it: Hydra's override grammar needs such a path quoted (``'~/models/qwen3'``), and a
quoted ``~`` reaches the program as it is. Every place that reads such a path expands it here;
the configs' own interpolations use the ``${user_path:...}`` resolver (``litscale.app.resolvers``).
"""

from __future__ import annotations

import os


def user_path(path: str | os.PathLike) -> str:
    """``path`` with a leading ``~`` (or ``~user``) replaced by that home directory."""
    return os.path.expanduser(os.fspath(path))
