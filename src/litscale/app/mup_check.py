"""The coordinate check of µP (Yang et al. 2021, section 8): train a few steps at several widths
and see how large each layer's activations are. Under µP they keep their size as the model
widens; under the standard parametrisation (SP) the later steps' grow with width, which is why
an LR tuned on a narrow model diverges on a wide one.

    python -m litscale.app.mup_check model=gpt widths=64,128,256,512
    python -m litscale.app.mup_check model=llama optimizer=muon widths=64,128,256 steps=5 out=outputs/coord

Other ``key=value`` arguments are the training config's overrides (``optimizer.lr=0.01``,
``data=...``, ``lr_scaling.base_width=64``; the base width is the narrowest by default).
Writes ``mup_check.json``, ``mup_check.md`` (the table) and ``mup_check.png`` (the plot) to
``out`` (default ``outputs/mup_check``). Each layer kind's size is the mean |activation| of its
output, averaged over the layers of that kind, in a forward of the same batch at each step.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict
from torch import nn

CONFIG_DIR = Path(__file__).resolve().parents[3] / "conf"
PARAMETRISATIONS = ("sp", "mup")
TOOL_KEYS = ("widths", "steps", "out", "seed")


@dataclass
class CoordinateCheck:
    """Sizes by parametrisation -> layer kind -> width -> one value per step."""

    widths: list[int]
    steps: int
    base_width: int
    sizes: dict[str, dict[str, dict[int, list[float]]]] = field(default_factory=dict)

    def growth(self, parametrisation: str, step: int = -1) -> dict[str, float]:
        """Per layer kind: its size at the widest width over its size at the narrowest, at ``step``."""
        layers = self.sizes[parametrisation]
        return {kind: by_width[self.widths[-1]][step] / by_width[self.widths[0]][step]
                for kind, by_width in layers.items()}

    def spread(self, parametrisation: str, step: int = -1) -> dict[str, float]:
        """Per layer kind: its largest size over its smallest across the widths, at ``step``."""
        spreads = {}
        for kind, by_width in self.sizes[parametrisation].items():
            values = [by_width[width][step] for width in self.widths]
            spreads[kind] = max(values) / min(values)
        return spreads

    def table(self) -> str:
        header = ["layer", "param.", *(f"width {w}" for w in self.widths), "widest / narrowest"]
        rows = [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}"]
        for parametrisation, layers in self.sizes.items():
            growth = self.growth(parametrisation)
            for kind, by_width in layers.items():
                values = [f"{by_width[w][-1]:.3g}" for w in self.widths]
                rows.append(f"| {kind} | {parametrisation} | {' | '.join(values)} | {growth[kind]:.2f}x |")
        return "\n".join(rows)


def check(overrides: list[str], widths: list[int], *, steps: int = 4, seed: int = 0,
          parametrisations: tuple[str, ...] = PARAMETRISATIONS) -> CoordinateCheck:
    """Train ``steps`` steps at each width under each parametrisation, on the config's data."""
    cfg = compose_config(overrides)
    given = any(o.startswith("lr_scaling.base_width=") for o in overrides)
    base_width = int(cfg.lr_scaling.base_width) if given else widths[0]
    batches = first_batches(cfg, steps)
    result = CoordinateCheck(widths=widths, steps=steps, base_width=base_width)
    for parametrisation in parametrisations:
        result.sizes[parametrisation] = {}
        for width in widths:
            for kind, sizes in train_and_measure(cfg, width, base_width, parametrisation, batches, seed).items():
                result.sizes[parametrisation].setdefault(kind, {})[width] = sizes
    return result


def compose_config(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=["lr_scaling=mup", *overrides])


