"""DeepSpeed's FastFileWriter (``torch.save`` through a DeepNVMe handle) over fastckpt.aio.

FastFileWriter opens its file ``O_DIRECT`` and hands the handle the descriptor:
``async_pwrite(buffer, fd, file_offset)``, expecting 0, then ``wait()`` expecting 1. The
first test runs DeepSpeed's own writer when DeepSpeed is installed; the second replays the
same calls, in the same order and shapes, so the suite covers them without DeepSpeed.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from fastckpt.aio import aio_handle

SIZES = [1, 4095, 4097, 300_001]


def _state(nbytes: int) -> dict:
    g = torch.Generator().manual_seed(nbytes)
    return {
        "weight": torch.randint(-128, 127, (nbytes,), dtype=torch.int8, generator=g),
        "bias": torch.randn(17, generator=g),
        "step": 7,
        "nested": {"lr": 0.5, "ids": [torch.arange(5)]},
    }


def _assert_same(loaded: dict, state: dict) -> None:
    assert loaded.keys() == state.keys()
    assert torch.equal(loaded["weight"], state["weight"])
    assert torch.equal(loaded["bias"], state["bias"])
    assert loaded["step"] == 7 and loaded["nested"]["lr"] == 0.5
    assert torch.equal(loaded["nested"]["ids"][0], torch.arange(5))


def _require_o_direct(directory) -> None:
    probe = os.path.join(directory, "probe")
    try:
        os.close(os.open(probe, os.O_DIRECT | os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError as exc:
        pytest.skip(f"{directory} refuses O_DIRECT ({exc.strerror}); FastFileWriter needs it")
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


def _handle() -> aio_handle:
    # DeepSpeed's writer_factory builds its handle from these five settings, by position.
    return aio_handle(1 << 16, 8, False, True, 2)


class _ByteCastOps:
    """Stands in for DeepSpeed's native utils op, which FastFileWriter loads when it is
    built but ``torch.save`` never calls (only ``save_torch_storage_object_list`` does).
    DeepSpeed has it only for GPU accelerators, compiled on first use."""

    def load(self):
        return self

    @staticmethod
    def cast_to_byte_tensor(tensors):
        return [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]


@pytest.mark.parametrize("double_buffer", [True, False])
@pytest.mark.parametrize("nbytes", SIZES)
def test_deepspeed_fast_file_writer(tmp_path, monkeypatch, nbytes, double_buffer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DeepSpeed's own import-time notices
        try:
            from deepspeed.io import fast_file_writer
        except ImportError as exc:
            pytest.skip(f"DeepSpeed is not installed ({exc})")
    _require_o_direct(tmp_path)
    monkeypatch.setattr(fast_file_writer, "UtilsBuilder", _ByteCastOps)
    h = _handle()
    pinned = h.new_cpu_locked_tensor(16 * h.get_alignment(), torch.empty(0, dtype=torch.uint8))
    path = tmp_path / "ds.pt"
    config = fast_file_writer.FastFileWriterConfig(
        dnvme_handle=h, pinned_tensor=pinned, double_buffer=double_buffer
    )
    writer = fast_file_writer.FastFileWriter(str(path), config)
    state = _state(nbytes)
    torch.save(state, writer)
    writer.close()
    del writer  # its finalizer asserts every byte went out (an error here fails the test)
    assert h.wait() == 0
    _assert_same(torch.load(path, weights_only=True), state)
    assert h.free_cpu_locked_tensor(pinned)


class _ReplayedFastFileWriter:
    """DeepSpeed FastFileWriter's calls to its handle and its descriptor, replayed: a pinned
    buffer split in two, each full half drained with ``async_pwrite(half, fd, offset)`` at an
    aligned offset (checked to return 0) while the other fills, ``wait()`` (checked to return
    1) before a half is reused; at close the aligned rest the same way, the unaligned tail
    appended through a buffered file, the descriptor reopened ``O_DIRECT | O_APPEND``, then
    fsync and close."""

    def __init__(self, path, handle, pinned, double_buffer: bool):
        self.path, self.handle = str(path), handle
        self.fd = os.open(self.path, flags=os.O_DIRECT | os.O_CREAT | os.O_WRONLY)
        align = handle.get_alignment()
        halves = 2 if double_buffer else 1
        assert pinned.numel() % (halves * align) == 0
        size = pinned.numel() // halves
        self.buffers = [torch.narrow(pinned, 0, i * size, size) for i in range(halves)]
        self.fill, self.fill_offset, self.file_offset = 0, 0, 0
        self.draining = False

    def write(self, data) -> int:
        assert self.file_offset % self.handle.get_alignment() == 0
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        done = 0
        while done < src.numel():
            buf = self.buffers[self.fill]
            n = min(src.numel() - done, buf.numel() - self.fill_offset)
            buf[self.fill_offset : self.fill_offset + n].copy_(src[done : done + n])
            self.fill_offset += n
            done += n
            if self.fill_offset == buf.numel():
                self._drain(self.fill_offset)
        return len(data)

    def _complete_drain(self) -> None:
        if self.draining:
            assert self.handle.wait() == 1
            self.draining = False

    def _drain(self, nbytes: int) -> None:
        self._complete_drain()
        buf = self.buffers[self.fill]
        assert (
            self.handle.async_pwrite(torch.narrow(buf, 0, 0, nbytes), self.fd, self.file_offset)
            == 0
        )
        if len(self.buffers) == 1:
            assert self.handle.wait() == 1
        else:
            self.draining = True
            self.fill = (self.fill + 1) % len(self.buffers)
        self.file_offset += nbytes
        self.fill_offset = 0

    def flush(self) -> None:
        pass

    def close(self) -> None:
        align = self.handle.get_alignment()
        buf = self.buffers[self.fill]
        aligned = self.fill_offset // align * align
        tail = buf[aligned : self.fill_offset].clone()
        if aligned:
            self._drain(aligned)
        self._complete_drain()
        if tail.numel():
            os.close(self.fd)
            with open(self.path, "ab") as f:
                f.write(tail.numpy().tobytes())
            self.fd = os.open(self.path, flags=os.O_DIRECT | os.O_WRONLY | os.O_APPEND)
        os.fsync(self.fd)
        os.close(self.fd)


@pytest.mark.parametrize("double_buffer", [True, False])
@pytest.mark.parametrize("nbytes", SIZES)
def test_fast_file_writer_call_forms_replayed(tmp_path, nbytes, double_buffer):
    _require_o_direct(tmp_path)
    h = _handle()
    pinned = h.new_cpu_locked_tensor(16 * h.get_alignment(), torch.empty(0, dtype=torch.uint8))
    path = tmp_path / "replayed.pt"
    writer = _ReplayedFastFileWriter(path, h, pinned, double_buffer)
    state = _state(nbytes)
    torch.save(state, writer)
    writer.close()
    assert h.wait() == 0
    _assert_same(torch.load(path, weights_only=True), state)
    assert h.free_cpu_locked_tensor(pinned)
