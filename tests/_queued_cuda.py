"""Stand-ins for CUDA streams and events whose queued work really waits: a copy or clone
queued on a stream runs only when an event recorded after it is synchronized, or when
another stream waits on such an event (that stream's later work runs after it). With them
host memory plays the device for the lazy saves' CUDA path (lazy_guard's few CUDA calls
are replaced), so its ordering is checked on machines without a GPU."""

from __future__ import annotations

import threading

import torch
from _host_cuda import HostEvent, HostStream

from fastckpt.checkpoint import lazy_guard


class QueuedStream(HostStream):
    """A stream whose queued work runs when an event after it is synchronized."""

    def __init__(self, *args, log=None, **kwargs):
        super().__init__()
        self.ops: list = []
        self.ran = 0
        self.log = log
        self._lock = threading.Lock()  # the writer and the trainer both run queued work

    def queue(self, op) -> None:
        self.ops.append(op)
        self.log.append(("queue", self))

    def run_until(self, n: int) -> None:
        with self._lock:
            while self.ran < n:
                self.ran += 1
                self.ops[self.ran - 1]()

    def wait_event(self, event) -> None:
        super().wait_event(event)
        self.log.append(("wait", self, event))
        event.run()  # what this stream queues later runs after the event's work

    def synchronize(self) -> None:
        self.run_until(len(self.ops))


class QueuedEvent(HostEvent):
    def __init__(self, *, log=None, gate=None):
        self.stream, self.at, self.log, self.gate = None, 0, log, gate

    def record(self, stream=None) -> None:
        self.stream = stream
        self.at = len(stream.ops) if stream is not None else 0
        self.log.append(("record", self, stream))

    def run(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.at)

    def synchronize(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.log.append(("writer waits", self))
            assert self.gate.wait(30), "the test never opened the gate"  # the writer waits
        self.log.append(("sync", self))
        self.run()


class HostDevice:
    """The stand-in device: its log, its current stream, its side streams and a gate that
    holds the writer thread at its next event synchronization while closed."""

    def __init__(self, monkeypatch, on_device=lambda t: True):
        self.log: list = []
        self.gate = threading.Event()
        self.gate.set()
        self.current = QueuedStream(log=self.log)
        self.sides: list[QueuedStream] = []

        def stream(device=None):
            s = QueuedStream(log=self.log)
            self.sides.append(s)
            return s

        def queue_flat(stream, tensor):
            return tensor.detach().reshape(-1).view(torch.uint8)

        def queue_clone(stream, flat):
            out = torch.empty_like(flat)
            stream.queue(lambda: out.copy_(flat))
            return out

        def queue_copy(stream, dst, src):
            stream.queue(lambda: dst.copy_(src))

        monkeypatch.setattr(torch.cuda, "Stream", stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda: QueuedEvent(log=self.log, gate=self.gate))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(lazy_guard, "_on_device", on_device)
        monkeypatch.setattr(lazy_guard, "_queue_flat", queue_flat)
        monkeypatch.setattr(lazy_guard, "_queue_clone", queue_clone)
        monkeypatch.setattr(lazy_guard, "_queue_copy", queue_copy)