def first_batches(cfg: DictConfig, count: int, split: str = "train") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``count`` batches of the config's data's ``split`` (train or val): the same for
    every width."""
    from litscale.app.build import build, trusted_targets

    data = build(cfg.data, trusted=trusted_targets(cfg))
    data.prepare_data()
    data.setup("fit")
    batches = []
    for batch in getattr(data, f"{split}_dataloader")():
        batches.append(tuple(batch))
        if len(batches) == count:
            return batches
    raise ValueError(f"steps={count} is more than the data's {len(batches)} {split} batches")


def train_and_measure(cfg: DictConfig, width: int, base_width: int, parametrisation: str,
                      batches: list, seed: int) -> dict[str, list[float]]:
    from litscale.app.build import build, trusted_targets
    from litscale.modules import next_token_loss, optimizer_groups
    from litscale.optim.lr_scaling import ScaledOptimizerFactory
    from litscale.optim.mup import WidthScaling

    trusted = trusted_targets(cfg)
    with open_dict(cfg):
        cfg.model.net.n_embd = width
    torch.manual_seed(seed)
    net = build(cfg.model.net, trusted=trusted)
    factory = build(cfg.optimizer, trusted=trusted)
    groups = optimizer_groups(net, factory, float(cfg.model.get("weight_decay", 0.0)))
    if parametrisation == "mup":  # as the LR-scaling callback applies it
        width_scaling = WidthScaling(net, base_width)
        width_scaling.apply()
        factory = ScaledOptimizerFactory(factory, float(cfg.optimizer.lr), width_scaling)
    optimizer = factory(groups)
    sizes: dict[str, list[float]] = {}
    with ActivationSizes(net, sizes):
        for tokens, targets in batches:
            logits = net(tokens)
            loss = next_token_loss(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return sizes


class ActivationSizes:
    """Forward hooks that append, per layer kind, the mean |output| of each forward: the
    embeddings, each attention and MLP module (digits in names become ``*``) and the logits."""

    def __init__(self, net: nn.Module, sizes: dict[str, list[float]]) -> None:
        self.net, self.sizes, self.handles = net, sizes, []
        self.step: dict[str, list[float]] = {}

    def __enter__(self) -> ActivationSizes:
        for name, module in self.net.named_modules():
            kind = layer_kind(name, module)
            if kind is not None:
                self.handles.append(module.register_forward_hook(self._record(kind)))
        self.handles.append(self.net.register_forward_hook(self._record("logits", last=True)))
        return self

    def _record(self, kind: str, last: bool = False):
        def hook(module, args, output) -> None:
            tensor = output[0] if isinstance(output, tuple) else output
            self.step.setdefault(kind, []).append(float(tensor.detach().float().abs().mean()))
            if last:  # the network's own output: one forward done, average each kind's layers
                for name, values in self.step.items():
                    self.sizes.setdefault(name, []).append(sum(values) / len(values))
                self.step = {}
        return hook

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def layer_kind(name: str, module: nn.Module) -> str | None:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if hasattr(module, "score_multiplier"):
        return re.sub(r"\.\d+\.", ".*.", name)
    if name.rsplit(".", 1)[-1] == "mlp":
        return re.sub(r"\.\d+\.", ".*.", name)
    return None


def plot(result: CoordinateCheck, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(result.sizes)
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True, squeeze=False)
    for axis, parametrisation in zip(axes[0], panels, strict=True):
        for kind, by_width in result.sizes[parametrisation].items():
            axis.plot(result.widths, [by_width[w][-1] for w in result.widths], marker="o", label=kind)
        axis.set(xscale="log", yscale="log", xlabel="width", title=f"{parametrisation}: step {result.steps}")
        axis.set_xticks(result.widths, [str(w) for w in result.widths])
        axis.tick_params(axis="x", which="minor", labelbottom=False)
    axes[0][0].set_ylabel("mean |activation|")
    axes[0][-1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write(result: CoordinateCheck, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "mup_check.json", out / "mup_check.md", out / "mup_check.png"]
    paths[0].write_text(json.dumps({"widths": result.widths, "steps": result.steps, "base_width": result.base_width,
                                    "sizes": result.sizes}, indent=1))
    paths[1].write_text(f"# Coordinate check: mean |activation| at step {result.steps}\n\n{result.table()}\n")
    plot(result, paths[2])
    return paths


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(the tool's own keys, the config's overrides)."""
    tool, overrides = {}, []
    for argument in argv:
        key, _, value = argument.partition("=")
        (tool.__setitem__(key, value) if key in TOOL_KEYS else overrides.append(argument))
    return tool, overrides


def main(argv: list[str]) -> int:
    tool, overrides = parse(argv)
    try:
        widths = sorted(int(w) for w in tool.get("widths", "64,128,256,512").split(","))
        steps = int(tool.get("steps", 4))
    except ValueError:
        print(f"error: widths={tool.get('widths')} steps={tool.get('steps')}: allowed: comma-separated "
              "integers and an integer, e.g. widths=64,128,256 steps=4", file=sys.stderr)
        return 2
    result = check(overrides, widths, steps=steps, seed=int(tool.get("seed", 0)))
    print(result.table())
    for parametrisation in result.sizes:
        worst = max(result.spread(parametrisation).items(), key=lambda item: item[1])
        print(f"litscale: {parametrisation}: the widest spread over widths {worst[1]:.2f}x ({worst[0]})")
    paths = write(result, Path(tool.get("out", "outputs/mup_check")))
    print(f"litscale: wrote {', '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
