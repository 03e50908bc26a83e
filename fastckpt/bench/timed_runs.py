"""One timed save or load, as a benchmark's child process runs it: set up outside the
clock, timed with :class:`~fastckpt.bench.measure.Measure`, then (untimed) the bytes checked.

The methods are those of :mod:`fastckpt.bench.peers`; the parent starts one child per
measurement (:mod:`fastckpt.bench.children`) and gets the dict these functions return.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> spec = {"method": "fastckpt", "file": path, "size": 1 << 20, "seed": 0}
    >>> saved = child_save(spec)
    >>> loaded = child_load(spec)
    >>> saved["digest"] == loaded["digest"], loaded["payload_bytes"] == saved["payload_bytes"]
    (True, True)
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from fastckpt.bench.caches import drop_page_cache
from fastckpt.bench.checks import crc_digest, file_crc32, tensor_crc32s, touch
from fastckpt.bench.measure import Measure, ThreadSampler
from fastckpt.bench.peers import LOADERS, SAVERS, Loader, Saver, Skip
from fastckpt.io.cpu_load import machine_busy

__all__ = ["child_load", "child_save"]


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def child_save(spec: dict[str, Any], savers: dict[str, Saver] = SAVERS) -> dict[str, Any]:
    """A benchmark child's save: builds the seeded LLM-like state dict of ``spec["size"]`` on
    ``spec["device"]`` (default cpu), then times ``savers[spec["method"]]`` writing it to
    ``spec["file"]`` until durable. Reports the measurement and the state's CRC digest.
    """
    from fastckpt.bench.synthetic import llm_like_state_dict

    device = spec.get("device", "cpu")
    state = llm_like_state_dict(spec["size"], seed=spec["seed"])
    digest = crc_digest(tensor_crc32s(state))
    if device != "cpu":
        state = {k: v.to(device) for k, v in state.items()}
        _synchronize(device)
    try:
        run = savers[spec["method"]].setup(state, spec["file"])
    except Skip as why:
        return {"skipped": str(why)}
    os.sync()  # start from clean writeback state
    with Measure() as m:
        run()
    return {
        **m.as_dict(),
        "payload_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "file_bytes": os.path.getsize(spec["file"]),
        "tensors": len(state),
        "digest": digest,
    }


def child_load(spec: dict[str, Any], loaders: dict[str, Loader] = LOADERS) -> dict[str, Any]:
    """A benchmark child's load: times ``loaders[spec["method"]]`` reading ``spec["file"]``
    to ``spec["device"]`` (default cpu) and touching every page of every tensor.

    ``spec["cold"]`` drops the page cache first; ``spec["sample"]`` counts busy threads
    (:class:`ThreadSampler`). Afterwards (untimed) the bytes are checked: with
    ``spec["crc_file"]`` (JSON ``{"tensors": {name: crc}, "file": crc}``) the names whose
    CRC differs are reported as ``wrong``; the digest of the loaded tensors is reported.
    """
    import torch

    method, path, device = spec["method"], spec["file"], spec.get("device", "cpu")
    if device.startswith("cuda"):
        torch.ones(1024, device=device).sum().item()  # CUDA initialized outside the timing
    try:
        run = loaders[method].setup(path, device)
    except Skip as why:
        return {"skipped": str(why)}
    touch({"warm": torch.ones(1024)})  # first-op setup outside the timed section
    cache = drop_page_cache([path]) if spec.get("cold") else "hot"
    resident = _resident_share(path)  # a "cold" figure is proved cold: fincore's check
    busy = machine_busy()  # what a load's read-mode choice saw (untimed: it reads again)
    sampler = ThreadSampler() if spec.get("sample") else contextlib.nullcontext()
    with sampler, Measure() as m:
        loaded = run()
        touch(loaded)
        _synchronize(device)
    result: dict[str, Any] = {
        **m.as_dict(),
        "cache": cache,
        "resident_before": resident,
        "machine_busy": busy,
    }
    if isinstance(sampler, ThreadSampler):
        result.update(streams=sampler.streams, streams_max=sampler.busy_max)
    whole_file = method.startswith("preadv")
    if whole_file:
        result["payload_bytes"] = spec.get("payload_bytes") or os.path.getsize(path)
        result["file_crc"] = file_crc32(path)
    else:
        result["payload_bytes"] = sum(t.numel() * t.element_size() for t in loaded.values())
        result["tensors"] = len(loaded)
        crcs = tensor_crc32s(loaded)
        result["digest"] = crc_digest(crcs)
    if spec.get("crc_file"):
        with open(spec["crc_file"], encoding="utf-8") as f:
            expected = json.load(f)
        if whole_file:
            result["wrong"] = [] if result["file_crc"] == expected["file"] else ["(file bytes)"]
        else:
            want = expected["tensors"]
            result["wrong"] = sorted(
                n for n in set(crcs) | set(want) if crcs.get(n) != want.get(n)
            )[:3]
    return result


def _resident_share(path: str) -> float | None:
    """The share of ``path``'s pages in the page cache (None where mincore says nothing)."""
    from fastckpt.io.page_cache import resident_fraction

    try:
        with open(path, "rb") as f:
            return resident_fraction(f.fileno(), 0, os.path.getsize(path))
    except OSError:
        return None
