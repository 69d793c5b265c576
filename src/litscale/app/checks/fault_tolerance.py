"""``fault_tolerance=replicas`` against the rest of the config: each refusal one line, before
any rank starts (the strategy's own answer is the contract's, ``Option.REPLICA_GROUPS``)."""

from __future__ import annotations

from omegaconf import DictConfig

from litscale.errors import ConfigError
from litscale.parallel.layout import RunLayout

KEY = "fault_tolerance"


def replicas_chosen(cfg: DictConfig) -> bool:
    return "_target_" in (cfg.get(KEY) or {})


def replica_groups(cfg: DictConfig) -> int:
    """How many copies of the layout train together (1 without replica groups)."""
    return int(cfg[KEY].groups) if replicas_chosen(cfg) else 1


def check_fault_tolerance(cfg: DictConfig, choices: dict[str, str], layout: RunLayout, *,
                          this_machine: bool = True) -> None:
    """Replica groups are asked for where they can run and average what they claim to (the keys'
    types and ranges: ``ReplicaGroups``' fields, checked with the other ``_target_``s)."""
    from litscale.app.launch import launched_externally

    if not replicas_chosen(cfg):
        return
    typed = f"{KEY}={choices.get(KEY, 'replicas')}"
    ft = cfg[KEY]
    if ft.min_replicas > ft.groups:
        raise ConfigError(f"{KEY}.min_replicas={ft.min_replicas} is more than the {ft.groups} groups "
                          f"({KEY}.groups); allowed: 1 to {ft.groups}")
    if layout.num_nodes > 1 or launched_externally():
        raise ConfigError(f"{typed} starts its groups' ranks on this machine itself; trainer.num_nodes="
                          f"{layout.num_nodes}{' under an external launcher' if launched_externally() else ''} "
                          "is not supported; allowed: trainer.num_nodes=1 with litscale's own launcher "
                          "(python train.py, no torchrun or srun)")
    for group, why in (("compression", "the groups average the gradients uncompressed, so the compression "
                                        "would stop at a group's edge"),
                       ("determinism", "the groups' average is a reduction outside the fixed order the "
                                       "mode proves")):
        if "_target_" in (cfg.get(group) or {}):
            raise ConfigError(f"{group}={choices.get(group, cfg[group]._target_)} is not supported with {typed}: "
                              f"{why}; allowed: {group}=none, or fault_tolerance=none")
    if this_machine:
        check_every_group_fits(cfg, layout, typed)
    if cfg.precision.lightning == "16-mixed":
        raise ConfigError(f"precision={choices.get('precision', 'fp16_mixed')} is not supported with {typed}: "
                          "each group's loss scaler would skip steps the others take; allowed: "
                          "precision=fp32, bf16_mixed or bf16_true")


def check_every_group_fits(cfg: DictConfig, layout: RunLayout, typed: str) -> None:
    """Every group has devices of its own on this machine (GPUs are split between the groups;
    CPU ranks beyond the cores only with launcher.oversubscribe=true, as for one job)."""
    from litscale.app.checks.devices import machine_device_count, resolve_accelerator

    accelerator = resolve_accelerator(str(cfg.trainer.get("accelerator", "auto")))
    available, ranks = machine_device_count(accelerator), layout.replica_processes
    oversubscribe = accelerator == "cpu" and bool((cfg.get("launcher") or {}).get("oversubscribe"))
    if ranks > available and not oversubscribe:
        unit = "GPUs" if accelerator == "gpu" else "CPU cores"
        opt_in = ", or add launcher.oversubscribe=true (CPU ranks of one thread each)" if accelerator == "cpu" else ""
        raise ConfigError(f"{typed} runs {layout.replica_groups} groups x trainer.devices={layout.processes_per_node} "
                          f"= {ranks} ranks, more than this machine's {available} {unit}; allowed: "
                          f"{KEY}.groups x trainer.devices <= {available}{opt_in}")
