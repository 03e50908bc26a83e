"""Rank-side code of the lazy DCP tests (spawned by dcp_ranks.run_ranks): each rank saves
with FastCkptLazyStager and changes its state right after the call."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_ranks import full_values, make_mesh, make_state
from torch.distributed.checkpoint.api import CheckpointException

from fastckpt.checkpoint import lazy_guard
from fastckpt.dcp import FastCkptLazyStager, FastCkptWriter, load_full


def _net() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same on every rank: DCP stores replicated tensors once
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    return net, torch.optim.AdamW(net.parameters(), lr=0.1)


def _step(net, optimizer) -> None:
    optimizer.zero_grad()
    net(torch.ones(8, 256)).square().mean().backward()
    optimizer.step()


def _mutate_dtensors(state) -> None:
    for value in state["model"].values():
        value.to_local().fill_(-7)
    state["plain"].zero_()
    state["cfg"]["lr"] = 9.0


def fenced_and_unfenced(rank, world, base):
    """A fenced save with the optimizer stepping and the DTensors changed right after the
    call (after stager.fence()): the checkpoint holds the call-time state. An unfenced one
    of a larger state changed at once: the call-time state, or every rank's future raises
    naming the tensor and nothing is published."""
    mesh = make_mesh(world)
    net, optimizer = _net()
    _step(net, optimizer)
    state = {**make_state(mesh), "net": net.state_dict(), "optim": optimizer.state_dict()}
    before = {k: v.clone() for k, v in net.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    stager = FastCkptLazyStager(fence=optimizer, staging_bytes=8 << 20)
    path = base + "/fenced"
    future = dcp.async_save(state, storage_writer=FastCkptWriter(path), async_stager=stager)
    for _ in range(3):
        _step(net, optimizer)  # the first step passes the fence
    stager.fence()  # the DTensors are no optimizer's: fenced by hand
    _mutate_dtensors(state)
    future.result()
    dist.barrier()
    saved = load_full(path)
    full = full_values()
    for key in ("sharded", "repl", "half", "wide"):
        assert torch.equal(saved["model"][key], full[key]), key
    assert torch.equal(saved["plain"], full["plain"]) and saved["cfg"]["lr"] == 0.1
    assert all(torch.equal(saved["net"][k], v) for k, v in before.items())
    assert torch.equal(saved["optim"]["state"]["0"]["exp_avg"], moments)
    assert not lazy_guard._fenced.get(optimizer)  # the fence went with the save

    big = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(16)}  # 16 MiB per rank
    path = base + "/unfenced"
    stager = FastCkptLazyStager(staging_bytes=8 << 20)
    future = dcp.async_save(
        {"rank": {str(rank): big}}, storage_writer=FastCkptWriter(path), async_stager=stager
    )
    for tensor in big.values():
        tensor.add_(100)
    try:
        future.result()
    except CheckpointException as exc:
        message = str(exc)
        assert "changed after async_save(lazy)" in message, message
        assert "FastCkptLazyStager(fence=optimizer)" in message, message
        assert any(f"'rank.{r}.t" in message for r in range(world)), message
        dist.barrier()
        assert not os.path.exists(os.path.join(path, ".metadata"))
    else:
        dist.barrier()
        saved = load_full(path)["rank"]
        for r in range(world):
            for i in range(16):
                assert torch.equal(saved[str(r)][f"t{i}"], torch.full((1 << 18,), float(i)))
    stager.close()
