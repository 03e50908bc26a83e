"""async_save / async_load / prefetch: snapshots, errors, ordering, exit, prefetch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.checkpoint import asynchronous as background
from tests.python_processes import run


def test_snapshot_semantics(tmp_path):
    state = {"w": torch.ones(1 << 20), "b": torch.arange(10)}
    future = fastckpt.async_save(state, tmp_path / "s.safetensors")
    state["w"].fill_(-1)  # the caller may change the tensors as soon as async_save returns
    state["b"].zero_()
    assert future.result() is None and future.done()
    back = fastckpt.load(tmp_path / "s.safetensors")
    assert float(back["w"].min()) == 1.0 and back["b"].tolist() == list(range(10))


def test_snapshot_blocks_only_for_memory_when_budget_is_small(tmp_path):
    # 32 MiB through a 8 MiB cap: async_save waits for the disk to free buffers, then succeeds.
    state = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(8)}
    future = fastckpt.async_save(state, tmp_path / "big.safetensors", staging_bytes=8 << 20)
    for t in state.values():
        t.fill_(-5)
    future.result()
    back = fastckpt.load(tmp_path / "big.safetensors")
    assert [float(back[f"w{i}"][0]) for i in range(8)] == [float(i) for i in range(8)]


def test_errors_come_through_result(tmp_path):
    missing_dir = fastckpt.async_save({"a": torch.ones(1)}, tmp_path / "no" / "x.safetensors")
    with pytest.raises(FileNotFoundError):
        missing_dir.result()
    assert isinstance(missing_dir.exception(), FileNotFoundError)

    unsupported = fastckpt.async_save({"a": object()}, tmp_path / "y.safetensors")
    with pytest.raises(TypeError, match="object"):
        unsupported.result()
    assert not (tmp_path / "y.safetensors").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_directory_as_user(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    with pytest.raises(PermissionError):
        fastckpt.async_save({"a": torch.ones(1)}, ro / "x.safetensors").result()


def test_unwritable_directory(tmp_path):
    # Root ignores directory modes, so make the failure a real one: a path whose parent is a file.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    future = fastckpt.async_save({"a": torch.ones(1)}, blocker / "x.safetensors")
    with pytest.raises(NotADirectoryError):
        future.result()
    fastckpt.wait_all()  # the error was retrieved: it is not raised a second time


def test_wait_all_raises_an_error_nobody_retrieved(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    future = fastckpt.async_save({"a": torch.ones(1)}, blocker / "x.safetensors")
    future.wait()
    with pytest.raises(NotADirectoryError):
        fastckpt.wait_all()
    fastckpt.wait_all()  # reported once
    assert isinstance(future.exception(), NotADirectoryError)


def test_back_to_back_saves_commit_in_call_order(tmp_path):
    path = tmp_path / "same.safetensors"
    order: list[int] = []
    futures = []
    for i in range(5):
        f = fastckpt.async_save(
            {"step": torch.tensor(i), "pad": torch.randn(200_000)}, path, max_pending=3
        )
        f.add_done_callback(lambda fut, i=i: order.append(i))
        futures.append(f)
    for f in futures:
        f.result()
    assert order == sorted(order)
    assert int(fastckpt.load(path)["step"]) == 4


def test_max_pending_bounds_in_flight(tmp_path):
    seen = []
    original = background._begin

    def spy(future, max_pending):
        original(future, max_pending)
        seen.append(background._in_flight)

    background._begin = spy
    try:
        futures = [
            fastckpt.async_save(
                {"x": torch.randn(100_000)}, tmp_path / f"{i}.safetensors", max_pending=1
            )
            for i in range(4)
        ]
        fastckpt.wait_all()
    finally:
        background._begin = original
    assert max(seen) == 1
    assert all(f.done() for f in futures)
    with pytest.raises(ValueError):
        fastckpt.async_save({}, tmp_path / "z.safetensors", max_pending=0)


def test_wait_all_and_future_api(tmp_path):
    futures = [
        fastckpt.async_save({"x": torch.full((1000,), i)}, tmp_path / f"{i}.safetensors")
        for i in range(3)
    ]
    fastckpt.wait_all()
    assert all(f.done() for f in futures)
    assert futures[0].wait(0) is True
    calls = []
    futures[0].add_done_callback(calls.append)
    assert calls == [futures[0]]
    failing = fastckpt.async_save({"x": object()}, tmp_path / "bad.safetensors")
    with pytest.raises(TypeError):
        fastckpt.wait_all()
    failing.exception()


def test_snapshot_false_writes_live_tensors(tmp_path):
    state = {"w": torch.randn(1000)}
    future = fastckpt.async_save(state, tmp_path / "n.safetensors", snapshot=False)
    future.result()
    assert torch.equal(fastckpt.load(tmp_path / "n.safetensors")["w"], state["w"])


def test_dropped_failed_future_is_logged(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="fastckpt"):
        future = fastckpt.async_save({"x": object()}, tmp_path / "lost.safetensors")
        future.wait()
        del future
        import gc

        gc.collect()
    assert "never retrieved" in caplog.text


def test_pending_save_completes_at_exit(tmp_path):
    path = tmp_path / "exit.safetensors"
    script = textwrap.dedent(f"""
        import torch, fastckpt
        state = {{f"w{{i}}": torch.full((1 << 20,), float(i)) for i in range(16)}}
        fastckpt.async_save(state, {str(path)!r}, staging_bytes=8 << 20, snapshot=True)
        # no wait: the interpreter must finish the save before it exits
    """)
    out = run([sys.executable, "-c", script], timeout=120)
    assert out.returncode == 0, out.stderr
    back = fastckpt.load(path, verify=True)
    assert float(back["w15"][0]) == 15.0
    assert [p.name for p in tmp_path.iterdir()] == ["exit.safetensors"]


def test_failed_save_at_exit_is_reported(tmp_path):
    script = textwrap.dedent(f"""
        import fastckpt
        fastckpt.async_save({{"x": object()}}, {str(tmp_path / "bad.safetensors")!r})
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "never retrieved" in out.stderr and "TypeError" in out.stderr


