"""Lazy saves (``fence=optimizer``) of the states large runs have: FSDP2 (``fully_shard``),
tensor parallelism (DTensor parameters, Shard and Replicate), DDP, from
``torch.distributed.checkpoint.state_dict.get_state_dict``. The fence owns the parameters and
optimizer state through their DTensors' local tensors, so the call copies only what no
fence owns (a buffer, a DTensor no optimizer steps); the steps after the call do not reach
the checkpoint; a DTensor changed in place outside the fence fails the save naming it.
Real rank processes over gloo on loopback (lazy_dtensor_ranks.py), and, in this process,
the fence's cover of views and of a step compiled with torch.compile."""

from __future__ import annotations

import pathlib
import socket
import sys

import pytest
import torch

from fastckpt.checkpoint.fence_cover import FenceCover, local_part
from fastckpt.checkpoint.lazy_guard import LazyGuard
from tests.python_processes import launch

RANKS = pathlib.Path(__file__).with_name("lazy_dtensor_ranks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(case: str, root: pathlib.Path, world: int = 2) -> list[str]:
    """Runs ``world`` ranks of lazy_dtensor_ranks.py; every rank's stdout (each must exit 0)."""
    port = _free_port()
    children = [
        launch(
            [sys.executable, str(RANKS), str(rank), str(world), str(port), case, str(root)],
        )
        for rank in range(world)
    ]
    outputs = [child.communicate(timeout=240) for child in children]
    for child, (_, err) in zip(children, outputs):
        assert child.returncode == 0, err[-4000:]
    return [out for out, _ in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "fsdp_fused", "tp", "ddp"])
def test_a_lazy_save_copies_at_the_call_only_what_no_fence_owns_and_holds_the_call_state(
    tmp_path, kind
):
    for rank, out in enumerate(_run(kind, tmp_path)):
        # the parameters and the optimizer state are read after the call, under the fence;
        # the buffer (changed by every forward) and the DTensor no optimizer steps are not
        assert f"rank {rank}: copied at the call: extra model.seen\n" in out, out
        line = next(x for x in out.splitlines() if x.startswith(f"rank {rank}: call bytes"))
        copied, expected = line.split()[4], line.split()[6]
        assert copied == expected, line
        assert f"rank {rank}: changed by the steps: 5" in out, out  # 4 parameters, 1 buffer
        assert f"rank {rank}: restored the state at the call" in out, out


@pytest.mark.slow
def test_a_dtensor_parameter_changed_outside_the_fence_fails_the_save_naming_it(tmp_path):
    outputs = _run("unfenced", tmp_path)
    for rank, out in enumerate(outputs):
        assert f"rank {rank}: save failed: " in out, out
        assert "changed after async_save(lazy) was called" in out, out
        assert f"rank {rank}: steps []" in out, out  # nothing committed
    assert any("'model.up.weight" in out for out in outputs), outputs


@pytest.mark.slow
def test_the_guard_of_a_dtensor_sees_changes_through_it_and_through_the_parameter(tmp_path):
    for rank, out in enumerate(_run("versions", tmp_path)):
        # an in-place op on the DTensor moves its own counter, not its local tensor's
        assert f"rank {rank}: dtensor: tensor 'w' changed after async_save(lazy)" in out, out
        # a change through the parameter's to_local() moves only the parameter's counters
        assert f"rank {rank}: local: tensor 'w' changed after async_save(lazy)" in out, out
        assert "not detected" not in out, out


# -- in this process: views, flat storage, a compiled step ------------------------------------


def test_the_cover_keys_by_storage_and_bytes_not_by_tensor_object():
    flat = torch.zeros(64)  # as FSDP keeps a padded flat shard: parameters are views of it
    first, second = flat[:24].view(4, 6), flat[24:56]
    optimizer = torch.optim.SGD([torch.nn.Parameter(flat)], lr=0.1)
    cover = FenceCover([optimizer])
    assert cover.covers(first) and cover.covers(second.detach()) and cover.covers(flat[56:])
    assert not cover.covers(torch.zeros(4))  # same values, other memory
    other = torch.zeros(8)
    narrow = FenceCover([torch.optim.SGD([other[2:]], lr=0.1)])
    assert narrow.covers(other.detach()[3:]) and not narrow.covers(other.detach())
    assert local_part(other) is other


def test_a_state_dicts_detached_parameters_are_read_after_the_call():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    state = {f"model.{k}": v for k, v in model.state_dict().items()}  # param.detach()s
    for index, per_param in optimizer.state_dict()["state"].items():
        state.update({f"optim.{index}.{k}": v for k, v in per_param.items()})
    guard = LazyGuard(state, fence_bytes=None, optimizers=[optimizer])
    assert guard.call_copied == {
        "model.1.running_mean",
        "model.1.running_var",
        "model.1.num_batches_tracked",
    }
    guard.finish()


# dynamo, tracing the step, calls functions of torch that warn they are deprecated
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_step_compiled_with_torch_compile_still_passes_the_fence():
    w = torch.nn.Parameter(torch.arange(1024, dtype=torch.float32))
    optimizer = torch.optim.Adam([w], lr=0.5)
    w.grad = torch.ones_like(w)
    optimizer.step()  # the state exists: the save holds it
    exp_avg = optimizer.state[w]["exp_avg"]
    before_w, before_m = w.detach().clone(), exp_avg.clone()
    guard = LazyGuard(
        {"w": w.detach(), "exp_avg": exp_avg}, fence_bytes=None, optimizers=[optimizer]
    )
    assert guard.call_copied == frozenset()

    # dynamo traces the step (the backend does not change how hooks are traced)
    @torch.compile(backend="eager")
    def step() -> None:
        optimizer.step()

    step()
    assert optimizer.state[w]["exp_avg"] is exp_avg  # the same state tensors
    assert not torch.equal(w.detach(), before_w)
    assert guard.snapshot_bytes == 2 * w.numel() * 4  # the fence took both before the step
    for name, before in (("w", before_w), ("exp_avg", before_m)):
        guard.begin(name)
        with guard.read(name, 0, before.numel() * 4) as part:
            assert torch.equal(part.view(torch.float32), before), name
        guard.copied(name)
    guard.finish()
