"""How replicated files travel (fastckpt.distributed.replica_transport), with real gloo ranks
on loopback: bytes identical over TCP and over gloo, a peer killed mid-transfer leaves no
torn replica and an error naming the rank, step and file, pacing holds the send rate down,
a connection without the round's token is refused, links and non-regular files are never
sent or written through."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from fastckpt.distributed import replica_transport as transport
from fastckpt.distributed.replica_transport import CHUNK, Sink, open_share

RANKS = pathlib.Path(__file__).with_name("replica_transport_ranks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(base: pathlib.Path, world: int, *args: str) -> list[dict]:
    port = str(_free_port())
    children = [
        subprocess.Popen(
            [sys.executable, str(RANKS), str(rank), str(world), port, str(base), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        lines = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(
            json.loads(lines[-1]) if lines else {"code": child.returncode, "stderr": err[-3000:]}
        )
    return results


@pytest.mark.parametrize("way", ["auto", "gloo"])
def test_replicated_bytes_are_identical_over_each_transport(tmp_path, way):
    # empty files (first, between, last), a byte, a page's tail, two chunks
    sizes = [0, 1, 0, 4095, CHUNK + 4097, 0]
    results = run_ranks(tmp_path, 2, "replicate", way, "0", *map(str, sizes))
    for result in results:
        assert "held" in result, result
        (source,) = result["sources"]
        assert result["held"] == {f"{source}/1": result["expected"]}
        assert result["sent"] == sum(sizes)
        assert result["sent_by"] == {"tcp" if way == "auto" else "gloo": sum(sizes)}


def test_pacing_holds_the_send_rate_down(tmp_path):
    rate, size = 4 << 20, 3 << 20  # 3 MiB at 4 MiB/s: at least (3 - 1 MiB burst) / 4 s
    results = run_ranks(tmp_path, 2, "replicate", "auto", str(rate), str(size))
    assert all("seconds" in r for r in results), results
    for result in results:
        assert result["sent_by"] == {"tcp": size}
        assert result["seconds"] >= (size - (1 << 20)) / rate  # a floor: never faster


def test_a_peer_killed_mid_transfer_leaves_no_torn_replica_and_names_it(tmp_path):
    # step 2's 8 MiB are paced to 4 MiB/s (2 s); rank 2 dies 0.7 s into the round
    results = run_ranks(tmp_path, 3, "kill", str(4 << 20), str(8 << 20), "0.7")
    assert results[2].get("code") == -9, results[2]
    # rank 0 receives from rank 2 (the ring 0 -> 1 -> 2 -> 0): its error names the peer,
    # the step and the file; what it had received of step 2 is gone, step 1 stays whole
    assert results[0]["error"] is not None, results[0]
    assert "rank 2" in results[0]["error"] and "step 2" in results[0]["error"], results[0]
    assert "part-0.bin" in results[0]["error"], results[0]
    assert results[0]["held"] == {"2": [1]}
    assert results[0]["leftover"] == []
    assert results[1]["error"] is not None  # the round fails on every rank, none goes on
    assert results[1]["leftover"] == []


def test_a_connection_without_the_rounds_token_is_closed(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    tokens = transport._Tokens()
    stranger = socket.create_connection(listener.getsockname())
    stranger.sendall(b"x" * 32)
    peer = socket.create_connection(listener.getsockname())
    peer.sendall(tokens.receiver.encode())
    try:
        accepted = transport._accept(listener, {5: tokens}, timeout=10.0)
        assert list(accepted) == [5]
        assert peer.recv(32) == tokens.sender.encode()  # the sender proves itself in turn
        assert stranger.recv(1) == b""  # closed, nothing sent to it
        accepted[5].close()
    finally:
        for s in (listener, stranger, peer):
            s.close()


def test_links_and_non_regular_files_are_never_sent(tmp_path):
    (tmp_path / "target.bin").write_bytes(b"secret")
    (tmp_path / "state.bin").symlink_to(tmp_path / "target.bin")
    with pytest.raises(OSError) as caught:
        open_share(1, 0, 0, str(tmp_path), ["state.bin"])
    assert caught.value.errno == errno.ELOOP
    os.mkfifo(tmp_path / "pipe.bin")
    with pytest.raises(OSError, match="not a regular file") as caught:
        open_share(1, 0, 0, str(tmp_path), ["pipe.bin"])
    assert caught.value.filename == str(tmp_path / "pipe.bin")
    with pytest.raises(ValueError, match="not a plain file name"):
        open_share(1, 0, 0, str(tmp_path), ["../target.bin"])


def test_a_sink_never_writes_through_a_link_planted_where_a_file_lands(tmp_path):
    (tmp_path / "target.bin").write_bytes(b"keep")
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "a.bin").symlink_to(tmp_path / "target.bin")
    with pytest.raises(FileExistsError):
        Sink(str(landing), {"step": 1, "files": [["a.bin", 4]]})
    assert (tmp_path / "target.bin").read_bytes() == b"keep"
