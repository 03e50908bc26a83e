"""What a lazy ``async_save`` call itself does: the work that scales with the checkpoint's
size (reserving the file's blocks) is left to its background thread, so the call costs
about the same whatever the size, and that work's errors still reach the future."""

from __future__ import annotations

import errno
import os
import resource
import threading

import pytest
import torch

import fastckpt
from fastckpt.io.commit import AtomicFile


@pytest.mark.parametrize(("lazy", "where"), [(True, "fastckpt-save"), (False, "MainThread")])
def test_a_lazy_call_leaves_the_reservation_to_its_thread(tmp_path, monkeypatch, lazy, where):
    reserved_on: list[str] = []
    reserve = AtomicFile.reserve

    def recorded(self, nbytes):
        reserved_on.append(threading.current_thread().name)
        return reserve(self, nbytes)

    monkeypatch.setattr(AtomicFile, "reserve", recorded)
    state = {"w": torch.randn(1 << 16)}
    path = str(tmp_path / "w.safetensors")
    fastckpt.async_save(state, path, lazy=lazy).result()
    assert len(reserved_on) == 1 and reserved_on[0].startswith(where)
    assert torch.equal(fastckpt.load(path)["w"], state["w"])


def test_a_reservation_refused_fails_the_lazy_save_through_its_future(tmp_path):
    path = str(tmp_path / "w.safetensors")
    fastckpt.save({"w": torch.zeros(4)}, path)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old[1]))  # as a full disk refuses
    try:
        future = fastckpt.async_save({"w": torch.ones(1 << 20)}, path, lazy=True)
        with pytest.raises(OSError) as info:
            future.result()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    assert info.value.errno == errno.EFBIG
    assert os.listdir(tmp_path) == ["w.safetensors"]  # no temporary file left
    assert fastckpt.load(path)["w"].tolist() == [0.0] * 4  # the previous checkpoint stays


def test_two_pending_saves_fenced_on_one_optimizer_let_it_step(tmp_path):
    """A save that ends while the step runs the fences leaves the step's hooks alone (it
    used to remove its hook from its own thread: "OrderedDict mutated during iteration")."""
    w = torch.nn.Parameter(torch.randn(16 << 20 >> 2))  # 16 MiB through an 8 MiB ring
    optimizer = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.ones_like(w)
    for i in range(5):
        expected = w.detach().clone()
        futures = [
            fastckpt.async_save(
                {"w": w}, tmp_path / f"{i}{n}.safetensors", fence=optimizer, staging_bytes=8 << 20
            )
            for n in "ab"
        ]
        optimizer.step()  # both fences run; the first save may end meanwhile
        for future in futures:
            future.result()
            assert torch.equal(fastckpt.load(future.path)["w"], expected)
    assert len(optimizer._optimizer_step_pre_hooks) == 1
