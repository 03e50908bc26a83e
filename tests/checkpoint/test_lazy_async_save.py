"""Lazy asynchronous saves: ``async_save(..., fence=optimizer)`` returns without copying,
streams the tensors through a fixed staging ring, and the file holds the values at call
time: the fence holds the optimizer's step off (snapshotting what is left), the version
check fails a save whose tensors changed unfenced, and a kill -9 never leaves a torn file.
Real training loops, real files."""

from __future__ import annotations

import os
import signal
import sys
import textwrap

import pytest
import torch

import fastckpt
from fastckpt.checkpoint import asynchronous, lazy_guard
from tests._fences import owner
from tests.python_processes import run


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(16, 512)).pow(2).mean().backward()
    optimizer.step()


def _big_state(megabytes: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(megabytes // 4)}


def test_a_fenced_optimizer_steps_on_and_the_file_holds_the_call_time_values(tmp_path):
    model, optimizer = _model()
    _train_step(model, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    future = fastckpt.async_save(state, tmp_path / "ckpt.safetensors", fence=optimizer)
    for _ in range(3):  # training goes on at once; the first step waits on the fence
        _train_step(model, optimizer)
    assert future.result() is None
    back = fastckpt.load(tmp_path / "ckpt.safetensors")
    assert all(torch.equal(back["model"][k], v) for k, v in expected.items())
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert not lazy_guard._fenced.get(optimizer)  # the fence is gone with the save
    assert len(optimizer._optimizer_step_pre_hooks) == 1  # one hook per optimizer, for good


def test_an_unfenced_change_fails_the_save_naming_the_tensor(tmp_path):
    state = _big_state()
    path = tmp_path / "torn.safetensors"
    ring = asynchronous.lazy_ring(16 << 20)  # held: the writer cannot copy a byte yet
    held = []
    while (buffer := ring.try_acquire()) is not None:
        held.append(buffer)
    try:
        future = fastckpt.async_save(state, path, fence=owner(state), staging_bytes=16 << 20)
        for tensor in state.values():  # before the writer copied any of them
            tensor.add_(1)
    finally:
        for buffer in held:
            ring.release(buffer)
    with pytest.raises(fastckpt.LazySaveError) as caught:
        future.result()
    message = str(caught.value)
    assert "changed after async_save(lazy)" in message and "fence=optimizer" in message
    assert any(f"'{name}'" in message for name in state)
    assert os.listdir(tmp_path) == []  # nothing committed, no temporary left


def test_future_fence_covers_other_in_place_updates(tmp_path):
    state = _big_state()
    expected = {k: v.clone() for k, v in state.items()}
    ema = {k: v.clone() for k, v in state.items()}
    future = fastckpt.async_save(
        state, tmp_path / "ema.safetensors", fence=owner(state), staging_bytes=16 << 20
    )
    future.fence()  # before an EMA-style update no optimizer fence sees
    for name, tensor in state.items():
        tensor.mul_(0.9).add_(ema[name], alpha=0.1)
    future.result()
    back = fastckpt.load(tmp_path / "ema.safetensors")
    assert all(torch.equal(back[k], v) for k, v in expected.items())


def test_fence_bytes_bounds_the_snapshot_and_the_rest_is_waited_for(tmp_path):
    state = _big_state()
    expected = {k: v.clone() for k, v in state.items()}
    future = fastckpt.async_save(
        state,
        tmp_path / "capped.safetensors",
        fence=owner(state),
        staging_bytes=16 << 20,
        fence_bytes=8 << 20,
    )
    future.fence()
    assert future._guard.snapshot_bytes <= 8 << 20
    for tensor in state.values():
        tensor.zero_()
    future.result()
    back = fastckpt.load(tmp_path / "capped.safetensors")
    assert all(torch.equal(back[k], v) for k, v in expected.items())


def test_the_ring_not_the_checkpoint_sets_the_host_memory(tmp_path):
    asynchronous.release_staging()
    future = fastckpt.async_save(
        _big_state(96), tmp_path / "ring.safetensors", lazy=True, staging_bytes=16 << 20
    )
    future.result()
    assert asynchronous._ring is not None and asynchronous._ring.budget <= 16 << 20
    assert len(fastckpt.load(tmp_path / "ring.safetensors")) == 24


def test_bad_fence_arguments_are_named(tmp_path):
    with pytest.raises(TypeError, match="fence takes a torch.optim.Optimizer"):
        fastckpt.async_save({"w": torch.ones(1)}, tmp_path / "x.safetensors", fence="adam")
    with pytest.raises(TypeError, match="got a Linear in the list"):
        fastckpt.async_save(
            {"w": torch.ones(1)}, tmp_path / "x.safetensors", fence=[torch.nn.Linear(1, 1)]
        )
    with pytest.raises(ValueError, match="two different modes"):
        fastckpt.async_save(
            {"w": torch.ones(1)}, tmp_path / "x.safetensors", lazy=True, snapshot=False
        )
    with pytest.raises(ValueError, match="fence_bytes"):
        fastckpt.async_save(
            {"w": torch.ones(1)}, tmp_path / "x.safetensors", lazy=True, fence_bytes=-1
        )
    assert not os.path.exists(tmp_path / "x.safetensors")


def test_kill_9_during_a_lazy_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    fastckpt.save({"generation": torch.tensor(1), **_big_state(8)}, path)
    child = textwrap.dedent(
        f"""
        import os, signal, torch, fastckpt
        state = {{"generation": torch.tensor(2), **{{f"t{{i}}": torch.randn(1 << 20) for i in range(32)}}}}
        future = fastckpt.async_save(state, {str(path)!r}, lazy=True, staging_bytes=16 << 20)
        os.kill(os.getpid(), signal.SIGKILL)  # mid-stream: the ring holds a part at most
        """
    )
    done = run([sys.executable, "-c", child], timeout=120)
    assert done.returncode == -signal.SIGKILL
    back = fastckpt.load(path, verify=True)
    assert int(back["generation"]) == 1


def _mutators() -> dict[str, object]:
    """Every way a training loop changes the state in place, each a function of the model
    and its optimizer."""

    def step(**adam: object):
        def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
            optimizer.zero_grad()
            model(torch.randn(4, 512)).sum().backward()
            optimizer.step()

        return run

    def in_place(model, _):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)

    def copy_into(model, _):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.zeros_like(p))

    def foreach_lerp_ema(model, _):
        with torch.no_grad():
            params = list(model.parameters())
            torch._foreach_lerp_(params, [torch.ones_like(p) for p in params], 0.1)

    def scheduler_and_step(model, optimizer):
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        step()(model, optimizer)
        scheduler.step()  # changes the learning rate: a float, captured at the call

    return {
        "adam step": step(),
        "in-place mul_": in_place,
        "p.copy_": copy_into,
        "_foreach_lerp_ EMA": foreach_lerp_ema,
        "scheduler + step": scheduler_and_step,
    }


@pytest.mark.parametrize("optimizer_kind", ["foreach", "fused", "for-loop"])
@pytest.mark.parametrize("mutator", list(_mutators()))
@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "unfenced"])
def test_every_mutation_gives_the_call_time_state_or_a_named_error(
    tmp_path, optimizer_kind, mutator, fenced
):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 MiB
    options = {
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, **options[optimizer_kind])
    _mutators()["adam step"](model, optimizer)  # optimizer state exists
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "ckpt.safetensors"
    future = fastckpt.async_save(
        state, path, lazy=True, fence=optimizer if fenced else (), staging_bytes=8 << 20
    )
    if fenced and mutator != "adam step" and mutator != "scheduler + step":
        future.fence()  # mutators no optimizer hook sees are fenced by hand
    _mutators()[mutator](model, optimizer)
    try:
        future.result()
    except fastckpt.LazySaveError as exc:
        assert not fenced, f"a fenced save failed: {exc}"
        assert "changed after async_save(lazy)" in str(exc)
        return
    back = fastckpt.load(path)
    for name, tensor in expected.items():
        assert torch.equal(back["model"][name], tensor), name


