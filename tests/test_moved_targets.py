"""A config that names a class at the place it had before the package root became a face
(``litscale.lr_scaling.LRScaling``, now ``litscale.optim.lr_scaling.LRScaling``) is refused in one
line that names the new place, before any rank starts."""

from __future__ import annotations

import importlib.util

import pytest

from litscale.app.checks.safety import MOVED_MODULES, locate_target
from litscale.errors import ConfigError


def test_an_old_target_is_told_where_its_class_is_now():
    with pytest.raises(ConfigError) as error:
        locate_target("litscale.optimizers.LARS", "optimizer")
    assert str(error.value) == ("optimizer._target_='litscale.optimizers.LARS' moved to litscale.optim.layerwise.LARS; "
                                "allowed: optimizer._target_=litscale.optim.layerwise.LARS")
    assert locate_target("litscale.optim.layerwise.LARS", "optimizer").__name__ == "LARS"


def test_every_move_leads_from_a_module_that_is_gone_to_one_that_is_there():
    assert [old for old in MOVED_MODULES if importlib.util.find_spec(old) is not None] == []
    assert [new for new in MOVED_MODULES.values() if importlib.util.find_spec(new) is None] == []


@pytest.mark.slow  # a Hydra composition: over a second
def test_a_config_with_an_old_target_is_refused_in_one_line_before_any_rank(tmp_path):
    from helpers.configs import compose_job

    from litscale.app.checks.validation import validate

    cfg, choices = compose_job(["lr_scaling=linear", "lr_scaling._target_=litscale.lr_scaling.LRScaling"], tmp_path)
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value) == ("lr_scaling._target_='litscale.lr_scaling.LRScaling' moved to "
                                "litscale.optim.lr_scaling.LRScaling; allowed: "
                                "lr_scaling._target_=litscale.optim.lr_scaling.LRScaling")
