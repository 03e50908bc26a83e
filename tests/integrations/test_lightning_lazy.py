"""AsyncFastCkptIO's saves with a real Lightning Trainer: each file holds the state at its
save call while training goes on; a snapshot by default, lazy when declared, and a change
the fence does not cover costs that save (with a warning), never the run."""

from __future__ import annotations

import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.checkpoint import asynchronous, lazy_guard  # noqa: E402
from fastckpt.lightning import AsyncFastCkptIO  # noqa: E402
from tests.checkpoint.test_mutation_matrix import _free, _held_ring  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*number of training batches.*"),
    pytest.mark.filterwarnings("ignore:.*is smaller than the logging interval.*"),
    pytest.mark.filterwarnings("ignore:.*Checkpoint directory .* exists and is not empty.*"),
]

WIDTH = 1024  # two 4 MiB weights and their Adam moments: 24 MiB, three times the ring
RING = 8 << 20


class WideModel(pl.LightningModule):
    """Wide linear layers around a BatchNorm (whose statistics change in the forward pass)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, WIDTH),
            torch.nn.BatchNorm1d(WIDTH),
            torch.nn.Tanh(),
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.Tanh(),
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.Linear(WIDTH, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _loader(batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * batches, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


class _StateAtSave(Callback):
    """A copy of the model and optimizer state at each save call, by global step, and how
    many batches began while the previous step's save was still being written."""

    def __init__(self, dirpath: str):
        self.dirpath = dirpath
        self.at_save: dict[int, dict] = {}
        self.overlapped = 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.at_save[checkpoint["global_step"]] = {
            "state_dict": _clone(checkpoint["state_dict"]),
            "optimizer_states": _clone(checkpoint["optimizer_states"]),
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        io = trainer.strategy.checkpoint_io
        if io.in_flight(os.path.join(self.dirpath, f"step={trainer.global_step}.ckpt")):
            self.overlapped += 1


class _HoldTheRing(Callback):
    """Holds every buffer of the lazy saves' staging ring from the first save on, so the
    save of step 1 waits before its first copy, until :meth:`let_go` (a slow disk, made
    certain)."""

    def __init__(self):
        self.held: list = []
        self.ring = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if checkpoint["global_step"] == 1:
            self.ring = asynchronous.lazy_ring(RING)
            while (buf := self.ring.try_acquire()) is not None:
                self.held.append(buf)

    def let_go(self):
        while self.held:
            self.ring.release(self.held.pop())


class _LetGoAtTheNextBatch(_HoldTheRing):
    """Holds the ring from step 1's save until batch 2 has started (after the capture
    callback, listed first, saw the save in flight): an overlap made certain."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1:
            self.let_go()


class _ChangeWeightsAtBatchStart(_HoldTheRing):
    """An in-place change outside the optimizer (as an EMA callback makes), before the step
    that would fence the save of the previous batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.mul_(0.999)
            self.let_go()


class _LetGoAfterTheStep(_HoldTheRing):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.let_go()  # the optimizer step of batch 2 has changed the weights by now


def _run(tmp_path, io: AsyncFastCkptIO, steps: int, *extra: Callback):
    dirpath = str(tmp_path / "ckpt")
    capture = _StateAtSave(dirpath)
    # Two saves a step (last.ckpt too), both pending at the next step's fence.
    checkpoint = ModelCheckpoint(
        dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1, save_last=True
    )
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        callbacks=[capture, *extra, checkpoint],
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    return trainer, capture, dirpath


def _assert_equal(saved, expected, where: str):
    if isinstance(expected, torch.Tensor):
        assert torch.equal(saved, expected), where
    elif isinstance(expected, dict):
        assert sorted(saved, key=str) == sorted(expected, key=str), where
        for key in expected:
            _assert_equal(saved[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(saved) == len(expected), where
        for i, (a, b) in enumerate(zip(saved, expected)):
            _assert_equal(a, b, f"{where}[{i}]")
    else:
        assert saved == expected, where


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
def test_each_file_holds_the_state_at_its_save_call(tmp_path, lazy):
    io = AsyncFastCkptIO(lazy=lazy, staging_bytes=RING)
    trainer, capture, dirpath = _run(tmp_path, io, 4, *([_LetGoAtTheNextBatch()] if lazy else []))
    trainer.fit(WideModel(), _loader(4))
    assert sorted(capture.at_save) == [1, 2, 3, 4]
    for step, expected in capture.at_save.items():
        saved = fastckpt.load(os.path.join(dirpath, f"step={step}.ckpt"))
        assert saved["global_step"] == step
        _assert_equal(saved["state_dict"], expected["state_dict"], f"step {step} weights")
        _assert_equal(saved["optimizer_states"], expected["optimizer_states"], f"step {step} adam")
    first, last = capture.at_save[1]["state_dict"], capture.at_save[4]["state_dict"]
    assert not torch.equal(first["net.0.weight"], last["net.0.weight"])  # training moved on
    assert not torch.equal(first["net.1.running_mean"], last["net.1.running_mean"])
    if lazy:  # step 1's save, held back, was still writing when batch 2 began
        assert capture.overlapped >= 1


def test_a_capped_fence_waits_and_still_saves_the_state_at_the_call(tmp_path):
    io = AsyncFastCkptIO(lazy=True, staging_bytes=RING, fence_bytes=0)
    trainer, capture, dirpath = _run(tmp_path, io, 3)
    trainer.fit(WideModel(), _loader(3))
    for step, expected in capture.at_save.items():
        saved = fastckpt.load(os.path.join(dirpath, f"step={step}.ckpt"))
        _assert_equal(saved["state_dict"], expected["state_dict"], f"step {step} weights")


def test_a_change_outside_the_optimizer_costs_that_save_not_the_run(tmp_path):
    io = AsyncFastCkptIO(lazy=True, staging_bytes=RING)
    trainer, capture, dirpath = _run(tmp_path, io, 3, _ChangeWeightsAtBatchStart())
    with pytest.warns(UserWarning, match="was not committed") as record:
        trainer.fit(WideModel(), _loader(3))
    assert any("step=1.ckpt was not committed" in str(w.message) for w in record)
    assert trainer.global_step == 3
    names = sorted(os.listdir(dirpath))
    assert "step=1.ckpt" not in names and "step=3.ckpt" in names
    for name in names:  # whatever was committed is a complete file of the state at its call
        assert not name.endswith(".tmp")
        saved = fastckpt.load(os.path.join(dirpath, name))
        expected = capture.at_save[saved["global_step"]]
        _assert_equal(saved["state_dict"], expected["state_dict"], name)
    assert io._withdrawn  # the saves after the warning were snapshots


def test_without_the_fence_the_optimizer_step_costs_the_save(tmp_path, monkeypatch):
    monkeypatch.setattr(lazy_guard, "_fence_pending_saves", lambda *_: None)
    io = AsyncFastCkptIO(lazy=True, staging_bytes=RING)
    trainer, _, dirpath = _run(tmp_path, io, 3, _LetGoAfterTheStep())
    with pytest.warns(UserWarning, match="changed after async_save"):
        trainer.fit(WideModel(), _loader(3))
    assert not os.path.exists(os.path.join(dirpath, "step=1.ckpt"))


class ClampedModel(WideModel):
    """Clamps its weights after every batch, outside the optimizer step (as a WGAN critic)."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.02, 0.02)


@pytest.mark.parametrize("lazy", [None, True], ids=["default", "lazy"])
def test_a_module_that_clamps_outside_the_step_saves_the_state_at_each_call(tmp_path, lazy):
    """Files of every save call (default), or of every call but the lazy one the clamp
    spoiled, saved again at the end of training when it was the last (lazy)."""
    from fastckpt.lightning import FastCkptCheckpoint

    io = AsyncFastCkptIO(lazy=lazy, staging_bytes=RING)
    dirpath = str(tmp_path / "ckpt")
    capture = _StateAtSave(dirpath)
    checkpoint = FastCkptCheckpoint(
        dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1
    )
    hold = _HoldTheRing()  # step 1's lazy save waits until the clamp has run
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        accelerator="cpu",
        devices=1,
        callbacks=[capture, hold, checkpoint],
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    model = ClampedModel()
    # the clamp has run: let step 1's save go on, and see how it ended before step 2's save
    model.on_train_batch_start = lambda batch, batch_idx: (hold.let_go(), io.settle())
    if lazy:
        with pytest.warns(UserWarning, match=r"lazy save of .*step=1\.ckpt was not committed"):
            trainer.fit(model, _loader(3))
    else:
        trainer.fit(model, _loader(3))
    names = sorted(os.listdir(dirpath))
    assert names == (
        ["step=2.ckpt", "step=3.ckpt"] if lazy else [f"step={s}.ckpt" for s in (1, 2, 3)]
    )
    for name in names:
        saved = fastckpt.load(os.path.join(dirpath, name))
        expected = capture.at_save[saved["global_step"]]
        _assert_equal(saved["state_dict"], expected["state_dict"], name)
        _assert_equal(saved["optimizer_states"], expected["optimizer_states"], name)


class _ClampedFromStep2(ClampedModel):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step >= 2:
            super().on_train_batch_end(outputs, batch, batch_idx)


class _HoldTheLastSave(_HoldTheRing):
    """Holds the ring from the save of step 2 (the last) on, so the clamp after it spoils
    that save; lets go when training ends (before the callback's end, listed after)."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if checkpoint["global_step"] == 2 and self.ring is None:
            self.ring = asynchronous.lazy_ring(RING)
            while (buf := self.ring.try_acquire()) is not None:
                self.held.append(buf)

    def on_train_end(self, trainer, pl_module):
        self.let_go()


def test_a_spoiled_lazy_save_of_the_last_step_is_saved_again_at_the_end(tmp_path):
    from fastckpt.lightning import FastCkptCheckpoint

    io = AsyncFastCkptIO(lazy=True, staging_bytes=RING)
    dirpath = str(tmp_path / "ckpt")
    checkpoint = FastCkptCheckpoint(dirpath=dirpath, filename="last", every_n_train_steps=1)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        accelerator="cpu",
        devices=1,
        callbacks=[_HoldTheLastSave(), checkpoint],
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    model = _ClampedFromStep2()
    with pytest.warns(UserWarning, match="was not committed"):
        trainer.fit(model, _loader(2))
    saved = fastckpt.load(os.path.join(dirpath, "last.ckpt"))
    assert saved["global_step"] == 2
    assert torch.equal(saved["state_dict"]["net.0.weight"], model.net[0].weight)


class _OwnStep(torch.optim.SGD):
    """An optimizer with a step of its own: it may change parameters before its closure."""

    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize(
    ("make", "order"),
    [
        (lambda ps: torch.optim.Adam(ps, lr=0.1), ["closure", "fence"]),
        (lambda ps: _OwnStep(ps, lr=0.1), ["fence", "closure"]),
    ],
    ids=["torch-optimizer", "own-step"],
)
def test_the_fence_follows_the_closure_of_torch_optimizers(tmp_path, make, order):
    model = torch.nn.Linear(8, 8)
    optimizer = make(model.parameters())
    held = _held_ring(8 << 20)  # the writer copies nothing before the step: its fence runs
    try:
        future = fastckpt.async_save(
            model.state_dict(),
            str(tmp_path / "f.safetensors"),
            fence=optimizer,
            staging_bytes=8 << 20,
        )
        events: list[str] = []
        guard = future._guard
        fence = guard.fence
        guard.fence = lambda: (events.append("fence"), fence())[1]

        def closure():
            events.append("closure")
            loss = model(torch.ones(2, 8)).sum()
            loss.backward()
            return loss

        optimizer.step(closure)
    finally:
        _free(held)
    future.result()
    # A subclass whose step calls super().step() runs the step hooks twice (torch patches
    # both classes' step): a second fence of the same save, at once, changes no order.
    distinct = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    assert distinct[:2] == order
    assert not lazy_guard._fenced.get(optimizer)  # the fence went with the save
    events.clear()
    optimizer.step(closure)  # no save pending: no fence
    assert events == ["closure"]
