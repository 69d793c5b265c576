"""The reference: a plain Lightning 2-process CPU DDP run, as most scripts are written
(Lightning's own DDPStrategy and launcher; nothing destroys the process group)."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(data, batch_size=16))
