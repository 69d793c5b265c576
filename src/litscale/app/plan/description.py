"""``RunDescription``: a composed run as the planner reads it, read off the config once.

``train()`` describes the validated run (``describe``) and hands the description to the
planner: to ``plan=show|auto``'s ranking, or to the prediction made before launch. The
planner then reads typed values (the network, the sequence, the dtypes, the strategy's and
the plan's settings) and never the config itself; what builds the run for real (the dry
run, the traced first step, the meta-device network) gets the resolved config as a rank
does, as plain data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from litscale.app.scaling_study import ScalingContext
from litscale.parallel.layout import RunLayout


@dataclass(frozen=True)
class RunDescription:
    """The run as validated: its resolved config as plain data (``config``), its group
    choices, its layout and its Hydra job's context (overrides, sweep dir)."""

    config: dict
    choices: dict[str, str]
    layout: RunLayout
    job: ScalingContext = field(default_factory=ScalingContext)

    @functools.cached_property
    def as_config(self) -> DictConfig:
        """``config`` as a read-only ``DictConfig``, for the code that builds the run (the
        meta-device network, the traced first step) as a rank builds it."""
        built = OmegaConf.create(self.config)
        OmegaConf.set_readonly(built, True)
        return built

    @property
    def plan(self) -> dict:
        """The ``plan`` group's settings ({} where the config has none)."""
        return self.config.get("plan") or {}

    @property
    def strategy(self) -> dict:
        return self.config["strategy"]

    @property
    def optimizer(self) -> dict:
        return self.config["optimizer"]

    @property
    def net(self) -> dict:
        """The network's config (``model.net``), or the model's own target where it has none."""
        model = self.config["model"]
        return model.get("net") or {"_target_": model.get("_target_")}

    @property
    def data(self) -> dict:
        return self.config.get("data") or {}

    @property
    def seq_len(self) -> int | None:
        value = self.data.get("seq_len")
        return None if value is None else int(value)

    @property
    def vocab_size(self) -> int:
        return int(self.data["vocab_size"])

    @property
    def packed_documents(self) -> bool:
        """Whether a row packs several documents (``data.pack``, ``data.document_mask``)."""
        from litscale.data.token_batch import packs_documents

        return packs_documents(self.data) is not None

    @property
    def compute_dtype(self) -> str:
        return self.config["precision"]["compute_dtype"]

    @property
    def param_dtype(self) -> str:
        return self.config["precision"]["param_dtype"]

    @property
    def float8(self) -> bool:
        return bool(self.config["precision"].get("float8"))

    @property
    def cluster(self) -> dict | None:
        """The ``cluster`` group's config (None where the config has none)."""
        return self.config.get("cluster")

    @property
    def trusted(self) -> tuple[str, ...]:
        """The packages this run may build from (litscale's and its ``allowed_targets``)."""
        from litscale.app.build import trusted_targets

        return trusted_targets(self.config)

    @property
    def output_dir(self) -> str:
        return self.config["paths"]["output_dir"]

    @functools.cached_property
    def run_options(self) -> dict:
        """The contract options the run chose, each as the user typed it (``chosen_options``)."""
        from litscale.app.checks.contract import chosen_options

        return chosen_options(self.as_config, self.choices)

    @functools.cached_property
    def settings(self) -> dict[str, Any]:
        """The settings a strategy may refuse an option with (``run_settings``)."""
        from litscale.app.checks.contract import run_settings

        return run_settings(self.as_config)


def describe(cfg: DictConfig, choices: dict[str, str], layout: RunLayout, *,
             job: ScalingContext | None = None) -> RunDescription:
    """``cfg`` (composed and validated, its layout ``layout``) as the planner reads it; ``job``:
    the Hydra job's context where it is one (a run rebuilt from another run's files is not)."""
    return RunDescription(OmegaConf.to_container(cfg, resolve=True), dict(choices), layout,
                          job if job is not None else ScalingContext())
