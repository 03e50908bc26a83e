"""A fence that arrives while the writer is inside a tensor: it snapshots the part the
writer has not reached and returns after that memory copy, without waiting for the disk
to take the rest of the tensor; past ``fence_bytes`` it waits for the writer instead; a
change with no fence still fails the save, naming the tensor.

The disk is held still: the writer's wait for a write (``Executor.wait``) blocks until the
test opens a gate, so "returned before the writer finished" is a fact of the test, not a
timing. Real saves, real files, a real optimizer step."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import fastckpt
from fastckpt.checkpoint import asynchronous, lazy_guard
from fastckpt.io.executor import Executor
from tests._fences import owner

MIB = 1 << 20
RING = 8 * MIB  # two staging buffers: the writer is held 8 MiB into the state


class HeldDisk:
    """Holds every wait for a write until :attr:`gate` opens; :attr:`held` is set once the
    writer waits (its ring is full, it is inside the big tensor)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.gate, self.held = threading.Event(), threading.Event()
        original = Executor.wait

        def wait(executor: Executor, op_id: int) -> None:
            self.held.set()
            assert self.gate.wait(60), "the test never opened the gate"
            original(executor, op_id)

        monkeypatch.setattr(Executor, "wait", wait)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldDisk]:
    asynchronous.release_staging()  # an idle ring takes the size asked for: RING
    held = HeldDisk(monkeypatch)
    try:
        yield held
    finally:
        held.gate.set()  # a failed assertion must not leave the writer held
        asynchronous.wait_all(timeout=120)


def _in_thread(work) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def _big_parameter(shape: tuple[int, ...] = (24 * MIB,), transpose: bool = False):
    g = torch.Generator().manual_seed(3)
    data = torch.randn(*shape, generator=g)
    param = torch.nn.Parameter(data.t() if transpose else data)
    return param, torch.optim.SGD([param], lr=1.0)


def _mutating_step(param: torch.nn.Parameter, optimizer: torch.optim.Optimizer) -> None:
    param.grad = torch.ones_like(param)
    optimizer.step()  # the fence first (its step pre-hook), then param -= 1


@pytest.mark.parametrize("transpose", [False, True], ids=["contiguous", "transposed"])
def test_a_fence_inside_a_tensor_returns_before_the_disk_and_the_file_holds_call_time(
    disk, tmp_path, transpose
):
    # 96 MiB; transposed, its rows (12000 bytes) do not divide the 4 MiB pieces
    param, optimizer = _big_parameter((3000, 8000) if transpose else (24 * MIB,), transpose)
    expected = param.detach().clone()
    path = tmp_path / "big.safetensors"
    future = fastckpt.async_save(
        {"w": param}, path, fence=optimizer, staging_bytes=RING, fence_bytes=None
    )
    assert disk.held.wait(60)  # the writer filled the ring and waits for the disk
    stepping = _in_thread(lambda: _mutating_step(param, optimizer))
    stepping.join(60)
    assert not stepping.is_alive()  # the step ran while the disk was held
    assert not disk.gate.is_set()
    assert torch.equal(param.detach(), expected - 1)  # the step changed the whole tensor
    ring = asynchronous._ring
    # the part past the writer, no more: the ring's two pieces came from the tensor
    assert future._guard.snapshot_bytes == param.numel() * 4 - ring.capacity * ring.piece
    disk.gate.set()
    assert future.result() is None
    assert torch.equal(fastckpt.load(path)["w"], expected)


def test_the_tail_and_the_tensors_after_it_are_snapshotted_within_fence_bytes(disk, tmp_path):
    g = torch.Generator().manual_seed(4)
    state = {"a": torch.randn(24 * MIB, generator=g), "b": torch.randn(4 * MIB, generator=g)}
    expected = {k: v.clone() for k, v in state.items()}
    path = tmp_path / "two.safetensors"
    future = fastckpt.async_save(state, path, fence=owner(state), staging_bytes=RING)
    assert disk.held.wait(60)
    fencing = _in_thread(future.fence)
    fencing.join(60)
    assert not fencing.is_alive()
    ring = asynchronous._ring
    assert future._guard.snapshot_bytes == 112 * MIB - ring.capacity * ring.piece
    for tensor in state.values():
        tensor.zero_()
    disk.gate.set()
    assert future.result() is None
    back = fastckpt.load(path)
    assert all(torch.equal(back[k], v) for k, v in expected.items())


