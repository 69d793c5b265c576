"""A run's loss curve: ``train/loss`` and ``val/loss`` at each step they are logged, drawn as
``loss_curve.png`` beside ``summary.json`` (a sweep gets its report; one run, this plot)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class LossCurve(Callback):
    """Keeps ``(step, value)`` of each logged ``train/loss`` and ``val/loss``, as the run logged
    them (the global batch's, synchronised over ranks)."""

    def __init__(self) -> None:
        self.points: dict[str, list[tuple[int, float]]] = {"train/loss": [], "val/loss": []}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._take(trainer, "train/loss")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._take(trainer, "val/loss")

    def _take(self, trainer: Trainer, name: str) -> None:
        value = trainer.callback_metrics.get(name)
        points = self.points[name]
        if value is not None and (not points or points[-1][0] != trainer.global_step):
            points.append((trainer.global_step, float(value)))


def plot_loss_curve(points: dict[str, list[tuple[int, float]]], path: str) -> str | None:
    """The curves as a PNG at ``path``; None without matplotlib (``litscale[extras]``) or points."""
    if not any(points.values()):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, series in points.items():
        if series:
            steps, values = zip(*series, strict=True)
            axes.plot(steps, values, marker="o" if len(series) < 30 else None, markersize=3, label=name)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