def test_killed_during_save_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "k.safetensors"
    fastckpt.save({"v": torch.ones(4)}, path)
    before = path.read_bytes()
    script = textwrap.dedent(f"""
        import os, signal, torch, fastckpt
        state = {{f"w{{i}}": torch.randn(1 << 20) for i in range(64)}}
        fastckpt.async_save(state, {str(path)!r}, staging_bytes=8 << 20)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = run([sys.executable, "-c", script], timeout=120)
    assert out.returncode == -9
    assert path.read_bytes() == before  # a stray temp file may remain, never a torn checkpoint


def test_async_load_and_errors(tmp_path):
    fastckpt.save({"a": torch.arange(5), "b": torch.ones(2)}, tmp_path / "l.safetensors")
    future = fastckpt.async_load(tmp_path / "l.safetensors", keys=["a"])
    assert future.result()["a"].tolist() == [0, 1, 2, 3, 4]
    missing = fastckpt.async_load(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError):
        missing.result(timeout=30)


def test_prefetch(tmp_path):
    state = {f"layer{i}": torch.full((50_000,), float(i)) for i in range(6)}
    fastckpt.save(state, tmp_path / "p.safetensors")
    with fastckpt.open(tmp_path / "p.safetensors") as r:
        r.prefetch(["layer2", "layer4"], verify=True)
        assert float(r.get_tensor("layer4")[0]) == 4.0
        assert float(r.get_tensor("layer2")[0]) == 2.0
        assert float(r.get_tensor("layer1")[0]) == 1.0
        r.prefetch(["layer5"])  # closing with a prefetch in flight waits for it
    with pytest.raises(TypeError):
        fastckpt.open(tmp_path / "p.safetensors").prefetch("layer1")


def test_prefetch_overlaps_a_thread(tmp_path):
    fastckpt.save({"x": torch.randn(1 << 20)}, tmp_path / "t.safetensors")
    with fastckpt.open(tmp_path / "t.safetensors") as r:
        r.prefetch(["x"])
        results = []
        t = threading.Thread(target=lambda: results.append(r.get_tensor("x")))
        t.start()
        t.join(60)
        assert results and results[0].numel() == 1 << 20


def test_future_result_timeout(tmp_path):
    gate = threading.Event()
    future = background.SaveFuture("x")
    threading.Thread(target=lambda: (gate.wait(5), future._set(None))).start()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    gate.set()
    assert future.result(timeout=10) is None
    time.sleep(0)


def test_prepare_staging_allocates_the_pool_ahead(tmp_path):
    """After prepare_staging, an async save takes its buffers from the prepared pool."""
    ready = fastckpt.prepare_staging(96 << 20)
    assert ready >= 96 << 20
    pool = background._pool
    allocated = pool._allocated
    state = {"w": torch.randn(16 << 18)}  # 16 MiB
    fastckpt.async_save(state, tmp_path / "a.safetensors").result()
    assert background._pool is pool and pool._allocated == allocated
    assert torch.equal(fastckpt.load(tmp_path / "a.safetensors")["w"], state["w"])
    with pytest.raises(ValueError, match="nbytes"):
        fastckpt.prepare_staging(-1)
    fastckpt.release_staging()
    assert pool._allocated == 0


@pytest.mark.cuda
def test_prepared_cuda_staging_is_registered_and_snapshots_device_tensors(tmp_path):
    assert fastckpt.prepare_staging(64 << 20, cuda=True) >= 64 << 20
    assert all(b.cuda_registered for b in background._pool._free)
    state = {"w": torch.randn(4 << 18, device="cuda")}
    future = fastckpt.async_save(state, tmp_path / "c.safetensors")
    expected = state["w"].cpu()
    state["w"].zero_()
    future.result()
    assert torch.equal(fastckpt.load(tmp_path / "c.safetensors")["w"], expected)
    fastckpt.release_staging()


# -- order of saves to one path ---------------------------------------------------------------


def test_save_after_async_save_to_same_path_wins(tmp_path):
    # A large async save still writing when a small sync save to the same path returns: the
    # sync save must wait, or the background commit would rename step 1 over step 2.
    path = tmp_path / "order.safetensors"
    step1 = {f"w{i}": torch.full((4 << 20,), 1.0) for i in range(8)}  # 128 MiB
    future = fastckpt.async_save(step1, path)  # returns after the snapshot, writes on
    fastckpt.save({"w0": torch.full((4,), 2.0)}, path)
    assert future.done()  # save() waited for it
    future.result()
    back = fastckpt.load(path)
    assert list(back) == ["w0"] and float(back["w0"][0]) == 2.0
    assert [p.name for p in tmp_path.iterdir()] == ["order.safetensors"]


def test_async_saves_to_same_path_commit_in_call_order(tmp_path):
    path = tmp_path / "order.safetensors"
    first = fastckpt.async_save({"w": torch.full((8 << 20,), 1.0)}, path)
    second = fastckpt.async_save({"w": torch.full((4,), 2.0)}, path)
    second.result()
    first.result()
    assert float(fastckpt.load(path)["w"][0]) == 2.0


# -- new options ------------------------------------------------------------------------------


@pytest.mark.parametrize("snapshot", [True, False])
@pytest.mark.parametrize("direct_io", [True, False, None])
def test_async_save_takes_direct_io(tmp_path, snapshot, direct_io):
    state = {"w": torch.arange(3 << 20, dtype=torch.float32), "b": torch.arange(7)}
    path = tmp_path / "d.safetensors"
    fastckpt.async_save(state, path, snapshot=snapshot, direct_io=direct_io).result()
    back = fastckpt.load(path, verify=True)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


def test_async_save_takes_piece_size(tmp_path):
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB
    path = tmp_path / "p.safetensors"
    fastckpt.async_save(state, path, piece_size=1 << 20).result()
    fastckpt.save(state, tmp_path / "ref.safetensors", piece_size=1 << 20)
    ours, ref = path.read_bytes(), (tmp_path / "ref.safetensors").read_bytes()
    assert ours == ref  # same layout, same piece checksums as save()
    with pytest.raises(ValueError, match="piece_size"):
        fastckpt.async_save(state, path, piece_size=1000).result()


def test_async_save_takes_progress(tmp_path, capsys):
    state = {"w": torch.ones(1 << 20)}
    fastckpt.async_save(state, tmp_path / "g.safetensors", progress=False).result()
    assert "saving" not in capsys.readouterr().err
    fastckpt.async_save(state, tmp_path / "g.safetensors", progress=True).result()
    assert "saving" in capsys.readouterr().err
    assert float(fastckpt.load(tmp_path / "g.safetensors")["w"][0]) == 1.0


# -- Ctrl-C -------------------------------------------------------------------------------------


def test_ctrl_c_during_snapshot_is_raised(tmp_path):
    # The interrupt lands in the snapshot copy; async_save must raise it (after removing its
    # temporary file), not return a failed future while training goes on.
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time, torch, fastckpt
        state = {{f"w{{i}}": torch.full((8 << 20,), float(i)) for i in range(8)}}  # 256 MiB
        fastckpt.prepare_staging(256 << 20)
        main = threading.get_ident()

        def interrupt_in_snapshot():
            # Ctrl-C once the main thread is inside the snapshot copy (StreamWriter.fill).
            while True:
                frame = sys._current_frames().get(main)
                while frame is not None and frame.f_code.co_name != "fill":
                    frame = frame.f_back
                if frame is not None:
                    os.kill(os.getpid(), signal.SIGINT)
                    return
                time.sleep(0.0002)

        threading.Thread(target=interrupt_in_snapshot, daemon=True).start()
        try:
            for _ in range(50):
                future = fastckpt.async_save(state, {str(tmp_path / "c.safetensors")!r})
                if future.done() and future.exception() is not None:
                    print("FUTURE", repr(future.exception()))
                    break
                future.wait()
            else:
                print("NOT INTERRUPTED")
        except KeyboardInterrupt:
            print("RAISED")
        fastckpt.wait_all()
    """)
    out = run([sys.executable, "-c", script], timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "RAISED", out.stdout + out.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_two_ctrl_c_at_exit_with_pending_save(tmp_path):
    # Ctrl-C at exit cancels the pending save (it removes its temporary file); a second one
    # quits at once, leaving a temporary file the next save removes. Never a save thread
    # killed inside native code by the interpreter's finalization.
    import signal

    path = tmp_path / "exit.safetensors"
    script = textwrap.dedent(f"""
        import torch, fastckpt
        state = {{f"w{{i}}": torch.randn(16 << 20) for i in range(8)}}  # 512 MiB
        # snapshot=False: the save thread is in native code (copies, writes) when exit comes
        fastckpt.async_save(state, {str(path)!r}, staging_bytes=32 << 20, snapshot=False)
        print("exiting", flush=True)
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "exiting"
    time.sleep(0.3)
    child.send_signal(signal.SIGINT)
    time.sleep(0.3)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert "terminate called" not in err, err
    assert child.returncode in (0, 130, -signal.SIGINT), err
    fastckpt.save({"x": torch.ones(2)}, path)  # removes what a dead writer left
    assert [p.name for p in tmp_path.iterdir()] == ["exit.safetensors"]
