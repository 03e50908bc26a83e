"""Lazy asynchronous saves of CUDA tensors: copies on a side stream after the call's event,
each buffer written only once its copies completed, and a fence that clones on the device
and makes the current stream wait instead of blocking the host.

Without a GPU the device is played by host memory with streams that really defer their work:
a copy or clone queued on a side stream runs only when an event recorded after it is
synchronized, or when another stream waits on such an event (its later work runs after
it). A writer that wrote a buffer before its copies' event, or a fence that let the step
run before the clones, would put other bytes in the file. Real saves, real files. The
``cuda``-marked tests run the same on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from _queued_cuda import HostDevice

import fastckpt
from tests._fences import owner

MIB = 1 << 20


def _tensors(count: int, numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i:02d}": torch.randn(numel, generator=g) for i in range(count)}


def _equal(path, expected: dict[str, torch.Tensor]) -> bool:
    back = fastckpt.load(path)
    return all(torch.equal(back[k], v) for k, v in expected.items())


def _writer_waits(device: HostDevice) -> bool:
    """Whether the writer recorded its first buffer's event (it then waits at the gate)."""
    return any(e[0] == "record" and e[2] in device.sides for e in list(device.log))


def _wait_until(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


# -- ordering, on the stand-in device ----------------------------------------------------------


def test_side_stream_waits_on_the_call_event_and_buffers_are_written_after_their_copies(
    monkeypatch, tmp_path
):
    device = HostDevice(monkeypatch)
    state = _tensors(12, 3 * MIB // 4)  # 3 MiB each through a ring of two 4 MiB buffers
    expected = {k: v.clone() for k, v in state.items()}
    path = tmp_path / "ckpt.safetensors"
    future = fastckpt.async_save(state, path, fence=owner(state), staging_bytes=8 * MIB)
    assert future.result() is None
    # Copies only ran at event synchronizations: the file holds the right bytes only
    # because every buffer was written after its copies' event.
    assert _equal(path, expected)
    (side,) = device.sides  # one side stream for the device
    call_event = side.waited[0]
    first_queue = next(i for i, e in enumerate(device.log) if e[0] == "queue")
    first_wait = device.log.index(("wait", side, call_event))
    assert call_event.stream is device.current  # recorded at the call on the current stream
    assert first_wait < first_queue  # the side stream waits on it before its first copy
    assert side.ran == len(side.ops) > 12  # every copy ran; several pieces per buffer
    assert device.current.waited == []  # no fence: the training stream never waited


def test_content_hashes_are_taken_after_the_copies_landed(monkeypatch, tmp_path):
    # The strong hashes an incremental save trusts are of the bytes written, not of what
    # the ring held before its device-to-host copies completed.
    from fastckpt.checkpoint.digests import hash_tensor

    device = HostDevice(monkeypatch)
    state = _tensors(12, 3 * MIB // 4)
    expected = {k: v.clone() for k, v in state.items()}
    path = tmp_path / "h.safetensors"
    assert (
        fastckpt.async_save(state, path, fence=owner(state), staging_bytes=8 * MIB).result() is None
    )
    assert device.sides and _equal(path, expected)
    hashes = fastckpt.open(path).meta.hashes
    assert hashes == {k: hash_tensor(v) for k, v in expected.items()}


def test_fence_clones_on_the_device_and_makes_the_current_stream_wait(monkeypatch, tmp_path):
    device = HostDevice(monkeypatch)
    state = _tensors(16, MIB // 4)  # 1 MiB each, four to a 4 MiB buffer
    expected = {k: v.clone() for k, v in state.items()}
    device.gate.clear()  # the writer stops at its first buffer's event
    future = fastckpt.async_save(
        state, tmp_path / "f.safetensors", fence=owner(state), staging_bytes=8 * MIB
    )
    _wait_until(lambda: _writer_waits(device))
    started = time.monotonic()
    future.fence()  # returns without the writer: nothing waits on the host
    assert time.monotonic() - started < 5
    guard = future._guard
    (side,) = device.sides
    fence_event = device.current.waited[-1]
    assert fence_event.stream is side and fence_event.at == len(side.ops)  # after the clones
    # t00-t03 fill the first buffer and are queued whole (t03, still the one being copied,
    # has no bytes left): the 12 after it are cloned
    assert guard.device_snapshot_bytes == 12 * MIB and guard.snapshot_bytes == 0
    for tensor in state.values():  # the step's kernels: after the event, on the current stream
        tensor.mul_(-1)
    device.gate.set()
    assert future.result() is None
    assert _equal(tmp_path / "f.safetensors", expected)


def test_fence_bytes_caps_the_device_clones_and_the_rest_is_waited_for(monkeypatch, tmp_path):
    device = HostDevice(monkeypatch)
    state = _tensors(16, MIB // 4)
    expected = {k: v.clone() for k, v in state.items()}
    device.gate.clear()
    future = fastckpt.async_save(
        state,
        tmp_path / "cap.safetensors",
        fence=owner(state),
        staging_bytes=8 * MIB,
        fence_bytes=2 * MIB,
    )
    _wait_until(lambda: _writer_waits(device))
    threading.Timer(0.5, device.gate.set).start()  # the writer goes on a little later
    started = time.monotonic()
    future.fence()
    waited = time.monotonic() - started
    assert future._guard.device_snapshot_bytes == 2 * MIB  # t04 and t05 (t03 is queued)
    assert waited >= 0.4  # the rest past the cap: waited for until its copies were queued
    for tensor in state.values():
        tensor.add_(5)
    assert future.result() is None
    assert _equal(tmp_path / "cap.safetensors", expected)


def test_fence_clones_only_the_part_of_the_tensor_being_copied_past_the_writer(
    monkeypatch, tmp_path
):
    device = HostDevice(monkeypatch)
    state = _tensors(3, 3 * MIB // 4)  # 3 MiB each: t01 straddles the 4 MiB buffers
    expected = {k: v.clone() for k, v in state.items()}
    device.gate.clear()  # the writer stops at its first buffer's event, 1 MiB into t01
    future = fastckpt.async_save(
        state, tmp_path / "tail.safetensors", fence=owner(state), staging_bytes=8 * MIB
    )
    _wait_until(lambda: _writer_waits(device))
    future.fence()  # returns with the gate closed: nothing waited for on the host
    # t01's last 2 MiB (its first MiB is queued from the tensor) and t02 are cloned
    assert future._guard.device_snapshot_bytes == 5 * MIB
    for tensor in state.values():
        tensor.mul_(-1)
    device.gate.set()
    assert future.result() is None
    assert _equal(tmp_path / "tail.safetensors", expected)


def test_a_change_before_the_queued_copies_completed_fails_naming_the_tensor(monkeypatch, tmp_path):
    device = HostDevice(monkeypatch)
    state = _tensors(8, MIB // 4)
    device.gate.clear()
    path = tmp_path / "torn.safetensors"
    future = fastckpt.async_save(state, path, fence=owner(state), staging_bytes=8 * MIB)
    _wait_until(lambda: _writer_waits(device))
    state["t00"].add_(1)  # queued but not yet copied, and no fence: the copy would see it
    device.gate.set()
    with pytest.raises(fastckpt.LazySaveError, match="'t00' changed .* while its bytes"):
        future.result()
    assert not path.exists()


def test_an_optimizer_fence_over_device_and_host_tensors(monkeypatch, tmp_path):
    # parameters and moments stand in for device tensors; Adam's step counters stay host ones
    HostDevice(monkeypatch, on_device=lambda t: t.numel() > 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 256)).square().mean().backward()
        optimizer.step()

    step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    path = tmp_path / "adam.safetensors"
    future = fastckpt.async_save(state, path, fence=optimizer, staging_bytes=8 * MIB)
    for _ in range(3):
        step()
    assert future.result() is None
    back = fastckpt.load(path)
    assert all(torch.equal(back["model"][k], v) for k, v in expected.items())
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], moments)
    assert int(back["optim"]["state"][0]["step"]) == 1


# -- a real GPU -----------------------------------------------------------------------------


def _cuda_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)
    ).cuda()
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _cuda_step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(64, 2048, device="cuda")).square().mean().backward()
    optimizer.step()


@pytest.mark.cuda
@pytest.mark.parametrize("fence_bytes", [None, 0, 8 * MIB])
def test_cuda_adam_fenced_save_holds_the_call_time_state(tmp_path, fence_bytes):
    model, optimizer = _cuda_model()
    _cuda_step(model, optimizer)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    moments = {
        i: s["exp_avg"].detach().cpu().clone() for i, s in optimizer.state_dict()["state"].items()
    }
    path = tmp_path / "cuda.safetensors"
    future = fastckpt.async_save(
        state, path, fence=optimizer, fence_bytes=fence_bytes, staging_bytes=8 * MIB
    )
    for _ in range(3):  # right after the call; the first step passes the fence
        _cuda_step(model, optimizer)
    assert future.result() is None
    back = fastckpt.load(path)
    assert all(torch.equal(back["model"][k], v) for k, v in expected.items())
    assert all(torch.equal(back["optim"]["state"][i]["exp_avg"], m) for i, m in moments.items())
    assert future._guard.snapshot_bytes < 4096  # host memory: Adam's step counters only
    if fence_bytes is not None:
        assert future._guard.device_snapshot_bytes <= fence_bytes


@pytest.mark.cuda
def test_cuda_unfenced_change_gives_the_call_time_state_or_names_the_tensor(tmp_path):
    state = {f"w{i}": torch.randn(4 * MIB // 4, device="cuda") for i in range(16)}
    state["strided"] = torch.randn(512, 1024, device="cuda").t()  # not contiguous
    expected = {k: v.cpu() for k, v in state.items()}
    path = tmp_path / "unfenced.safetensors"
    future = fastckpt.async_save(state, path, fence=owner(state), staging_bytes=8 * MIB)
    for tensor in state.values():
        tensor.add_(1)
    error = future.exception()
    if error is None:
        assert _equal(path, expected)
    else:
        assert isinstance(error, fastckpt.LazySaveError) and "changed after" in str(error)
        assert not path.exists()


@pytest.mark.cuda
def test_cuda_work_queued_before_the_call_is_in_the_file(tmp_path):
    w = torch.zeros(64 * MIB // 4, device="cuda")
    for _ in range(20):
        w.add_(1)  # queued, likely still running at the call
    future = fastckpt.async_save({"w": w}, tmp_path / "q.safetensors", fence=owner([w]))
    future.fence()
    w.zero_()
    future.result()
    assert torch.all(fastckpt.load(tmp_path / "q.safetensors")["w"] == 20)


@pytest.mark.cuda
@pytest.mark.parametrize("late_kind", ["fused", "foreach"])
def test_a_cuda_optimizer_made_after_the_call_is_fenced_too(tmp_path, late_kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    state = model.state_dict()
    expected = {k: v.clone() for k, v in state.items()}
    path = tmp_path / "late.safetensors"
    future = fastckpt.async_save(
        state, path, fence=owner(model.parameters()), staging_bytes=4 * MIB
    )
    late = torch.optim.Adam(model.parameters(), lr=0.5, **{late_kind: True})
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    late.step()  # its kernels move no version counter (fused): only the fence keeps them out
    future.result()
    back = fastckpt.load(path)
    assert all(torch.equal(back[k], v.cpu()) for k, v in expected.items())


# -- the benchmark's lazy row ------------------------------------------------------------------

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_cuda.py")


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_cuda", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_the_cuda_benchmark_imports_and_says_it_needs_a_gpu():
    bench = _bench_module()
    assert "async" in bench.HANDLERS
    run = subprocess.run(
        [sys.executable, BENCH, "--size", "16M", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert run.returncode == 2 and "no CUDA GPU here" in run.stderr


@pytest.mark.cuda
@pytest.mark.parametrize("lazy", [True, False])
def test_the_benchmarks_async_rows_save_the_call_time_state(tmp_path, lazy):
    bench = _bench_module()
    spec = {"device": "cuda:0", "size": 64 * MIB, "seed": 0, "file": str(tmp_path / "a.st")}
    result = bench._child_async({**spec, "lazy": lazy})
    assert result["digest"] == result["call_time_digest"]
    if lazy:  # the ring and device clones, no host snapshot
        assert result["host_snapshot_bytes"] == 0 and result["pinned_bytes"] <= 256 * MIB
    else:  # the snapshot was taken in the call: the fence has nothing to clone
        assert result["device_clone_bytes"] == 0 and result["fence_seconds"] < result["seconds"]
