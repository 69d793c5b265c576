"""What kind of strategy a job runs, as the cluster launchers ask it (Ray's elastic workers and
URI storage, Kubernetes' elastic PyTorchJob): one place, imported by each launcher's settings
and by nothing of the app (preflight imports those settings)."""

from __future__ import annotations


def is_data_parallel(strategy_target: str) -> bool:
    """Whether the strategy keeps a whole replica on every rank and steps them together (the
    DDP family): the one kind of job that runs on any number of workers, and whose rank 0
    alone writes the checkpoint. Asked of the strategy's contract."""
    from hydra.utils import get_class

    from litscale.strategies.ddp import DDPStrategy

    try:
        strategy = get_class(strategy_target)
    except Exception:  # noqa: BLE001 - not a class here: validation names it later
        return False
    return issubclass(strategy, DDPStrategy) and strategy.ranks_step_together
