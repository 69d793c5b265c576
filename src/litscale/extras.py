"""The optional packages (``pyproject.toml``'s ``[project.optional-dependencies]``) that
litscale imports only when a config asks for them, and how a config says it needs one.

Who declares: the object a ``_target_`` names, beside its code, as class (or function)
attributes; a config schema (``litscale.app.checks.schemas``) the same way for keys that are not
constructor arguments:

- ``requires``: the packages it imports whenever it is used;
- ``requires_when``: key -> package, imported only when that key is set (not null, false or
  ``none``): the Kubernetes launcher's client only with ``submit=true``.

Who reads: ``litscale.app.checks.extras`` walks a composed config's ``_target_``s and schemas
and refuses a missing package in one line (``Requirement.refusal``) before any run dir or rank
exists; the planner prunes a strategy whose package is missing (``litscale.parallel.contract``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Requirement:
    """An optional package: the module litscale imports, the distribution ``pip`` installs,
    and litscale's extra that lists it."""

    module: str
    extra: str
    distribution: str = ""  # the pip name, where it is not the module's
    # Modules that serve instead (Lightning's TensorBoard logger writes with tensorboardX too).
    alternatives: tuple[str, ...] = ()

    @property
    def package(self) -> str:
        return self.distribution or self.module

    def missing(self) -> bool:
        return all(_absent(module) for module in (self.module, *self.alternatives))

    def refusal(self, typed: str) -> str:
        """The one line a user sees: what asked for it (``logger=wandb``), and how to install it."""
        return (f"{typed} needs the {self.package} package, which is not installed; install it with: "
                f"pip install 'litscale[{self.extra}]'")


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a finder that refuses it (an install that blocks it) raises
        return True


# One constant per package a config can need; the extras named here are tested against
# pyproject.toml's (tests/test_extras.py).
DEEPSPEED = Requirement("deepspeed", "extras")
WANDB = Requirement("wandb", "extras")
TENSORBOARD = Requirement("tensorboard", "extras", alternatives=("tensorboardX",))
SCIKIT_LEARN = Requirement("sklearn", "extras", "scikit-learn")
# The SLURM launcher's config (`submitit_slurm`) and `submitit` come with the Hydra plugin.
SUBMITIT_LAUNCHER = Requirement("hydra_plugins.hydra_submitit_launcher", "extras", "hydra-submitit-launcher")
TRANSFORMERS = Requirement("transformers", "hf")
TORCHAO = Requirement("torchao", "fp8")
TORCHFT = Requirement("torchft", "ft")
RAY = Requirement("ray", "ray")
KUBERNETES = Requirement("kubernetes", "k8s")
JSONSCHEMA_K8S = Requirement("jsonschema", "k8s")  # the manifests are checked against their CRD schemas
JSONSCHEMA_SKYPILOT = Requirement("jsonschema", "skypilot")  # the tasks are checked against SkyPilot's schema
SKYPILOT = Requirement("sky", "skypilot", "skypilot")
OPTUNA = Requirement("optuna", "optuna")
