"""Every way torch changes a training state, against incremental chains and lazy saves.

Fused, foreach and for-loop Adam, AdamW, SGD (momentum) and Adagrad; BatchNorm in train
mode (its running statistics change with no version bump); writes through ``.data``;
``torch.no_grad()`` ``copy_``; an ``out=`` op; an EMA updated with foreach ops; a learning-
rate scheduler. Each restored step must equal its own saved state bit for bit, or the save
must raise naming the tensor. Real optimizers, real files."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt.checkpoint import asynchronous
from tests._fences import owner

OPTIMIZERS = {
    "adam": lambda ps, impl: torch.optim.Adam(ps, lr=0.01, **impl),
    "adamw": lambda ps, impl: torch.optim.AdamW(ps, lr=0.01, **impl),
    "sgd": lambda ps, impl: torch.optim.SGD(ps, lr=0.01, momentum=0.9, **impl),
    "adagrad": lambda ps, impl: torch.optim.Adagrad(ps, lr=0.01, **impl),
}
IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


class Run:
    """A small model with BatchNorm, its optimizer, a scheduler and an EMA of its weights."""

    def __init__(self, optimizer: str, impl: str, seed: int = 0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.Tanh(),
            torch.nn.Linear(64, 8),
        )  # fmt: skip
        self.optimizer = OPTIMIZERS[optimizer](self.model.parameters(), IMPLS[impl])
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 1, gamma=0.9)
        self.ema = [p.detach().clone() for p in self.model.parameters()]
        self.steps = 0

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "ema": {str(i): t for i, t in enumerate(self.ema)},
            "step": self.steps,
        }

    def forward_backward(self) -> None:
        """BatchNorm's running statistics change here, with no version bump."""
        self.model.train()
        x = torch.randn(32, 16)
        self.model(x).pow(2).mean().backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.steps += 1

    def after_step(self) -> None:
        """What training code does to the weights once the step is done."""
        params = list(self.model.parameters())
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, [p.detach() for p in params], 0.1)  # EMA
            params[0].data.mul_(0.999)  # through .data: no version bump
            params[2].copy_(params[2] * 0.5 + 0.25)  # no_grad copy_
            torch.clamp(params[3], -1, 1, out=params[3])  # an out= op

    def train_step(self) -> None:
        self.forward_backward()
        self.step()
        self.after_step()


def _frozen(state: Any) -> Any:
    """A deep copy of ``state``: its values now, whatever changes the live one."""
    return copy.deepcopy(state)


