"""``lr_scaling=mup`` against the rest of the config: an optimizer the rule has multipliers for,
a network that declares its widths, and weights it may re-initialise; each refusal one line,
before any rank starts."""

from __future__ import annotations

from omegaconf import DictConfig

from litscale.errors import ConfigError


def base_width_of(cfg: DictConfig) -> int | None:
    return (cfg.get("lr_scaling") or {}).get("base_width")


def width_rule(choices: dict[str, str]) -> str:
    """``lr_scaling=<option>`` as the user typed it."""
    return f"lr_scaling={choices.get('lr_scaling', 'mup')}"


def check_width_options(cfg: DictConfig, choices: dict[str, str]) -> None:
    """The options µP cannot take, named before their own checks (a missing ``from_hf``
    directory is beside the point when µP could not fine-tune it anyway)."""
    if base_width_of(cfg) is None:
        return
    from litscale.optim.mup import SUPPORTED_OPTIMIZERS

    rule = width_rule(choices)
    optimizer = cfg.optimizer._target_
    if optimizer not in SUPPORTED_OPTIMIZERS:
        raise ConfigError(f"{rule} has width multipliers for optimizer=adamw and optimizer=muon (or "
                          f"torch.optim.Adam); got optimizer={choices.get('optimizer', optimizer)}")
    net = cfg.model.get("net")
    if isinstance(net, DictConfig) and net.get("from_hf"):
        raise ConfigError(f"{rule} re-initialises the network's matrices (µP's init), so it cannot fine-tune "
                          f"model.net.from_hf={net.from_hf}; allowed: lr_scaling=none, linear or sqrt")
    if cfg.get("export_hf"):
        raise ConfigError(f"{rule} multiplies the logits and attention scores (µP), which a Hugging Face "
                          "Llama or Qwen3 has no field for: export_hf=true would write another function; "
                          "allowed: export_hf=false with lr_scaling=mup")


def check_declared_widths(cfg: DictConfig, choices: dict[str, str]) -> None:
    """The network, built on the meta device (no memory, no init), declares its widths and can
    be built at ``lr_scaling.base_width``."""
    base_width = base_width_of(cfg)
    if base_width is None:
        return
    import torch

    from litscale.app.build import build, trusted_targets
    from litscale.optim.mup import WidthScaling

    rule = width_rule(choices)
    model = choices.get("model", cfg.model.get("_target_"))
    try:
        with torch.device("meta"):
            net = build(cfg.model.net, trusted=trusted_targets(cfg))
            WidthScaling(net, base_width)
    except ValueError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{rule} with model={model} at lr_scaling.base_width={base_width}: {first}") from None