def test_the_next_checkpoints_fence_copies_into_the_memory_the_last_one_used(tmp_path):
    from fastckpt.checkpoint import fence_memory

    fastckpt.release_staging()
    state = _big_state(16)
    ring = asynchronous.lazy_ring(16 << 20)
    for step in range(2):
        expected = {k: v.clone() for k, v in state.items()}
        held = []  # the writer copies nothing until the fence has snapshotted everything
        while (buffer := ring.try_acquire()) is not None:
            held.append(buffer)
        try:
            path = tmp_path / f"{step}.safetensors"
            future = fastckpt.async_save(state, path, fence=owner(state), staging_bytes=16 << 20)
            idle_before = fence_memory.idle_bytes()
            future.fence()
            if step == 1:  # every snapshot came from what the first save's writer gave back
                assert idle_before == 16 << 20 and fence_memory.idle_bytes() == 0
            for tensor in state.values():
                tensor.add_(1)
        finally:
            for buffer in held:
                ring.release(buffer)
        future.result()
        back = fastckpt.load(path)
        assert all(torch.equal(back[k], v) for k, v in expected.items())
        assert fence_memory.idle_bytes() == 16 << 20  # kept for the next fence
    fastckpt.release_staging()
    assert fence_memory.idle_bytes() == 0


@pytest.mark.parametrize("late_kind", ["fused", "foreach", "for-loop"])
def test_an_optimizer_made_after_the_call_is_fenced_too(tmp_path, late_kind):
    # A fused kernel moves no version counter: were its step not fenced, the file would
    # hold the values after it, unseen by every check.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    state = model.state_dict()
    expected = {k: v.clone() for k, v in state.items()}
    path = tmp_path / "late.safetensors"
    ring = asynchronous.lazy_ring(4 << 20)  # held: the writer cannot copy a byte yet
    held = []
    while (buffer := ring.try_acquire()) is not None:
        held.append(buffer)
    try:
        future = fastckpt.async_save(
            state, path, fence=owner(model.parameters()), staging_bytes=4 << 20
        )
        guard = future._guard
        options = {"fused": {"fused": True}, "foreach": {"foreach": True}}
        late = torch.optim.Adam(model.parameters(), lr=0.5, **options.get(late_kind, {}))
        model(torch.randn(4, 512)).sum().backward()
        late.step()  # at once, before the writer copied anything
        assert not torch.equal(model[0].weight, expected["0.weight"])
    finally:
        for buffer in held:
            ring.release(buffer)
    future.result()
    back = fastckpt.load(path)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    assert guard.snapshot_bytes == sum(t.nbytes for t in expected.values())
    assert guard not in lazy_guard._reading_live  # no step looks at it any more


def test_an_optimizer_stepping_other_tensors_does_not_fence_the_save(tmp_path):
    state = _big_state(16)
    other = torch.nn.Linear(8, 8)
    future = fastckpt.async_save(
        state, tmp_path / "w.safetensors", fence=owner(state), staging_bytes=16 << 20
    )
    guard = future._guard
    optimizer = torch.optim.Adam(other.parameters(), fused=True)
    other(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    assert guard.snapshot_bytes == 0 and not guard._settled
    future.result()
