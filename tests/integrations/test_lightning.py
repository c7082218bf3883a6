"""matrixopt under Lightning on CPU: the configure_optimizers recipe and MatrixoptCallback give our own loop's
losses, and fit resumes from Lightning's checkpoint exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

import matrixopt  # noqa: E402
from matrixopt.integrations.lightning import MatrixoptCallback, configure_optimizers  # noqa: E402

# Lightning runs the same float ops as the plain loop in the same order: measured equal to the last bit.
RTOL = 1e-5
X = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
Y = torch.randn(24, 8, generator=torch.Generator().manual_seed(1))
BATCH, EPOCHS = 8, 2  # 3 steps per epoch


def schedule(step: int) -> float:
    return 1.0 / (1 + step)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.LayerNorm(32),
                         nn.Linear(32, 8))


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = net()
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return configure_optimizers(self, "muon", lr=0.02, weight_decay=0.1, schedule=schedule)


def loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=BATCH, shuffle=False)


def fit(tmp_path, epochs, ckpt=None, module=None):
    module = module or Regression()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[MatrixoptCallback(max_norm=0.5),
                                    pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), every_n_epochs=1,
                                                                 save_top_k=-1)])
    trainer.fit(module, loader(), ckpt_path=ckpt)
    return module, trainer


def test_fit_equals_plain_loop_and_resumes_exactly(tmp_path):
    model = net()
    opt = matrixopt.build_optimizer(model, "muon", lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = []
    for _ in range(EPOCHS):
        for x, y in loader():
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            sched.step()
            ref.append(loss.item())

    module, trainer = fit(tmp_path, EPOCHS)
    assert isinstance(trainer.optimizers[0], matrixopt.Muon)
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(ref), rtol=RTOL, atol=0)
    for p, q in zip(module.net.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-7)

    ckpt = sorted(tmp_path.glob("epoch=0*.ckpt"))[0]
    resumed, _ = fit(tmp_path / "resumed", EPOCHS, ckpt=str(ckpt))
    assert resumed.losses == module.losses[len(ref) // EPOCHS:]
    for p, q in zip(resumed.net.parameters(), module.net.parameters()):
        assert torch.equal(p, q)


def test_callback_checks():
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        MatrixoptCallback(max_norm=0.0)
    with pytest.raises(ValueError, match="interval must be"):
        configure_optimizers(net(), "muon", schedule=schedule, interval="batch")
    out = configure_optimizers(net(), "adamw", lr=1e-3)
    assert set(out) == {"optimizer"} and isinstance(out["optimizer"], torch.optim.AdamW)
