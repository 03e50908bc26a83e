"""The handshake before fastckpt's collectives (fastckpt.distributed.handshake): real rank
processes over gloo on loopback make a checkpoint call on some ranks only, or different
calls, and fail within seconds naming the ranks and what to do, instead of waiting for the
group's timeout."""

from __future__ import annotations

import os
import pathlib
import socket
import sys

import pytest

from fastckpt import config
from fastckpt.distributed.handshake import HandshakeError, handshake
from tests.python_processes import launch

RANKS = pathlib.Path(__file__).with_name("handshake_ranks.py")
HANDSHAKE_TIMEOUT = 10  # seconds (the default): a busy machine starts ranks seconds apart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(case: str, root: pathlib.Path, nofile: int = 0) -> list[str]:
    """Runs 2 ranks of handshake_ranks.py; every rank's stdout (each must exit 0)."""
    port = _free_port()
    env = {**os.environ, "FASTCKPT_HANDSHAKE_TIMEOUT": str(HANDSHAKE_TIMEOUT)}
    children = [
        launch(
            [sys.executable, str(RANKS), str(rank), "2", str(port), case, str(root)]
            + ([str(nofile)] if nofile else []),
            env=env,
        )
        for rank in (0, 1)
    ]
    outputs = [child.communicate(timeout=180) for child in children]
    for child, (_, err) in zip(children, outputs):
        assert child.returncode == 0, err[-4000:]
    return [out for out, _ in outputs]


def _failure(out: str, rank: int) -> tuple[float, str]:
    """How long rank ``rank``'s call took to fail, and its message."""
    line = next(x for x in out.splitlines() if x.startswith(f"rank {rank}: failed after "))
    head, message = line.split(" s: ", 1)
    return float(head.rsplit(" ", 1)[1]), message


# under a soft RLIMIT_NOFILE of 256 too (slow: the read-once tests run so by default)
@pytest.mark.parametrize("nofile", [0, pytest.param(256, marks=pytest.mark.slow)])
def test_a_manager_made_on_rank_0_only_fails_there_in_seconds(tmp_path, nofile):
    outputs = _run("manager", tmp_path, nofile)
    seconds, message = _failure(outputs[0], 0)
    assert message == (
        "CheckpointManager(...) was created on rank 0 only (ranks [1] did not join within "
        f"{HANDSHAKE_TIMEOUT} s; FASTCKPT_HANDSHAKE_TIMEOUT sets how long ranks wait for each "
        "other): create it on every rank, or pass distributed=False on a rank that saves alone"
    )
    assert seconds < 60  # the handshake's seconds, not the group's minutes
    assert "rank 1: done" in outputs[1]


def test_a_save_on_rank_0_only_fails_there_in_seconds(tmp_path):
    outputs = _run("save", tmp_path)
    seconds, message = _failure(outputs[0], 0)
    assert message.startswith("CheckpointManager.save was called on rank 0 only (ranks [1]")
    assert "call save() on every rank" in message and seconds < 60
    assert all(f"rank {r}: closed" in out for r, out in enumerate(outputs))


def test_restores_of_different_steps_fail_on_every_rank_naming_them(tmp_path):
    outputs = _run("restore", tmp_path)
    for rank, out in enumerate(outputs):
        _, message = _failure(out, rank)
        assert message == (
            "CheckpointManager.restore: the ranks disagree on step (rank 0 step=1, rank 1 "
            "step=2): every rank must pass the same step"
        )
        assert f"rank {rank}: restored 2" in out  # the next restore, alike, works


def test_different_calls_at_the_same_point_fail_on_every_rank(tmp_path):
    outputs = _run("different", tmp_path)
    for rank, out in enumerate(outputs):
        _, message = _failure(out, rank)
        assert "rank 0: CheckpointManager.save(step=2)" in message
        assert "rank 1: CheckpointManager.restore(step=1)" in message


def test_a_load_over_the_group_on_rank_0_only_fails_there_in_seconds(tmp_path):
    outputs = _run("load", tmp_path)
    seconds, message = _failure(outputs[0], 0)
    assert message.startswith(
        "fastckpt.load, open or load_into with group= was called on rank 0 only (ranks [1]"
    )
    assert seconds < 60


def test_a_handshake_is_a_few_store_round_trips_and_its_keys_do_not_pile_up(tmp_path):
    outputs = _run("round_trips", tmp_path)
    for rank, out in enumerate(outputs):
        assert f"rank {rank}: one handshake " in out
        grown = int(next(x for x in out.splitlines() if "keys grew by" in x).rsplit(" ", 1)[1])
        assert grown <= 2  # one key per rank at most, whatever the number of handshakes


def test_one_process_has_nothing_to_wait_for():
    handshake("CheckpointManager.save", None, agree_on={"step": 1})


def test_timeouts_come_from_the_environment(monkeypatch):
    assert config.group_timeout_seconds() == 300.0  # not torch's 30 minutes
    assert config.handshake_timeout_seconds() == 10.0
    monkeypatch.setenv("FASTCKPT_GROUP_TIMEOUT", "5")
    monkeypatch.setenv("FASTCKPT_HANDSHAKE_TIMEOUT", "2.5")
    assert config.group_timeout_seconds() == 5.0 and config.handshake_timeout_seconds() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("FASTCKPT_HANDSHAKE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="FASTCKPT_HANDSHAKE_TIMEOUT"):
            config.handshake_timeout_seconds()


def test_a_handshake_error_travels_between_ranks_whole():
    import pickle

    error = HandshakeError("rank 1 did not come", [1], {2: "CheckpointManager.save()"})
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and copy.missing == [1] and copy.differing == error.differing
