"""A plain Lightning script (no Hydra) using litscale's DDP strategy with a comm hook.

Run as ``python plain_lightning_ddp.py OUT_DIR``: trains a tiny model on 2 CPU processes and
writes, per rank, the name of the comm hook that torch's DDP reports as registered.
"""

import sys
from pathlib import Path

import lightning as L
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.utils.data import DataLoader, TensorDataset

from litscale.compression import CommHook
from litscale.strategies import DDPStrategy


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        hook = self.trainer.strategy.model._get_ddp_logging_data().get("comm_hook", "")
        out = Path(sys.argv[1]) / f"comm_hook_rank{self.global_rank}.txt"
        out.write_text(hook)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=DDPStrategy(compression=CommHook(hook=fp16_compress_hook)),
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=8))
