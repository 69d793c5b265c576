"""A plain Lightning script (no Hydra) with litscale's FSDP2 strategy on 2 CPU processes.

The README's example; run as ``python plain_lightning_fsdp.py``.
"""

import lightning as L
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from litscale.strategies import FSDPStrategy


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def sharding_units(self) -> list[nn.Module]:
        return [self.net[0], self.net[2]]  # FSDP gathers and frees these one at a time

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDPStrategy(), max_steps=4,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, DataLoader(data, batch_size=8))
    if all(isinstance(p, DTensor) for p in model.parameters()) and trainer.is_global_zero:
        print(f"fsdp ok: {trainer.world_size} ranks, sharded DTensor parameters")
