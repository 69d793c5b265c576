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
    its own for each call (a composition takes about 0.15 s, and some tests ask for the same
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
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), faster_composition():
        return compose("train", overrides=list(overrides), return_hydra_config=True)


_composed = functools.cache(_compose)


# (the search path's sources, a config's path) -> Hydra's result of reading that file.
_READ: dict[tuple, object] = {}


@contextlib.contextmanager
def faster_composition():
    """Hydra's composition, the same result sooner (the combination generator's: 0.21 s to
    0.15 s each on a quiet machine, beside the files already read once), for the tests' compositions from ``conf/`` (its files do
    not change during a session); ``test_configs.py`` checks that compositions come out the
    same with it and without.

    - Each config file is read once per test session, then handed out as a deep copy: Hydra
      reads each again in every ``compose`` (its ``CachingConfigRepository`` lives for one
      call), about 28 YAML files per composition, a third of its time. (The copy: a
      composition edits what it was handed; an override of one composition showed in the next
      without it.)
    - The map that resolves a defaults list's interpolated entries (``group: ${...}``) is built
      only for a list that has one: Hydra builds it for each of a composition's 27 nodes, a
      third of the rest, and none of ``conf/`` interpolates a default."""
    from hydra._internal import defaults_list
    from hydra._internal.config_repository import ConfigRepository

    original, original_map = ConfigRepository.load_config, defaults_list._create_interpolation_map

    def load_config(self, config_path: str):
        key = (tuple(source.full_path() for source in self.sources), config_path)
        if key not in _READ:
            _READ[key] = original(self, config_path)
        return copy.deepcopy(_READ[key])

    def interpolation_map(overrides, defaults, self_added):
        # Read only to resolve an interpolated entry of ``defaults`` (defaults_list.py).
        if not any(default.is_interpolation() for default in defaults):
            return None
        return original_map(overrides, defaults, self_added)

    ConfigRepository.load_config = load_config
    defaults_list._create_interpolation_map = interpolation_map
    try:
        yield
    finally:
        ConfigRepository.load_config = original
        defaults_list._create_interpolation_map = original_map


def as_job(cfg: DictConfig, output_dir: Path) -> tuple[DictConfig, dict[str, str]]:
    """``(config, choices)`` as a job sees them: no ``hydra`` node, a real run dir (as
    ``litscale.app.preflight.as_job_config`` does, with a path instead of a placeholder)."""
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if isinstance(v, str)}
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.paths.output_dir = str(output_dir)
    return cfg, choices


def compose_job(overrides: list[str], output_dir: Path) -> tuple[DictConfig, dict[str, str]]:
    return as_job(compose_full(overrides), output_dir)


def described(cfg: DictConfig, choices: dict[str, str], layout=None):
    """The job as the planner reads it (``litscale.app.plan.description``), validated as a plan
    is (``this_machine=False``) where no ``layout`` is given."""
    from litscale.app.checks.validation import validate
    from litscale.app.plan.description import describe

    return describe(cfg, choices, layout or validate(cfg, choices=choices, this_machine=False))


def compose_options(options: list[tuple[str, str]]) -> DictConfig:
    """Each ``(group, option)`` as Hydra composes it for ``group=option`` (its defaults list
    followed), all in one composition: option ``o`` of group ``g`` at ``options.<g>.<o>``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), faster_composition():
        # `+g@p=o` adds option o of group g at package p: one pass instead of one per option.
        cfg = compose("train", overrides=[f"+{g}@options.{g}.{o}={o}" for g, o in options])
    return cfg.options
