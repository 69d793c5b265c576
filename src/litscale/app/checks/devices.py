"""Validation of the devices a run asks for: that they exist on this machine, that the
strategy fits their count, and that the precision runs on their accelerator. Part of
``litscale.app.checks.validation``; every problem a one-line ``ConfigError``."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig

from litscale.app.checks.safety import locate_target
from litscale.errors import ConfigError
from litscale.parallel.contract import contract_value

CPU_PRECISIONS = ("fp32", "bf16_mixed", "bf16_true")


def resolve_accelerator(accelerator: str) -> str:
    """``auto`` -> ``gpu`` when CUDA is visible, else ``cpu``; ``cuda`` is spelled ``gpu``."""
    if accelerator == "auto":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if accelerator == "cuda" else accelerator


def machine_device_count(accelerator: str) -> int:
    if accelerator == "gpu":
        import torch

        return torch.cuda.device_count()
    from litscale.measure.flops import cores

    return cores()


def count_devices(devices: Any, available: int, accelerator: str = "cpu") -> int | None:
    """Processes per node that Lightning's ``devices`` value asks for; None if malformed."""
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int):
        return available if devices == -1 else (devices if devices >= 1 else None)
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return available if accelerator == "gpu" else 1  # Lightning's meaning of "auto"
        if text.lstrip("-").isdigit():
            return count_devices(int(text), available, accelerator)
        parts = [p for p in text.split(",") if p.strip()]
        return len(parts) if parts and all(p.strip().isdigit() for p in parts) else None
    if isinstance(devices, (list, ListConfig)):
        ok = devices and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
        return len(devices) if ok else None
    return None


def check_devices(cfg: DictConfig, choices: dict[str, str], *, this_machine: bool = True,
                  planned: bool = False) -> int:
    """Devices exist on this machine, the strategy fits the count, the precision the accelerator.
    Returns the processes per node. ``this_machine=False``: the job runs elsewhere
    (submitted to SLURM), so the machine-dependent checks wait for the job itself. ``planned``:
    the planner picks the strategy (``plan=show|auto``), so the configured one may be ``single``."""
    accelerator = resolve_accelerator(str(cfg.trainer.get("accelerator", "auto")))
    available = machine_device_count(accelerator)
    if this_machine and accelerator == "gpu" and available == 0:
        raise ConfigError(
            f"trainer.accelerator={cfg.trainer.accelerator} but no CUDA device is visible; "
            "use trainer.accelerator=cpu or auto"
        )
    num_nodes = cfg.trainer.get("num_nodes", 1)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigError(f"trainer.num_nodes={_shown(num_nodes)} is not valid: expected an int >= 1")
    devices = cfg.trainer.get("devices", 1)
    count = count_devices(devices, available, accelerator)
    if count is None:
        raise ConfigError(
            f"trainer.devices={_shown(devices)} is not valid: expected a positive int, -1 (all), "
            "'auto' or a list of device indices"
        )
    unit = "GPUs" if accelerator == "gpu" else "CPU cores"
    # NOTE: gloo ranks can outnumber the cores (each then gets one thread, see app.build): slow,
    # but it tries a 4- or 8-rank layout on a 2-core machine. Only when asked for.
    # A strategy that simulates clients (strategy=federated) runs one per rank whatever the cores.
    oversubscribe = accelerator == "cpu" and (bool((cfg.get("launcher") or {}).get("oversubscribe"))
                                              or _simulates_clients(cfg))
    if this_machine and count > available and not oversubscribe:
        opt_in = (f", or add launcher.oversubscribe=true to run {count} gloo ranks on {available} "
                  "cores, one thread each") if accelerator == "cpu" else ""
        raise ConfigError(
            f"trainer.devices={_shown(devices)} is more than this machine has: {available} {unit} "
            f"(allowed: 1..{available}{opt_in})"
        )
    strategy = choices.get("strategy", "")
    if count * int(cfg.trainer.get("num_nodes", 1)) > 1 and strategy == "single" and not planned:
        raise ConfigError(
            f"strategy=single runs one process but trainer.devices={_shown(devices)}; "
            "use strategy=ddp (or another multi-device strategy)"
        )
    precision = choices.get("precision")
    if this_machine and accelerator == "cpu" and precision and precision not in CPU_PRECISIONS:
        raise ConfigError(
            f"precision={precision} is not supported on cpu; choose one of: {', '.join(CPU_PRECISIONS)}"
        )
    if this_machine and cfg.precision.get("float8"):
        check_float8_machine(precision, accelerator)
    if this_machine and accelerator == "gpu" and "bf16" in cfg.precision.lightning:
        import torch

        if not torch.cuda.is_bf16_supported():
            raise ConfigError(
                f"precision={precision} needs a GPU with bfloat16 (Ampere or newer); use fp16_mixed or fp32"
            )
    return count


def check_float8_machine(precision: str | None, accelerator: str) -> None:
    """Float8 matmuls (torchao's float8 training) need a CUDA GPU of compute capability 8.9+
    (Ada, Hopper, Blackwell); the ``torchao`` package is checked with the other optional
    packages (``litscale.app.checks.extras``)."""
    import torch

    if accelerator != "gpu" or torch.cuda.get_device_capability() < (8, 9):
        found = torch.cuda.get_device_name() if accelerator == "gpu" else "no GPU chosen"
        raise ConfigError(
            f"precision={precision} needs a CUDA GPU of compute capability 8.9 or newer "
            f"(H100, H200, L4, RTX 4090; found: {found}); use precision=bf16_mixed"
        )


def _simulates_clients(cfg: DictConfig) -> bool:
    target = (cfg.get("strategy") or {}).get("_target_")
    return bool(target) and contract_value(locate_target(target, "strategy"), "simulates_clients")


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
