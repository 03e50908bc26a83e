"""dcp.async_save with FastCkptLazyStager: the call copies nothing, the writer streams the
live tensors through the lazy ring, and the checkpoint holds the state at the call (fenced
optimizer steps and fenced updates go on at once), or the save fails naming the tensor
changed unfenced and nothing is published. One process (no_dist) and 2 real gloo ranks."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _queued_cuda import HostDevice
from dcp_lazy_ranks import fenced_and_unfenced
from dcp_ranks import run_ranks
from torch.distributed.checkpoint.api import CheckpointException

from fastckpt.checkpoint import asynchronous, lazy_guard
from fastckpt.dcp import FastCkptLazyStager, FastCkptWriter, load_full
from tests._fences import owner

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MIB = 1 << 20


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(16, 512)).square().mean().backward()
    optimizer.step()


def _big(count: int = 16) -> dict[str, torch.Tensor]:
    return {f"t{i:02d}": torch.full((MIB,), float(i)) for i in range(count)}  # 4 MiB each


def _async_save(state, path, stager):
    return dcp.async_save(
        state, storage_writer=FastCkptWriter(path), async_stager=stager, no_dist=True
    )


@pytest.mark.parametrize("fence_bytes", [None, 0, 300_000])
def test_a_fenced_optimizer_steps_at_once_and_the_checkpoint_holds_the_call_time_state(
    tmp_path, fence_bytes
):
    model, optimizer = _model()
    _step(model, optimizer)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 1}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {i: s["exp_avg"].clone() for i, s in optimizer.state_dict()["state"].items()}
    stager = FastCkptLazyStager(fence=optimizer, fence_bytes=fence_bytes, staging_bytes=8 * MIB)
    future = _async_save(state, tmp_path / "ckpt", stager)
    for _ in range(3):
        _step(model, optimizer)
    state["step"] = 4  # non-tensor values were copied at the call
    future.result()
    saved = load_full(tmp_path / "ckpt")
    assert all(torch.equal(saved["model"][k], v) for k, v in before.items())
    assert all(
        torch.equal(saved["optim"]["state"][str(i)]["exp_avg"], m) for i, m in moments.items()
    )
    assert saved["step"] == 1
    assert not lazy_guard._fenced.get(optimizer)  # the fence went with the save
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    stager.close()


def test_an_unfenced_change_fails_the_save_naming_the_tensor(tmp_path):
    state = _big()
    stager = FastCkptLazyStager(fence=owner(state), staging_bytes=8 * MIB)
    path = tmp_path / "torn"
    ring = asynchronous.lazy_ring(8 * MIB)  # held: the writer cannot copy a byte yet
    held = []
    while (buffer := ring.try_acquire()) is not None:
        held.append(buffer)
    try:
        future = _async_save(state, path, stager)
        for tensor in state.values():  # before the writer copied any of them
            tensor.add_(1)
    finally:
        for buffer in held:
            ring.release(buffer)
    with pytest.raises(CheckpointException) as caught:
        future.result()
    message = str(caught.value)
    assert "changed after async_save(lazy)" in message
    assert "FastCkptLazyStager(fence=optimizer)" in message
    assert any(f"tensor '{name}'" in message for name in state)
    assert not (path / ".metadata").exists()  # nothing published
    assert [f for f in os.listdir(path) if f.endswith(".safetensors")] == []
    stager.close()


def test_stager_fence_covers_other_in_place_updates_within_its_cap(tmp_path):
    state = _big()
    expected = {k: v.clone() for k, v in state.items()}
    stager = FastCkptLazyStager(fence_bytes=8 * MIB, staging_bytes=8 * MIB)
    future = _async_save(state, tmp_path / "ema", stager)
    stager.fence()  # two tensors snapshotted at most, the rest waited for
    for tensor in state.values():
        tensor.mul_(0.5).add_(3)
    future.result()
    saved = load_full(tmp_path / "ema")
    assert all(torch.equal(saved[k], v) for k, v in expected.items())
    stager.close()


def test_staging_copies_nothing_and_returns_stand_ins_over_the_live_tensors():
    model, optimizer = _model()
    state = {"model": model.state_dict(), "cfg": {"lr": [0.1]}}
    stager = FastCkptLazyStager(fence=optimizer)
    staged = stager.stage(state)
    for key, value in state["model"].items():
        assert staged["model"][key] is not value
        assert staged["model"][key].data_ptr() == value.data_ptr()  # no copy
    assert staged["cfg"] == state["cfg"] and staged["cfg"]["lr"] is not state["cfg"]["lr"]
    assert lazy_guard._fenced.get(optimizer)  # fenced until the save ends...
    stager.close()  # ...or, never written (no save took it), until the stager closes
    assert not lazy_guard._fenced.get(optimizer)
    _step(model, optimizer)  # no fence left to wait on


def test_a_stage_dropped_unwritten_ends_and_leaves_no_fence(tmp_path):
    model, optimizer = _model()
    stager = FastCkptLazyStager(fence=optimizer, fence_bytes=0)
    staged = stager.stage({"model": model.state_dict()})
    del staged  # a save that failed before its writer started drops it
    assert not lazy_guard._fenced.get(optimizer)
    _step(model, optimizer)  # would wait forever for a writer that never comes


def test_a_url_writer_refuses_lazy_staging_by_name(tmp_path):
    stager = FastCkptLazyStager()
    future = dcp.async_save(
        {"w": torch.ones(4)},
        storage_writer=FastCkptWriter("memory://lazy-dcp/ckpt"),
        async_stager=stager,
        no_dist=True,
    )
    with pytest.raises(CheckpointException, match="FastCkptLazyStager streams into local files"):
        future.result()
    stager.close()


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="fence takes a torch.optim.Optimizer"):
        FastCkptLazyStager(fence=[object()])
    with pytest.raises(ValueError, match="fence_bytes"):
        FastCkptLazyStager(fence_bytes=-1)
    with pytest.raises(ValueError, match="staging_bytes"):
        FastCkptLazyStager(staging_bytes=0)


def test_the_writers_own_staging_still_copies_at_the_call(tmp_path):
    state = _big(4)
    expected = {k: v.clone() for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        future = dcp.async_save(state, storage_writer=FastCkptWriter(tmp_path / "e"), no_dist=True)
    for tensor in state.values():
        tensor.add_(1)
    future.result()
    saved = load_full(tmp_path / "e")
    assert all(torch.equal(saved[k], v) for k, v in expected.items())


def test_two_gloo_ranks_fenced_and_unfenced(tmp_path):
    run_ranks(2, fenced_and_unfenced, str(tmp_path))


def test_device_tensors_are_cloned_by_the_fence_while_the_writer_waits(monkeypatch, tmp_path):
    # Host memory plays the GPU (tests/_queued_cuda.py): the rank file is right only if the
    # writer waited for each buffer's copies and the step ran after the fence's clones.
    device = HostDevice(monkeypatch, on_device=lambda t: t.numel() > 1)
    model, optimizer = _model()
    _step(model, optimizer)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stager = FastCkptLazyStager(fence=optimizer, staging_bytes=8 * MIB)
    device.gate.clear()  # the writer stops at its first buffer's event
    future = _async_save(state, tmp_path / "dev", stager)
    (guard,) = list(stager._guards)
    deadline = time.monotonic() + 60
    while not any(e[0] == "writer waits" for e in list(device.log)):
        assert time.monotonic() < deadline, "the writer never reached its first buffer"
        time.sleep(0.01)
    _step(model, optimizer)  # the fence: device clones, the current stream waits on them
    assert device.current.waited and device.current.waited[-1].stream in device.sides
    device.gate.set()
    future.result()
    saved = load_full(tmp_path / "dev")
    assert all(torch.equal(saved["model"][k], v) for k, v in before.items())
    assert guard.device_snapshot_bytes > 0  # the parameters and moments, cloned
    stager.close()
