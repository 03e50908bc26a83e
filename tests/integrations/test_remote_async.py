"""``fastckpt.async_save`` to a URL is one of the pending saves: ``wait_all`` waits for it
and raises its error, like a local one."""

from __future__ import annotations

import threading
import uuid

import pytest

torch = pytest.importorskip("torch")
fsspec = pytest.importorskip("fsspec")

from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

import fastckpt  # noqa: E402


class GatedMemoryFileSystem(MemoryFileSystem):
    """memory://, except that opening a file for writing waits until ``gate`` is set (or
    fails when ``refuse`` is set): a store whose uploads are slow, or refused."""

    protocol = "gated"
    gate = threading.Event()
    refuse = threading.Event()

    def _open(self, path, mode="rb", *args, **kwargs):
        if "w" in mode:
            self.gate.wait(30)
            if self.refuse.is_set():
                raise PermissionError(13, "uploads refused", path)
        return super()._open(path, mode, *args, **kwargs)


fsspec.register_implementation("gated", GatedMemoryFileSystem, clobber=True)


@pytest.fixture
def gated():
    GatedMemoryFileSystem.gate.clear()
    GatedMemoryFileSystem.refuse.clear()
    yield GatedMemoryFileSystem
    GatedMemoryFileSystem.gate.set()  # never leave a save thread waiting


def test_wait_all_waits_for_a_url_save(gated):
    url = f"gated://w-{uuid.uuid4().hex}/ckpt.safetensors"
    future = fastckpt.async_save({"w": torch.arange(10.0)}, url)
    with pytest.raises(TimeoutError):
        fastckpt.wait_all(timeout=0.2)  # the upload is held at the gate: still pending
    assert not future.done()
    gated.gate.set()
    fastckpt.wait_all(timeout=30)
    assert future.done()
    assert fastckpt.load(url)["w"].tolist() == list(range(10))


def test_wait_all_raises_a_failed_url_save_naming_the_url(gated):
    url = f"gated://r-{uuid.uuid4().hex}/ckpt.safetensors"
    gated.refuse.set()
    gated.gate.set()
    future = fastckpt.async_save({"w": torch.ones(3)}, url)
    with pytest.raises(PermissionError) as info:
        fastckpt.wait_all(timeout=30)
    assert url in str(info.value) or info.value.filename == url
    assert future.done() and isinstance(future.exception(), PermissionError)