def _assert_equal(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        same = torch.equal(actual.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8))
        assert same, f"{where}: the bytes differ"
    elif isinstance(expected, dict):
        assert sorted(map(str, actual)) == sorted(map(str, expected)), where
        for key, value in expected.items():
            _assert_equal(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_equal(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


matrix = pytest.mark.parametrize(("optimizer", "impl"), [(o, i) for o in OPTIMIZERS for i in IMPLS])


@matrix
def test_every_step_of_an_incremental_chain_restores_its_own_state(tmp_path, optimizer, impl):
    run = Run(optimizer, impl)
    run.train_step()  # the optimizer's state exists from the first checkpoint on
    expected, previous = [], None
    for step in range(5):
        path = tmp_path / f"{step}.safetensors"
        expected.append(_frozen(run.state()))
        fastckpt.save(run.state(), path, base=previous)
        previous = path
        if step % 2:  # BatchNorm alone, in train mode: the weights do not move
            with torch.no_grad():
                run.model.train()
                run.model(torch.randn(32, 16))
        else:
            run.train_step()
    for step, state in enumerate(expected):
        path = tmp_path / f"{step}.safetensors"
        _assert_equal(fastckpt.load(path, verify=True), state, f"step {step}")
        assert fastckpt.open(path).verify() == []


@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_managers_incremental_series_restores_every_step(tmp_path, impl):
    run = Run("adamw", impl)
    run.train_step()
    expected = {}
    with fastckpt.CheckpointManager(tmp_path / "run", incremental=True, keep_last=10) as manager:
        for step in range(1, 6):
            expected[step] = _frozen(run.state())
            manager.save(step, run.state()).result()
            run.train_step()
        manager.wait()
        for step, state in expected.items():
            restored_step, restored = manager.restore(step=step)
            assert restored_step == step
            _assert_equal(restored, state, f"step {step}")


def _held_ring(nbytes: int) -> list[Any]:
    """Every buffer of the lazy ring: a save's writer copies nothing until they are freed
    (at the latest after 30 s, so that a fence that waited for the writer fails the test
    instead of hanging it)."""
    ring = asynchronous.lazy_ring(nbytes)
    held = []
    while (buffer := ring.try_acquire()) is not None:
        held.append(buffer)
    timer = threading.Timer(30.0, _free, [held])
    timer.daemon = True
    timer.start()
    return held


_free_lock = threading.Lock()


def _free(held: list[Any]) -> None:
    ring = asynchronous._ring
    with _free_lock:
        while held:
            ring.release(held.pop())


@matrix
@pytest.mark.parametrize("writer", ["held-until-the-step", "free"])
def test_every_lazy_save_holds_the_state_at_its_call(tmp_path, optimizer, impl, writer):
    run = Run(optimizer, impl)
    run.train_step()
    for i in range(3):
        expected = _frozen(run.state())
        held = _held_ring(8 << 20) if writer == "held-until-the-step" else []
        try:
            path = tmp_path / f"{i}.safetensors"
            future = fastckpt.async_save(
                run.state(), path, fence=run.optimizer, staging_bytes=8 << 20
            )
            run.forward_backward()  # BatchNorm's statistics: copied at the call
            run.step()  # fenced: parameters and moments are snapshotted or copied first
        finally:
            _free(held)
        run.after_step()
        future.result()
        _assert_equal(fastckpt.load(path, verify=True), expected, f"save {i}")


@pytest.mark.parametrize(
    "change",
    ["add_", "no_grad copy_", "out=", "foreach"],
)
def test_a_change_to_a_fenced_tensor_outside_the_step_fails_naming_it(tmp_path, change):
    run = Run("adam", "foreach")
    run.train_step()
    weight = run.model[3].weight
    held = _held_ring(8 << 20)
    try:
        future = fastckpt.async_save(
            run.state(), tmp_path / "x.safetensors", fence=run.optimizer, staging_bytes=8 << 20
        )
        with torch.no_grad():
            if change == "add_":
                weight.add_(1)
            elif change == "no_grad copy_":
                weight.copy_(torch.zeros_like(weight))
            elif change == "out=":
                torch.mul(weight, 2, out=weight)
            else:
                torch._foreach_mul_([weight], 2.0)
    finally:
        _free(held)
    with pytest.raises(fastckpt.LazySaveError, match="'model.3.weight' changed"):
        future.result()
    assert not (tmp_path / "x.safetensors").exists()


def test_without_a_fence_a_lazy_save_copies_everything_at_the_call(tmp_path):
    state = {"w": torch.randn(4 << 20), "bn": torch.randn(64)}
    expected = _frozen(state)
    held = _held_ring(8 << 20)
    try:
        future = fastckpt.async_save(state, tmp_path / "x.safetensors", lazy=True)
        for tensor in state.values():
            tensor.data.mul_(2)  # no fence, no version bump: the copy was taken already
    finally:
        _free(held)
    future.result()
    assert future._guard.call_copy_bytes == (4 << 20) * 4 + 64 * 4
    _assert_equal(fastckpt.load(tmp_path / "x.safetensors"), expected)


def test_an_unfenced_op_overlapping_the_copy_never_commits_a_torn_tensor(tmp_path):
    """The version counter moves when an in-place op *ends*: an op still running while the
    writer copies its tensor is caught by hashing the tensor again against the bytes
    written. Each try commits the call-time values or fails naming the tensor."""
    w = torch.randn(16 << 20)  # 64 MiB
    outcomes = {"call-time": 0, "refused": 0}
    for i in range(6):
        expected = w.clone()
        path = tmp_path / f"{i}.safetensors"
        started = threading.Event()

        def change(started: threading.Event = started) -> None:
            started.set()
            w.sin_()  # tens of ms on one core, overlapping the writer's copy

        future = fastckpt.async_save({"w": w}, path, fence=owner([w]), staging_bytes=8 << 20)
        worker = threading.Thread(target=change)
        worker.start()
        started.wait()
        error = future.exception()
        worker.join()
        if error is None:
            assert torch.equal(fastckpt.load(path)["w"], expected)
            outcomes["call-time"] += 1
        else:
            assert isinstance(error, fastckpt.LazySaveError) and "'w'" in str(error)
            assert not path.exists()
            outcomes["refused"] += 1
    assert sum(outcomes.values()) == 6


def test_async_fastckpt_io_outside_a_run_takes_a_point_in_time_copy(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from fastckpt.lightning import AsyncFastCkptIO

    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    expected = _frozen(state)
    io = AsyncFastCkptIO()
    io.save_checkpoint(state, tmp_path / "x.ckpt")
    with torch.no_grad():  # no Trainer, no fence: the state changes at once, as code
        model.weight.add_(1)  # written for Lightning's AsyncCheckpointIO may
    io.teardown()
    _assert_equal(fastckpt.load(tmp_path / "x.ckpt"), expected)


def test_async_fastckpt_io_used_directly_with_a_fence_reads_lazily(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from fastckpt.lightning import AsyncFastCkptIO

    run = Run("adamw", "fused")
    run.train_step()
    io = AsyncFastCkptIO(fence=run.optimizer, staging_bytes=8 << 20)
    expected = _frozen(run.state())
    held = _held_ring(8 << 20)
    try:
        io.save_checkpoint(run.state(), tmp_path / "x.ckpt")
        guard = io._latest[str(tmp_path / "x.ckpt")]._guard
        run.forward_backward()
        run.step()  # the fused step: fenced, so the file keeps the call's values
    finally:
        _free(held)
    run.after_step()
    io.teardown()
    # copied at the call: the EMA and BatchNorm's buffers; the rest was the fence's
    assert guard.call_copy_bytes == sum(t.nbytes for t in run.ema) + sum(
        b.nbytes for b in run.model.buffers()
    )
    _assert_equal(fastckpt.load(tmp_path / "x.ckpt"), expected)
