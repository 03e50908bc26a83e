"""fastckpt.lightning with a real Lightning Trainer on CPU: resume, top-k, async saves, failures."""

from __future__ import annotations

import argparse
import errno
import functools
import http.server
import importlib
import inspect
import os
import pickle
import resource
import subprocess
import sys
import threading
from collections import OrderedDict

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import TorchCheckpointIO  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.lightning import (  # noqa: E402
    AsyncFastCkptIO,
    FastCkptCheckpoint,
    FastCkptIO,
    FastCkptLoadingMixin,
    load_from_checkpoint,
)

# Lightning's advice for a CPU-only test run (workers, logging intervals) and its use of a
# torch API that newer torch deprecates are not the subject here.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*number of training batches.*"),
    pytest.mark.filterwarnings("ignore:.*but have no `val_dataloader`.*"),
    pytest.mark.filterwarnings("ignore:.*is smaller than the logging interval.*"),
    pytest.mark.filterwarnings("ignore:.*Checkpoint directory .* exists and is not empty.*"),
]


class TinyModel(pl.LightningModule):
    """Two linear layers, Adam and a StepLR; logs ``val_loss`` or a scripted ``score``."""

    def __init__(self, hidden: int = 8, lr: float = 0.05, scores: list | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("step_score", float(self.global_step))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))
        if self.hparams.scores is not None:
            self.log("score", float(self.hparams.scores[self.current_epoch]))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def _loader(n: int = 16, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def _trainer(root, max_epochs: int, callbacks=(), plugins=(), **kwargs) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        callbacks=list(callbacks),
        plugins=list(plugins),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _model(**hparams) -> TinyModel:
    torch.manual_seed(0)
    return TinyModel(**hparams)


class _Capture(Callback):
    """What the Trainer holds right after restoring and at the end of training."""

    def on_train_start(self, trainer, pl_module):
        self.start = _state_of(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self.end = _state_of(trainer, pl_module)


def _state_of(trainer, module) -> dict:
    return {
        "weights": {k: v.clone() for k, v in module.state_dict().items()},
        "optimizer": trainer.optimizers[0].state_dict(),
        "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


def _assert_same(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _fit_then_resume(root, variant: str):
    """Fits 2 epochs, resumes from ``last.ckpt`` into a fresh Trainer for a third; returns
    the first checkpoint's path and the resumed run's capture."""

    def setup(run: str):
        dirpath = os.path.join(root, "ckpt")
        if variant == "callback":
            return [FastCkptCheckpoint(dirpath=dirpath, save_last=True)], []
        plugin = {"torch": TorchCheckpointIO, "sync": FastCkptIO, "async": AsyncFastCkptIO}[variant]
        return [ModelCheckpoint(dirpath=dirpath, save_last=True)], [plugin()]

    callbacks, plugins = setup("first")
    _trainer(root, 2, callbacks, plugins).fit(_model(), _loader(), _loader(8))
    last = os.path.join(root, "ckpt", "last.ckpt")
    capture = _Capture()
    callbacks, plugins = setup("resumed")
    _trainer(root, 3, [*callbacks, capture], plugins).fit(
        _model(), _loader(), _loader(8), ckpt_path=last
    )
    return last, capture


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    """The reference: the same runs with Lightning's default TorchCheckpointIO."""
    return _fit_then_resume(str(tmp_path_factory.mktemp("torch")), "torch")[1]


@pytest.mark.parametrize("variant", ["sync", "async", "callback"])
def test_resume_matches_torch_checkpoint_io(tmp_path, torch_run, variant):
    last, capture = _fit_then_resume(str(tmp_path), variant)
    with open(last, "rb") as f:
        assert f.read(2) != b"PK"  # a fastckpt file, not torch.save's zip
    assert capture.start["epoch"] == torch_run.start["epoch"] == 2
    assert capture.start["global_step"] == torch_run.start["global_step"] == 8
    _assert_same(capture.start, torch_run.start)
    _assert_same(capture.end, torch_run.end)


def _verify_cli(paths):
    out = subprocess.run(
        [sys.executable, "-m", "fastckpt", "verify", *paths],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("OK") >= len(paths)


def _assert_valid(paths):
    _verify_cli(paths)
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                assert f.get_tensor(key).numel() >= 0


def _checkpoints(dirpath) -> set:
    return set(os.listdir(dirpath))


@pytest.mark.parametrize("variant", ["sync", "async", "callback"])
def test_top_k_keeps_exactly_the_best(tmp_path, variant):
    dirpath = str(tmp_path / "ckpt")
    options = dict(dirpath=dirpath, filename="{epoch}", monitor="score", mode="min", save_top_k=2)
    if variant == "callback":
        callbacks, plugins = [FastCkptCheckpoint(save_last=True, **options)], []
    else:
        plugin = FastCkptIO() if variant == "sync" else AsyncFastCkptIO()
        callbacks, plugins = [ModelCheckpoint(save_last=True, **options)], [plugin]
    model = _model(scores=[3.0, 1.0, 2.0, 0.5, 4.0])
    _trainer(tmp_path, 5, callbacks, plugins).fit(model, _loader(8), _loader(4))
    assert _checkpoints(dirpath) == {"epoch=1.ckpt", "epoch=3.ckpt", "last.ckpt"}
    _assert_valid([os.path.join(dirpath, name) for name in sorted(_checkpoints(dirpath))])
    best = fastckpt.load(os.path.join(dirpath, "epoch=3.ckpt"))
    assert best["epoch"] == 3
    assert best["callbacks"]  # ModelCheckpoint's own state travels in the file


def test_async_saves_every_step(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    callback = FastCkptCheckpoint(
        dirpath=dirpath,
        filename="{step}",
        monitor="step_score",
        mode="max",
        save_top_k=2,
        save_last=True,
        every_n_train_steps=1,
    )
    trainer = _trainer(tmp_path, 1, [callback])
    trainer.fit(_model(), _loader(n=24, batch_size=2))
    assert isinstance(trainer.strategy.checkpoint_io, AsyncFastCkptIO)
    assert _checkpoints(dirpath) == {"step=11.ckpt", "step=12.ckpt", "last.ckpt"}
    _assert_valid([os.path.join(dirpath, name) for name in sorted(_checkpoints(dirpath))])
    assert fastckpt.load(os.path.join(dirpath, "last.ckpt"))["global_step"] == 12


class _AtStep(Callback):
    """Calls ``action(dirpath)`` once, after the optimizer step that makes ``global_step``."""

    def __init__(self, global_step: int, action, dirpath: str):
        self.global_step, self.action, self.dirpath = global_step, action, dirpath
        self.done = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.global_step and not self.done:
            self.done = True
            self.action(self.dirpath)


def _failing_run(tmp_path, action, fail_at: int = 5):
    dirpath = str(tmp_path / "ckpt")
    callback = FastCkptCheckpoint(
        dirpath=dirpath,
        filename="{step}",
        monitor="step_score",
        mode="max",
        save_top_k=2,
        every_n_train_steps=1,
        enable_version_counter=False,
    )
    trigger = _AtStep(fail_at, action, dirpath)
    trainer = _trainer(tmp_path, 1, [trigger, callback])
    return trainer, dirpath


def _valid_before_failure(dirpath, fail_at: int):
    # The two best checkpoints that existed when the failing save began are still there.
    kept = {f"step={fail_at - 2}.ckpt", f"step={fail_at - 1}.ckpt"}
    assert kept <= _checkpoints(dirpath)
    _assert_valid([os.path.join(dirpath, name) for name in sorted(kept)])
    assert not [name for name in _checkpoints(dirpath) if name.endswith(".tmp")]


def test_async_full_disk_reaches_the_user_and_keeps_checkpoints(tmp_path):
    # RLIMIT_FSIZE makes the kernel refuse to grow files, as a full disk does (EFBIG here).
    old = resource.getrlimit(resource.RLIMIT_FSIZE)

    def fill_disk(_dirpath):
        # Earlier saves first: the limit is process-wide and would hit their writes too.
        trainer.strategy.checkpoint_io.wait()
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, old[1]))

    trainer, dirpath = _failing_run(tmp_path, fill_disk)
    try:
        with pytest.raises(OSError) as info:
            trainer.fit(_model(), _loader(n=24, batch_size=2))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    assert info.value.errno == errno.EFBIG
    assert info.value.filename and info.value.filename.startswith(dirpath)
    _valid_before_failure(dirpath, 5)


def test_async_failure_in_background_keeps_the_checkpoint_it_would_replace(tmp_path):
    # The save of step 5 snapshots fine, then cannot be renamed into place (a directory sits
    # at its path); top-k asks meanwhile to delete step=3.ckpt, which must survive.
    def block_next_path(dirpath):
        os.makedirs(os.path.join(dirpath, "step=5.ckpt", "occupied"))

    trainer, dirpath = _failing_run(tmp_path, block_next_path)
    with pytest.raises(IsADirectoryError) as info:
        trainer.fit(_model(), _loader(n=24, batch_size=2))
    assert "step=5.ckpt" in str(info.value.filename)
    _valid_before_failure(dirpath, 5)


def test_plugin_file_loads_outside_lightning(tmp_path):
    io = FastCkptIO()
    model = _model()
    trainer = _trainer(tmp_path, 1, [ModelCheckpoint(dirpath=tmp_path / "ckpt")], [io])
    trainer.fit(model, _loader())
    (path,) = [os.path.join(tmp_path, "ckpt", n) for n in os.listdir(tmp_path / "ckpt")]
    state = fastckpt.load(path)
    assert state["epoch"] == 0 and state["global_step"] == 4
    _assert_same(dict(state["state_dict"]), dict(model.state_dict()))
    assert state["hyper_parameters"] == {"hidden": 8, "lr": 0.05, "scores": None}
    assert set(state["optimizer_states"][0]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["lr_schedulers"][0]["last_epoch"] == 1


@pytest.mark.parametrize("weights_only_file", [False, True])
def test_load_from_checkpoint_builds_the_module_from_a_fastckpt_file(tmp_path, weights_only_file):
    dirpath = tmp_path / "ckpt"
    callback = FastCkptCheckpoint(
        dirpath=dirpath, filename="last", save_weights_only=weights_only_file, asynchronous=False
    )
    model = _model(hidden=6, lr=0.01)
    _trainer(tmp_path, 1, [callback]).fit(model, _loader())
    path = dirpath / "last.ckpt"
    # Lightning's own class method reads it too, fastckpt.lightning being imported
    _assert_same(dict(TinyModel.load_from_checkpoint(path).state_dict()), dict(model.state_dict()))
    back = load_from_checkpoint(TinyModel, path)
    assert isinstance(back, TinyModel) and back.hparams.hidden == 6 and back.hparams.lr == 0.01
    _assert_same(dict(back.state_dict()), dict(model.state_dict()))
    # keyword arguments override saved hyper-parameters, as in Lightning
    assert load_from_checkpoint(TinyModel, path, lr=0.5).hparams.lr == 0.5
    # a torch.save checkpoint of the same module loads through the same call
    torch_path = tmp_path / "torch.ckpt"
    TorchCheckpointIO().save_checkpoint(FastCkptIO().load_checkpoint(path), torch_path)
    _assert_same(
        dict(load_from_checkpoint(TinyModel, torch_path).state_dict()), dict(model.state_dict())
    )


def test_load_from_checkpoint_refuses_what_it_cannot_build(tmp_path):
    with pytest.raises(TypeError, match="LightningModule"):
        load_from_checkpoint(torch.nn.Linear, tmp_path / "x.ckpt")
    with pytest.raises(FileNotFoundError) as info:
        load_from_checkpoint(TinyModel, tmp_path / "missing.ckpt")
    assert info.value.filename == str(tmp_path / "missing.ckpt")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_weights_only_is_a_flat_safetensors_file(tmp_path, asynchronous):
    dirpath = tmp_path / "ckpt"
    callback = FastCkptCheckpoint(
        dirpath=dirpath, filename="weights", save_weights_only=True, asynchronous=asynchronous
    )
    model = _model()
    trainer = _trainer(tmp_path, 1, [callback])
    trainer.fit(model, _loader(), _loader(8))
    path = str(dirpath / "weights.ckpt")
    weights = safetensors_torch.load_file(path)
    assert sorted(weights) == sorted(model.state_dict())
    _assert_same(dict(sorted(weights.items())), dict(sorted(model.state_dict().items())))
    # Lightning reads it back whole: the epoch and hyper-parameters sit in the metadata.
    loaded = trainer.strategy.checkpoint_io.load_checkpoint(path)
    assert loaded["global_step"] == 4 and loaded["hyper_parameters"]["hidden"] == 8
    assert isinstance(loaded["state_dict"], OrderedDict)
    _assert_same(dict(loaded["state_dict"]), dict(model.state_dict()))  # in its own order
    assert loaded["state_dict"]._metadata == model.state_dict()._metadata
    trainer.validate(_model(), _loader(8), ckpt_path=path, verbose=False)


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*")
def test_resume_from_a_torch_checkpoint(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    _trainer(tmp_path, 1, [ModelCheckpoint(dirpath=dirpath, filename="torch")]).fit(
        _model(), _loader()
    )
    capture = _Capture()
    callback = FastCkptCheckpoint(dirpath=dirpath, filename="fast")
    _trainer(tmp_path, 2, [callback, capture]).fit(
        _model(), _loader(), ckpt_path=os.path.join(dirpath, "torch.ckpt")
    )
    assert capture.start["global_step"] == 4 and capture.end["global_step"] == 8
    assert fastckpt.load(os.path.join(dirpath, "fast.ckpt"))["global_step"] == 8


class _Activation(pl.LightningModule):
    def __init__(self, activation=torch.nn.ReLU):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _WithObjects(pl.LightningModule):
    """Hyper-parameters that hold objects, not data: a file system and a loss module."""

    def __init__(self, fs=None, loss=None, cfg=None, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


@pytest.mark.filterwarnings("ignore:Attribute 'loss' is an instance of `nn.Module`")
def test_hyperparameters_that_are_no_data_are_left_out_with_one_warning(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    dirpath = tmp_path / "ckpt"
    callback = FastCkptCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    model = _WithObjects(
        fs=fsspec.filesystem("memory"),
        loss=torch.nn.MSELoss(),
        cfg={"fs": fsspec.filesystem("memory"), "k": 2},
    )
    with pytest.warns(UserWarning, match="left out") as record:
        _trainer(tmp_path, 1, [callback]).fit(model, _loader())
    ours = [str(w.message) for w in record if "left out" in str(w.message)]
    assert len(ours) == 1  # one warning for the run, naming each
    message = ours[0]
    assert all(
        n in message
        for n in ("hyper_parameters.fs", "hyper_parameters.loss", "hyper_parameters.cfg.fs")
    )
    assert len(os.listdir(dirpath)) == 4  # every step saved
    saved = fastckpt.load(str(dirpath / "epoch=0-step=4.ckpt"))
    assert saved["hyper_parameters"] == {"cfg": {"k": 2}, "lr": 0.1}
    back = _WithObjects.load_from_checkpoint(
        str(dirpath / "epoch=0-step=4.ckpt"), loss=torch.nn.L1Loss()
    )
    assert isinstance(back.hparams.loss, torch.nn.L1Loss) and back.hparams.cfg == {"k": 2}


def test_objects_outside_the_hyperparameters_are_refused_with_their_place(tmp_path):
    with pytest.raises(TypeError) as info:
        FastCkptIO().save_checkpoint({"extra": {"f": object()}}, str(tmp_path / "x.ckpt"))
    assert "['extra']['f']" in str(info.value) and "allow_pickle=True" in str(info.value)
    assert not list(tmp_path.glob("*"))  # refused before anything is written


def test_allow_pickle_stores_it_and_needs_weights_only_false(tmp_path):
    dirpath = tmp_path / "ckpt"
    _trainer(tmp_path, 1, [FastCkptCheckpoint(dirpath=dirpath, allow_pickle=True)]).fit(
        _Activation(), _loader()
    )
    (path,) = [str(dirpath / n) for n in os.listdir(dirpath)]
    io = FastCkptIO()
    with pytest.raises(pickle.UnpicklingError):
        io.load_checkpoint(path)
    assert io.load_checkpoint(path, weights_only=False)["hyper_parameters"]["activation"] is (
        torch.nn.ReLU
    )
    capture = _Capture()
    callback = FastCkptCheckpoint(dirpath=dirpath, allow_pickle=True)
    trainer = _trainer(tmp_path, 2, [callback, capture])
    trainer.fit(_Activation(), _loader(), ckpt_path=path, weights_only=False)
    assert capture.end["global_step"] == 8


def test_lightning_containers_round_trip_without_pickle(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    from lightning.pytorch.utilities.parsing import AttributeDict

    config = omegaconf.OmegaConf.create({"model": {"width": 8}, "twice": "${model.width}"})
    checkpoint = {
        "state_dict": OrderedDict(w=torch.ones(2)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(1.0)}}}],
        "hyper_parameters": config,
        "hparams_type": type(config),
        "extra": {"ns": argparse.Namespace(a=1, b=[1, 2]), "attrs": AttributeDict(x=0.5)},
        "list_config": omegaconf.OmegaConf.create([1, {"k": "v"}]),
    }
    io = FastCkptIO()
    path = str(tmp_path / "hp.ckpt")
    io.save_checkpoint(checkpoint, path)
    back = io.load_checkpoint(path)
    assert isinstance(back["hyper_parameters"], omegaconf.DictConfig)
    assert back["hyper_parameters"].twice == 8  # interpolations survive, unresolved
    assert back["hparams_type"] is omegaconf.DictConfig
    assert back["extra"]["ns"] == argparse.Namespace(a=1, b=[1, 2])
    assert type(back["extra"]["attrs"]) is AttributeDict and back["extra"]["attrs"].x == 0.5
    assert isinstance(back["list_config"], omegaconf.ListConfig)
    assert back["list_config"][1].k == "v"
    # Outside Lightning, one encoding: fastckpt.load gives the same objects back.
    raw = fastckpt.load(path)
    assert isinstance(raw["hyper_parameters"], omegaconf.DictConfig)
    assert omegaconf.OmegaConf.to_container(raw["hyper_parameters"]) == {
        "model": {"width": 8},
        "twice": "${model.width}",
    }
    assert raw["hparams_type"] is omegaconf.DictConfig
    assert type(raw["extra"]["attrs"]) is AttributeDict


def test_omegaconf_hyperparameters_resume(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")

    class ConfModel(_Activation):
        def __init__(self, cfg):
            pl.LightningModule.__init__(self)
            self.save_hyperparameters(cfg)
            self.net = torch.nn.Linear(4, 1)

    cfg = omegaconf.OmegaConf.create({"lr": 0.1, "layers": [4, 1]})
    dirpath = tmp_path / "ckpt"
    _trainer(tmp_path, 1, [FastCkptCheckpoint(dirpath=dirpath, filename="c")]).fit(
        ConfModel(cfg), _loader()
    )
    capture = _Capture()
    trainer = _trainer(tmp_path, 2, [FastCkptCheckpoint(dirpath=dirpath, filename="d"), capture])
    trainer.fit(ConfModel(cfg), _loader(), ckpt_path=str(dirpath / "c.ckpt"))
    assert capture.start["global_step"] == 4
    assert FastCkptIO().load_checkpoint(str(dirpath / "d.ckpt"))["hparams_type"] is (
        omegaconf.DictConfig
    )


@pytest.mark.parametrize("make", [FastCkptIO, AsyncFastCkptIO], ids=["sync", "async"])
def test_storage_options_go_to_fsspec_for_a_url(s3, tmp_path, make):
    bucket, options, fs = s3
    io = make()
    checkpoint = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 3}
    io.save_checkpoint(checkpoint, f"{bucket}/x.ckpt", storage_options=options)
    io.save_checkpoint(checkpoint, str(tmp_path / "x.ckpt"), storage_options=options)  # unused
    io.teardown()
    assert fs.exists(f"{bucket}/x.ckpt".split("://", 1)[1])
    assert fastckpt.load(str(tmp_path / "x.ckpt"))["global_step"] == 3
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(checkpoint, str(tmp_path / "y.ckpt"), storage_options="key=1")


def test_teardown_leaves_no_thread_and_no_temporary_file(tmp_path):
    dirpath = tmp_path / "ckpt"
    before = set(threading.enumerate())
    # top-1 by a score that changes every step: a removal after every save
    callback = FastCkptCheckpoint(
        dirpath=dirpath, every_n_train_steps=1, monitor="step_score", mode="max", save_top_k=1
    )
    _trainer(tmp_path, 2, [callback]).fit(_model(), _loader())
    assert sorted(os.listdir(dirpath)) == [os.path.basename(callback.best_model_path)]
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not [n for n in left if n.startswith(("fastckpt-remove", "fastckpt-save"))], left


def test_callback_refuses_a_foreign_checkpoint_io(tmp_path):
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    trainer = _trainer(tmp_path, 1, [FastCkptCheckpoint(dirpath=tmp_path)], [AsyncCheckpointIO()])
    with pytest.raises(ValueError, match="AsyncCheckpointIO"):
        trainer.fit(_model(), _loader())


def test_import_error_names_the_extra(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)
    for name in [n for n in sys.modules if n.startswith("fastckpt.integrations.lightning")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "fastckpt.lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install lightning .*'\.\[lightning\]'"):
        importlib.import_module("fastckpt.lightning")


def test_plugins_work_with_the_standalone_pytorch_lightning(tmp_path):
    spl = pytest.importorskip("pytorch_lightning")
    if spl.Trainer is pl.Trainer:
        pytest.skip("pytorch_lightning is lightning.pytorch here")

    class Standalone(spl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.1)

    def run(max_epochs, ckpt_path=None):
        torch.manual_seed(0)
        trainer = spl.Trainer(
            max_epochs=max_epochs,
            default_root_dir=tmp_path,
            plugins=[AsyncFastCkptIO()],
            callbacks=[spl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="s")],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Standalone(), _loader(), ckpt_path=ckpt_path)
        return trainer

    run(1)
    assert fastckpt.load(str(tmp_path / "s.ckpt"))["global_step"] == 4
    assert run(2, ckpt_path=str(tmp_path / "s.ckpt")).global_step == 8


def test_missing_checkpoint_names_the_file(tmp_path):
    missing = str(tmp_path / "none.ckpt")
    with pytest.raises(FileNotFoundError) as info:
        AsyncFastCkptIO().load_checkpoint(missing)
    assert info.value.filename == missing and info.value.errno == errno.ENOENT


# -- torch.save files of every kind -----------------------------------------------------------


# torch's weights-only unpickler says it was written for protocol 2 (and reads the rest).
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("zipped", [True, False])
def test_torch_save_files_of_every_pickle_protocol_are_recognised(tmp_path, protocol, zipped):
    model = _model()
    checkpoint = {
        "state_dict": model.state_dict(),
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": pl.__version__,
        "hyper_parameters": {"hidden": 8, "lr": 0.05, "scores": None},
    }
    path = tmp_path / f"p{protocol}.ckpt"
    torch.save(checkpoint, path, pickle_protocol=protocol, _use_new_zipfile_serialization=zipped)
    # Handed to torch.load, which reads every protocol (its weights-only unpickler not
    # protocols 4 and 5: that refusal is torch's own, never fastckpt's HeaderError).
    loaded = FastCkptIO().load_checkpoint(path, weights_only=False)
    assert loaded["hyper_parameters"]["hidden"] == 8
    _assert_same(dict(loaded["state_dict"]), dict(model.state_dict()))
    if protocol == 3 and not zipped:  # one real Trainer run through the plugin, by default
        trainer = _trainer(tmp_path, 1, plugins=[AsyncFastCkptIO()])
        trainer.validate(_model(hidden=8), _loader(8), ckpt_path=str(path), verbose=False)


# -- hostile checkpoints ----------------------------------------------------------------------


@pytest.fixture
def resolver_marker(tmp_path, monkeypatch):
    """An OmegaConf resolver that leaves a file behind when called; a secret in the env."""
    omegaconf = pytest.importorskip("omegaconf")
    marker = tmp_path / "resolver-was-called"

    def touch(*args: object) -> str:
        marker.touch()
        return "touched"

    conf = omegaconf.OmegaConf
    register = getattr(conf, "register_resolver", None) or conf.register_new_resolver
    register("fastckpt_lightning_touch", touch, replace=True)
    monkeypatch.setenv("FASTCKPT_TEST_SECRET", "hunter2-secret-value")
    yield omegaconf, marker
    conf.clear_resolver("fastckpt_lightning_touch")


class _ConfModel(pl.LightningModule):
    def __init__(self, cfg):
        super().__init__()
        self.save_hyperparameters(cfg)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _hostile_checkpoint(path, hparams, hparams_type):
    model = _ConfModel({"lr": 0.1})
    checkpoint = {
        "state_dict": model.state_dict(),
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": pl.__version__,
        "hparams_name": "cfg",
        "hyper_parameters": hparams,
        "hparams_type": hparams_type,
    }
    FastCkptIO().save_checkpoint(checkpoint, str(path))


@pytest.mark.parametrize("tagged", [True, False])
def test_a_hostile_omegaconf_checkpoint_never_resolves(tmp_path, resolver_marker, tagged):
    """Hyper-parameters tagged as a DictConfig, or plain ones that Lightning turns into one
    (hparams_type): the default load refuses them, runs no resolver, leaks no variable."""
    omegaconf, marker = resolver_marker
    values = {"token": "${oc.env:FASTCKPT_TEST_SECRET}", "hook": "${fastckpt_lightning_touch:}"}
    hparams = omegaconf.OmegaConf.create(values) if tagged else values
    path = tmp_path / "hostile.ckpt"
    _hostile_checkpoint(path, hparams, omegaconf.DictConfig)

    with pytest.raises(fastckpt.WeightsOnlyError) as info:
        load_from_checkpoint(_ConfModel, path)
    assert "hunter2" not in str(info.value) and not marker.exists()
    if tagged:
        with pytest.raises(fastckpt.WeightsOnlyError):
            FastCkptIO().load_checkpoint(path)
        trainer = _trainer(tmp_path, 1, plugins=[FastCkptIO()])
        with pytest.raises(fastckpt.WeightsOnlyError):
            trainer.fit(_ConfModel({"lr": 0.1}), _loader(), ckpt_path=str(path))
    else:  # the file itself holds plain strings: loading them resolves nothing
        loaded = FastCkptIO().load_checkpoint(path)
        assert loaded["hyper_parameters"] == values
    assert not marker.exists()
    # Trusted on request: the values come back as saved.
    trusted = FastCkptIO().load_checkpoint(path, weights_only=False)
    assert (
        omegaconf.OmegaConf.to_container(
            omegaconf.OmegaConf.create(trusted["hyper_parameters"]), resolve=False
        )
        == values
    )
    assert not marker.exists()


def test_node_interpolations_in_hyperparameters_load_by_default(tmp_path, resolver_marker):
    omegaconf, marker = resolver_marker
    config = omegaconf.OmegaConf.create({"lr": 0.1, "base_lr": "${lr}"})
    path = tmp_path / "conf.ckpt"
    _hostile_checkpoint(path, config, omegaconf.DictConfig)
    model = load_from_checkpoint(_ConfModel, path)
    assert model.hparams.base_lr == 0.1 and not marker.exists()


def _file_with_metadata(path, metadata):
    # Padding keeps the header under the parser's bound of one JSON array per 12 bytes.
    metadata = {**metadata, "padding": " " * 400_000}
    fastckpt.save({"w": torch.ones(2)}, str(path), metadata=metadata)
    return str(path)


@pytest.mark.parametrize(
    "metadata",
    [
        {"lightning.checkpoint": "[" * 5_000 + "]" * 5_000},
        {"lightning.checkpoint": "[1]"},
        {"lightning.checkpoint": "{}", "lightning.state_dict_keys": "[[[" * 3_000},
        {"lightning.types": "[" * 5_000 + "]" * 5_000},
        {"lightning.types": '[[["w"], "AttributeDict"]]'},
    ],
    ids=["deep checkpoint", "checkpoint list", "deep keys", "deep types", "types of a tensor"],
)
def test_hostile_lightning_metadata_raises_header_error(tmp_path, metadata):
    path = _file_with_metadata(tmp_path / "hostile.ckpt", metadata)
    with pytest.raises(fastckpt.HeaderError, match="earlier fastckpt layout"):
        FastCkptIO().load_checkpoint(path)


def _file_with_tree(path, tree_json):
    from fastckpt.checkpoint.tree import Flat

    fastckpt.save(Flat(tensors={"w": torch.ones(2)}, tree=tree_json), str(path))
    return str(path)


def _nested(depth):
    node: object = {"t": "tensor", "n": "w"}
    for _ in range(depth):
        node = {"t": "dict", "k": ["state_dict"], "v": [node]}
    return node


@pytest.mark.parametrize(
    "tree_json",
    [
        _nested(250),
        [1, 2],
        {"t": "object", "c": "builtins.eval", "v": "1"},
        {"t": "dict", "k": ["state_dict"], "v": [{"t": "object", "c": "dict", "v": 5}]},
        {"t": "dict", "k": ["hparams_type"], "v": [{"t": "class", "v": "os.system"}]},
    ],
    ids=["deep", "not a dict", "unknown class", "object of an int", "class by name"],
)
def test_hostile_structure_raises_header_error_in_the_trainer(tmp_path, tree_json):
    path = _file_with_tree(tmp_path / "hostile.ckpt", tree_json)
    with pytest.raises(fastckpt.HeaderError):
        FastCkptIO().load_checkpoint(path)
    if tree_json == [1, 2]:
        trainer = _trainer(tmp_path, 1, plugins=[FastCkptIO()])
        with pytest.raises(fastckpt.HeaderError):
            trainer.validate(_model(), _loader(8), ckpt_path=path, verbose=False)


# -- names of saves in flight -----------------------------------------------------------------


class _Ballast(TinyModel):
    """TinyModel with 16 MiB of buffer: each background save is still writing when the
    next epoch (one batch) ends and ModelCheckpoint names the next file."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ballast", torch.zeros(4 * 2**20))


def test_a_save_in_flight_keeps_its_name_from_the_version_counter(tmp_path):
    dirpath = tmp_path / "ckpt"
    callback = FastCkptCheckpoint(
        dirpath=dirpath, filename="ckpt", save_top_k=-1, monitor="step_score", mode="max"
    )
    torch.manual_seed(0)
    _trainer(tmp_path, 4, [callback]).fit(_Ballast(), _loader(n=4))
    names = ["ckpt.ckpt", "ckpt-v1.ckpt", "ckpt-v2.ckpt", "ckpt-v3.ckpt"]
    assert _checkpoints(dirpath) == set(names)
    epochs = [fastckpt.load(str(dirpath / name))["epoch"] for name in names]
    assert epochs == [0, 1, 2, 3]


# -- behaving like Lightning's own classes ------------------------------------------------------


def _big_checkpoint(mib: int = 64) -> dict:
    return {"state_dict": {"w": torch.arange(mib * 2**18, dtype=torch.float32)}, "epoch": 3}


def test_load_right_after_an_async_save_waits_for_it(tmp_path):
    io = AsyncFastCkptIO()
    path = str(tmp_path / "now.ckpt")
    io.save_checkpoint(_big_checkpoint(), path)
    back = io.load_checkpoint(path)
    assert back["epoch"] == 3 and torch.equal(
        back["state_dict"]["w"], _big_checkpoint()["state_dict"]["w"]
    )
    io.teardown()


def _leftovers(dirpath) -> list:
    return sorted(n for n in os.listdir(dirpath) if not n.endswith(".ckpt"))


def test_trainer_save_checkpoint_outside_fit_is_complete_on_return(tmp_path):
    io = AsyncFastCkptIO()
    trainer = _trainer(tmp_path, 1, plugins=[io])
    trainer.fit(_Ballast(), _loader(n=4))
    path = tmp_path / "after" / "manual.ckpt"
    trainer.save_checkpoint(path)
    assert path.is_file() and not _leftovers(path.parent)  # no temporary left behind
    assert fastckpt.load(str(path))["global_step"] == 1
    assert not io.in_flight(path)


def test_saves_during_fit_stay_in_the_background(tmp_path):
    """Inside a run, Trainer.save_checkpoint returns before the file is written."""
    seen = []

    class _Probe(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            path = str(tmp_path / f"probe-{trainer.current_epoch}.ckpt")
            trainer.save_checkpoint(path)
            seen.append(trainer.strategy.checkpoint_io.in_flight(path))

    torch.manual_seed(0)
    _trainer(tmp_path, 2, [_Probe()], [AsyncFastCkptIO()], enable_checkpointing=False).fit(
        _Ballast(), _loader(n=4)
    )
    assert any(seen)
    assert {f"probe-{i}.ckpt" for i in range(2)} <= set(os.listdir(tmp_path))


def _save_threads() -> list:
    # The process-wide I/O pool (fastckpt-io) lives on by design; saves and removals do not.
    return [
        t for t in threading.enumerate() if t.name.startswith(("fastckpt-save", "fastckpt-remove"))
    ]


def test_teardown_leaves_no_thread_running(tmp_path):
    assert not _save_threads()
    io = AsyncFastCkptIO(max_pending=4)
    for i in range(4):
        io.save_checkpoint(
            {"state_dict": {"w": torch.full((2**16,), float(i))}}, str(tmp_path / f"{i}.ckpt")
        )
    io.remove_checkpoint(str(tmp_path / "0.ckpt"))
    io.teardown()
    assert not _save_threads()
    assert sorted(os.listdir(tmp_path)) == ["1.ckpt", "2.ckpt", "3.ckpt"]


def test_a_used_async_plugin_pickles(tmp_path):
    io = AsyncFastCkptIO(max_pending=3, checksum=False)
    trainer = _trainer(tmp_path, 1, [ModelCheckpoint(dirpath=tmp_path / "ckpt")], [io])
    trainer.fit(_model(), _loader())
    io.save_checkpoint(_big_checkpoint(4), str(tmp_path / "pending.ckpt"))  # maybe in flight
    torch.save(trainer, str(tmp_path / "trainer.pt"))  # as after a ddp_spawn fit
    copy = pickle.loads(pickle.dumps(io))
    assert (copy.max_pending, copy.save_options) == (3, {"checksum": False})
    copy.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, str(tmp_path / "copy.ckpt"))
    copy.teardown()
    io.teardown()
    assert fastckpt.load(str(tmp_path / "copy.ckpt"))["state_dict"]["w"].tolist() == [1.0, 1.0]


def test_callback_signature_is_model_checkpoints_plus_its_own():
    ours = inspect.signature(FastCkptCheckpoint).parameters
    theirs = inspect.signature(ModelCheckpoint).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, parameter in theirs.items():
        assert ours[name].default == parameter.default, name
    assert ours["asynchronous"].default is True and ours["allow_pickle"].default is False
    callback = FastCkptCheckpoint(monitor="score", save_top_k=3, mode="max", asynchronous=False)
    assert (callback.save_top_k, callback.asynchronous) == (3, False)


def test_state_key_is_model_checkpoints():
    kwargs = dict(monitor="score", mode="max", every_n_epochs=2)
    assert FastCkptCheckpoint(**kwargs).state_key == ModelCheckpoint(**kwargs).state_key


def _cross_run(tmp_path, first: str, second: str):
    """Run 1 (3 epochs) with one callback, run 2 resumes from last.ckpt with the other for 3
    more; scores rise every epoch, so the best two are run 2's last epochs."""
    dirpath = tmp_path / "ckpt"
    scores = [float(i) for i in range(6)]

    def make(kind):
        args = dict(dirpath=dirpath, monitor="score", mode="max", save_top_k=2, save_last=True)
        if kind == "model_checkpoint":
            return [ModelCheckpoint(**args)], [FastCkptIO()]
        return [FastCkptCheckpoint(**args)], []

    callbacks, plugins = make(first)
    _trainer(tmp_path, 3, callbacks, plugins).fit(_model(scores=scores), _loader(), _loader(8))
    callbacks, plugins = make(second)
    _trainer(tmp_path, 6, callbacks, plugins).fit(
        _model(scores=scores), _loader(), _loader(8), ckpt_path=str(dirpath / "last.ckpt")
    )
    names = _checkpoints(dirpath)
    assert names == {"last.ckpt", "epoch=4-step=20.ckpt", "epoch=5-step=24.ckpt"}, names
    assert callbacks[0].best_model_path.endswith("epoch=5-step=24.ckpt")
    assert fastckpt.load(str(dirpath / "last.ckpt"))["epoch"] == 5


@pytest.mark.parametrize(
    "first,second", [("model_checkpoint", "fastckpt"), ("fastckpt", "model_checkpoint")]
)
def test_resume_across_callbacks_keeps_top_k_and_last(tmp_path, first, second):
    _cross_run(tmp_path, first, second)


def test_missing_checkpoint_message_is_lightnings(tmp_path):
    missing = str(tmp_path / "none.ckpt")
    with pytest.raises(FileNotFoundError) as reference:
        TorchCheckpointIO().load_checkpoint(missing)
    for io in (FastCkptIO(), AsyncFastCkptIO()):
        with pytest.raises(FileNotFoundError) as info:
            io.load_checkpoint(missing)
        assert str(info.value) == str(reference.value)
        assert info.value.errno == errno.ENOENT and info.value.filename == missing
    with pytest.raises(FileNotFoundError, match=f"Checkpoint file not found: {missing}"):
        _trainer(tmp_path, 1, plugins=[FastCkptIO()]).fit(_model(), _loader(), ckpt_path=missing)


def test_temporaries_are_not_checkpoints_to_model_checkpoint(tmp_path):
    """While a save is in flight, the directory holds ``<name>.<random>.tmp``: ModelCheckpoint's
    search for ``last`` files (``ckpt_path="last"``) passes over it."""
    io = AsyncFastCkptIO()
    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = _trainer(tmp_path, 1, [callback], [io])
    io.save_checkpoint(_big_checkpoint(), str(tmp_path / "last.ckpt"))
    found = callback._find_last_checkpoints(trainer)
    assert found <= {os.path.normpath(str(tmp_path / "last.ckpt"))}
    io.teardown()
    assert os.listdir(tmp_path) == ["last.ckpt"]


# -- URLs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("plugin", [FastCkptIO, AsyncFastCkptIO])
def test_memory_url_round_trip_writes_nothing_locally(tmp_path, monkeypatch, plugin):
    monkeypatch.chdir(tmp_path)
    url = f"memory://lightning-{plugin.__name__}/run/a.ckpt"
    io = plugin()
    io.save_checkpoint({"state_dict": {"w": torch.arange(3.0)}, "epoch": 1}, url)
    back = io.load_checkpoint(url)
    assert back["epoch"] == 1 and back["state_dict"]["w"].tolist() == [0.0, 1.0, 2.0]
    io.remove_checkpoint(url)
    io.teardown()
    with pytest.raises(FileNotFoundError, match=f"Checkpoint file not found: {url}"):
        io.load_checkpoint(url)
    assert os.listdir(tmp_path) == []


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*")
def test_trainer_saves_and_resumes_at_a_memory_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dirpath = "memory://lightning-trainer/ckpt"
    _trainer(
        tmp_path, 1, [ModelCheckpoint(dirpath=dirpath, save_last=True)], [AsyncFastCkptIO()]
    ).fit(_model(), _loader())
    capture = _Capture()
    _trainer(tmp_path, 2, [capture], [FastCkptIO()], enable_checkpointing=False).fit(
        _model(), _loader(), ckpt_path=f"{dirpath}/last.ckpt"
    )
    assert capture.start["epoch"] == 1
    assert not os.path.exists(tmp_path / "memory:")


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _RangedFiles(_QuietFiles):
    """Serves a directory, answering ``Range: bytes=a-b`` requests as object stores do."""

    def do_GET(self):
        wanted = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not wanted or not os.path.isfile(path):
            return super().do_GET()
        with open(path, "rb") as f:
            data = f.read()
        first, _, last = wanted.removeprefix("bytes=").partition("-")
        start, end = int(first or 0), min(int(last) + 1 if last else len(data), len(data))
        self.send_response(206)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        self.wfile.write(data[start:end])


@pytest.fixture(params=["ranges", "whole files"])
def http_root(tmp_path, request):
    """A directory served over HTTP on localhost, by a server that answers byte ranges or by
    one that sends whole files (Python's own): (directory, base URL)."""
    root = tmp_path / "served"
    root.mkdir()

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0),
        functools.partial(
            _RangedFiles if request.param == "ranges" else _QuietFiles, directory=str(root)
        ),
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*")
def test_http_checkpoint_loads_and_resumes(tmp_path, http_root):
    root, base = http_root
    _trainer(tmp_path, 1, [ModelCheckpoint(dirpath=root, filename="run")], [FastCkptIO()]).fit(
        _model(), _loader()
    )
    url = f"{base}/run.ckpt"
    assert FastCkptIO().load_checkpoint(url)["epoch"] == 0
    back = load_from_checkpoint(TinyModel, url)
    assert back.hparams.hidden == 8
    capture = _Capture()
    _trainer(tmp_path, 2, [capture], [FastCkptIO()], enable_checkpointing=False).fit(
        _model(), _loader(), ckpt_path=url
    )
    assert capture.start["epoch"] == 1
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        FastCkptIO().load_checkpoint(f"{base}/none.ckpt")


class _MixedModel(FastCkptLoadingMixin, TinyModel):
    pass


def test_loading_mixin_makes_the_class_method_read_fastckpt_files(tmp_path):
    trainer = _trainer(tmp_path, 1, plugins=[FastCkptIO()], enable_checkpointing=False)
    torch.manual_seed(0)
    trainer.fit(_MixedModel(hidden=5), _loader())
    path = str(tmp_path / "mixed.ckpt")
    trainer.save_checkpoint(path)
    model = _MixedModel.load_from_checkpoint(path, lr=0.5)
    assert (model.hparams.hidden, model.hparams.lr) == (5, 0.5)
    assert torch.equal(model.net[0].weight, trainer.lightning_module.net[0].weight)
    # without the mixin too, fastckpt.lightning being imported
    assert TinyModel.load_from_checkpoint(path, lr=0.5).hparams.lr == 0.5


@pytest.mark.filterwarnings("ignore:No seed found:UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jsonargparse's, about Lightning's use
def test_lightning_cli_configures_the_callback(tmp_path, monkeypatch):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the arguments come from args= alone
    cli = LightningCLI(
        TinyModel,
        run=False,
        args=[
            "--trainer.logger=false",
            "--trainer.callbacks=fastckpt.lightning.FastCkptCheckpoint",
            "--trainer.callbacks.monitor=val_loss",
            "--trainer.callbacks.save_top_k=2",
            "--trainer.callbacks.asynchronous=false",
        ],
    )
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, FastCkptCheckpoint)]
    assert (callback.monitor, callback.save_top_k, callback.asynchronous) == ("val_loss", 2, False)


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*")
def test_state_under_the_earlier_key_is_still_read(tmp_path):
    """Files of earlier versions keep the callback's state under ``FastCkptCheckpoint{...}``."""
    dirpath = tmp_path / "ckpt"
    args = dict(dirpath=dirpath, monitor="val_loss", save_last=True, asynchronous=False)
    first = FastCkptCheckpoint(**args)
    _trainer(tmp_path, 1, [first]).fit(_model(), _loader(), _loader(8))
    io, last = FastCkptIO(), str(dirpath / "last.ckpt")
    checkpoint = io.load_checkpoint(last)
    state = checkpoint["callbacks"].pop(first.state_key)
    checkpoint["callbacks"][first._legacy_state_key] = state
    io.save_checkpoint(checkpoint, last)
    assert first._legacy_state_key.startswith("FastCkptCheckpoint{")

    resumed = FastCkptCheckpoint(**args)
    _trainer(tmp_path, 1, [resumed]).fit(_model(), _loader(), _loader(8), ckpt_path=last)
    assert resumed.best_model_path == first.best_model_path
    assert resumed.last_model_path == first.last_model_path


@pytest.mark.slow  # a spawned worker process
@pytest.mark.filterwarnings("ignore:.*ddp_spawn.*")
@pytest.mark.filterwarnings("ignore:.*num_workers.*")
def test_callback_under_ddp_spawn_returns_the_trained_weights(tmp_path):
    """Under ``ddp_spawn`` the callback installs the plugin in the worker only; the main
    process reads the weights the worker hands back with its own plugin, and gets them."""
    callback = FastCkptCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    trainer = _trainer(tmp_path, 1, callbacks=[callback], strategy="ddp_spawn")
    model = _model()
    trainer.fit(model, _loader())
    assert type(trainer.strategy.checkpoint_io) is TorchCheckpointIO  # the main process's own
    last = fastckpt.load(str(tmp_path / "ckpts" / "last.ckpt"))  # written by the worker
    assert last["global_step"] == 4
    _assert_same(last["state_dict"], model.state_dict(), "weights returned to the main process")
    assert not list((tmp_path / "ckpts").glob("*.tmp"))


def test_a_removal_with_no_teardown_to_come_leaves_no_thread(tmp_path):
    """The main process of a ``ddp_spawn`` run removes the worker's weights file after
    ``fit``, and no teardown follows: the deletion's thread ends with the deletion."""
    io = AsyncFastCkptIO()
    path = str(tmp_path / "weights.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, path)
    io.settle()
    assert not _save_threads()
    io.remove_checkpoint(path)
    for _ in range(500):  # the unlink of a small file: well under the 5 s allowed
        if not os.path.exists(path) and not _save_threads():
            break
        threading.Event().wait(0.01)
    assert not os.path.exists(path)
    assert not _save_threads()
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, path)  # the name is free again
    io.teardown()
    assert os.path.exists(path)
