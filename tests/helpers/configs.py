"""Where the configs live, and composing them as ``train.py`` and a job see them."""

from __future__ import annotations

import contextlib
import copy
import functools
from pathlib import Path

from omegaconf import DictConfig, open_dict

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"


def group_options(group: str) -> list[str]:
    """The options of a config group: the ``conf/<group>/*.yaml`` file stems, sorted."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def config_groups() -> list[str]:
    return sorted(path.name for path in CONF_DIR.iterdir() if path.is_dir())


def compose_full(overrides: list[str] = ()) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``, the ``hydra`` node included: a copy of
    its own for each call (a composition takes about 0.14 s, and some tests ask for the same
    ones again)."""
    return copy.deepcopy(_composed(tuple(overrides)))


def compose_once(overrides: list[str]) -> DictConfig:
    """``compose_full`` for a composition asked for once (the combination generator's): no
    cached copy to keep and deep-copy (a tenth of a composition's time)."""
    return _compose(tuple(overrides))


def _compose(overrides: tuple[str, ...]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), files_read_once():
        return compose("train", overrides=list(overrides), return_hydra_config=True)


_composed = functools.cache(_compose)


# (the search path's sources, a config's path) -> Hydra's result of reading that file.
_READ: dict[tuple, object] = {}


@contextlib.contextmanager
def files_read_once():
    """Hydra reads each config file of a composition once per ``compose`` (its
    ``CachingConfigRepository`` lives for one call): about 28 YAML files per composition, a
    third of its time. Inside this block each file is read once per test session and handed
    out as a deep copy (a composition edits what it was handed: an override of one
    composition showed in the next without the copy). Only the tests' compositions from
    ``conf/`` use it (the files do not change during a session); ``test_configs.py`` checks
    that compositions come out the same with it and without."""
    from hydra._internal.config_repository import ConfigRepository

    original = ConfigRepository.load_config

    def load_config(self, config_path: str):
        key = (tuple(source.full_path() for source in self.sources), config_path)
        if key not in _READ:
            _READ[key] = original(self, config_path)
        return copy.deepcopy(_READ[key])

    ConfigRepository.load_config = load_config
    try:
        yield
    finally:
        ConfigRepository.load_config = original


def as_job(cfg: DictConfig, output_dir: Path) -> tuple[DictConfig, dict[str, str]]:
    """``(config, choices)`` as a job sees them: no ``hydra`` node, a real run dir (as
    ``litscale.app.preflight._as_job_config`` does, with a path instead of a placeholder)."""
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if isinstance(v, str)}
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.paths.output_dir = str(output_dir)
    return cfg, choices


def compose_job(overrides: list[str], output_dir: Path) -> tuple[DictConfig, dict[str, str]]:
    return as_job(compose_full(overrides), output_dir)


def compose_options(options: list[tuple[str, str]]) -> DictConfig:
    """Each ``(group, option)`` as Hydra composes it for ``group=option`` (its defaults list
    followed), all in one composition: option ``o`` of group ``g`` at ``options.<g>.<o>``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), files_read_once():
        # `+g@p=o` adds option o of group g at package p: one pass instead of one per option.
        cfg = compose("train", overrides=[f"+{g}@options.{g}.{o}={o}" for g, o in options])
    return cfg.options
