"""Which ``_target_``s a config may build.

Hydra's ``instantiate`` calls whatever a config names, and importing a module runs its code,
so a config (or a command-line override such as ``+callbacks.x._target_=os.system``) could
run anything. litscale builds only objects from trusted packages, checked before any import;
users extend the list with the top-level ``allowed_targets`` key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig

from litscale.errors import ConfigError

TRUSTED_PREFIXES = ("litscale.", "torch.", "lightning.", "pytorch_optimizer.")


# Modules that moved out of the package root into its packages (old -> new): a config that
# still names a class at its old place is told, in one line, where it is now.
MOVED_MODULES = {
    "litscale.async_checkpoint": "litscale.checkpoint.background",
    "litscale.atomic_checkpoint": "litscale.checkpoint.atomic",
    "litscale.checkpoint_moves": "litscale.checkpoint.moves",
    "litscale.checkpoint_reading": "litscale.checkpoint.reading",
    "litscale.checkpoints": "litscale.checkpoint.resume",
    "litscale.deepspeed_moves": "litscale.checkpoint.deepspeed",
    "litscale.export": "litscale.checkpoint.export",
    "litscale.contract": "litscale.parallel.contract",
    "litscale.declarations": "litscale.parallel.declarations",
    "litscale.layout": "litscale.parallel.layout",
    "litscale.sharding": "litscale.parallel.sharding",
    "litscale.determinism": "litscale.reliability.determinism",
    "litscale.determinism_checks": "litscale.reliability.determinism_checks",
    "litscale.fault_tolerance": "litscale.reliability.replica_groups",
    "litscale.optimizers": "litscale.optim.layerwise",
    "litscale.lr_scaling": "litscale.optim.lr_scaling",
    "litscale.muon": "litscale.optim.muon",
    "litscale.mup": "litscale.optim.mup",
    "litscale.parameter_steps": "litscale.optim.parameter_steps",
    "litscale.schedulers": "litscale.optim.schedulers",
    "litscale.hf_export": "litscale.models.hf_writing",
    "litscale.flops": "litscale.measure.flops",
    "litscale.step_memory": "litscale.measure.step_memory",
    "litscale.tensor_bytes": "litscale.measure.tensor_bytes",
}


def moved_target(target: str) -> str | None:
    """Where ``target`` is now if its module moved (``MOVED_MODULES``); None if it did not."""
    module, _, name = target.rpartition(".")
    return f"{MOVED_MODULES[module]}.{name}" if module in MOVED_MODULES else None


def locate_target(target: str, path: str) -> Any:
    """The object a ``_target_`` names (importing its module), or a one-line error (naming
    where it is now, for a class whose module moved)."""
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception as error:  # Hydra wraps ImportError/AttributeError in its own types
        now = moved_target(target)
        if now is not None:
            raise ConfigError(f"{path}._target_={target!r} moved to {now}; allowed: {path}._target_={now}") from None
        raise ConfigError(f"{path}._target_={target!r} cannot be imported: {error}".splitlines()[0]) from None


def allowed_prefixes(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The trusted prefixes plus the user's; an entry names a package or module (``mypkg``
    allows ``mypkg.*``) or one object exactly (``mypkg.models.Net``)."""
    return TRUSTED_PREFIXES + tuple(extra)


def _allowed(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p if p.endswith(".") else p + ".") for p in prefixes)


def check_targets(node: Any, path: str, prefixes: tuple[str, ...]) -> None:
    """Raise ``ConfigError`` for the first ``_target_`` under ``node`` outside ``prefixes``.

    Walks the raw node without resolving interpolations, so nothing is evaluated first.
    """
    if isinstance(node, (DictConfig, dict)):
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items()
        for key, value in items:
            child = f"{path}.{key}" if path else str(key)
            if key == "_target_" and not _allowed(str(value), prefixes):
                trusted = ", ".join(p.rstrip(".") for p in prefixes)
                raise ConfigError(
                    f"{child}={str(value)!r} is not allowed: targets must come from {trusted} "
                    "(trust another package with allowed_targets=[<package>])"
                )
            check_targets(value, child, prefixes)
    elif isinstance(node, (ListConfig, list, tuple)):
        for index, value in enumerate(node):
            check_targets(value, f"{path}[{index}]", prefixes)


def _escape_environment(node: Any) -> Any:
    """Raw config data with each value that reads the environment escaped to plain text."""
    if isinstance(node, dict):
        return {key: _escape_environment(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_escape_environment(value) for value in node]
    if isinstance(node, str) and "oc.env" in node:
        return node.replace("${", "\\${")
    return node


def config_without_environment(cfg: DictConfig) -> dict:
    """The resolved config for logs and hparams, where every value that comes from the
    environment (``${oc.env:...}``, e.g. an API key), directly or through another
    interpolation, is kept as its interpolation text instead of its value."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False)
    return OmegaConf.to_container(OmegaConf.create(_escape_environment(raw)), resolve=True)