def test_past_fence_bytes_the_fence_waits_for_the_writer(disk, tmp_path):
    param, optimizer = _big_parameter()
    expected = param.detach().clone()
    path = tmp_path / "capped.safetensors"
    future = fastckpt.async_save(
        {"w": param}, path, fence=optimizer, staging_bytes=RING, fence_bytes=16 * MIB
    )
    assert disk.held.wait(60)
    stepping = _in_thread(lambda: _mutating_step(param, optimizer))
    stepping.join(1.0)
    # the 88 MiB left of the tensor exceed the cap: the step waits for the held writer
    assert stepping.is_alive() and torch.equal(param.detach(), expected)
    disk.gate.set()
    stepping.join(60)
    assert not stepping.is_alive()
    assert future._guard.snapshot_bytes == 0
    assert future.result() is None
    assert torch.equal(fastckpt.load(path)["w"], expected)


def test_a_change_inside_the_tensor_without_the_fence_fails_naming_it(disk, tmp_path):
    param, _ = _big_parameter()
    path = tmp_path / "torn.safetensors"
    future = fastckpt.async_save({"big": param}, path, fence=owner([param]), staging_bytes=RING)
    assert disk.held.wait(60)
    with torch.no_grad():
        param.add_(1)  # the writer has copied 8 MiB of it and will read the rest
    disk.gate.set()
    with pytest.raises(fastckpt.LazySaveError, match="'big' changed .* while its bytes"):
        future.result()
    assert not path.exists()


def test_a_fence_after_an_unfenced_change_takes_no_snapshot_and_the_save_fails(disk, tmp_path):
    param, _ = _big_parameter()
    path = tmp_path / "late.safetensors"
    future = fastckpt.async_save({"big": param}, path, fence=owner([param]), staging_bytes=RING)
    assert disk.held.wait(60)
    with torch.no_grad():
        param.mul_(2)  # before the fence: its snapshot would hold the new values
    fencing = _in_thread(future.fence)
    disk.gate.set()
    fencing.join(60)
    assert not fencing.is_alive()
    assert future._guard.snapshot_bytes == 0
    with pytest.raises(fastckpt.LazySaveError, match="'big' changed"):
        future.result()
    assert not path.exists()


def test_conjugate_negative_and_scalar_views_are_read_and_snapshotted_as_saved(tmp_path):
    g = torch.Generator().manual_seed(5)
    z = torch.randn(3 * MIB, dtype=torch.complex64, generator=g)  # 24 MiB
    state = {
        "conj": z.conj(),
        "neg": z.conj().imag,  # a negative view
        "scalar": torch.tensor(1 + 2j).conj(),
        "strided": torch.randn(1500, 1001, generator=g).t(),
    }
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    for fence in (False, True):
        path = tmp_path / f"views-{fence}.safetensors"
        future = fastckpt.async_save(state, path, fence=owner(state), staging_bytes=RING)
        if fence:
            future.fence()  # snapshots whatever the writer has not reached, wherever it is
        assert future.result() is None
        back = fastckpt.load(path)
        assert all(torch.equal(back[k], v) for k, v in expected.items())


@pytest.mark.parametrize("piece", [1, 199, 4095, 4097, 12000])
@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(3000, generator=g),
        lambda g: torch.randn(40, 75, generator=g).t(),  # rows of 160 bytes
        lambda g: torch.randn(30, 100, dtype=torch.complex64, generator=g).t().conj(),
    ],
    ids=["contiguous", "transposed", "transposed-conj"],
)
def test_a_fence_between_any_two_pieces_gives_the_row_major_bytes(make, piece):
    tensor = make(torch.Generator().manual_seed(6))
    expected = tensor.resolve_conj().contiguous().reshape(-1).view(torch.uint8).clone()
    total = expected.numel()
    for fence_at in (0, piece, total // 2 // piece * piece, total):
        guard = lazy_guard.LazyGuard({"t": tensor}, fence_bytes=None, optimizers=[owner([tensor])])
        guard.begin("t")
        out, done = [], 0
        while done < total:
            if done >= fence_at and not guard._snapshots:
                guard.fence()
                assert guard.snapshot_bytes == total - done  # the bytes past the writer
                tensor.mul_(2)  # the step, after the fence
            take = min(piece, total - done)
            with guard.read("t", done, take) as part:
                out.append(part.clone())
            done += take
        guard.copied("t")  # checked at the fence, not now: no error
        guard.finish()
        assert torch.equal(torch.cat(out), expected)
        tensor.div_(2 ** (fence_at < total))
