"""Peer replication of the fast tier with real processes on simulated nodes (several ranks
per ``FASTCKPT_NODE``, each node with its own fast directory, gloo on loopback): a node is
lost (its processes gone, its fast directory deleted) and a fresh run restores its newest
step from a peer's memory, bit-identical; a replica cut mid-transfer is never used."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import sys

import pytest

from fastckpt import CheckpointManager
from fastckpt.distributed.peers import choose_peers, ring
from fastckpt.distributed.replica_store import ReplicaStore
from tests.python_processes import launch

RANKS = pathlib.Path(__file__).with_name("replication_ranks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    base: pathlib.Path, nodes: list[int], *args: str, env: dict[str, str] | None = None
) -> list[dict]:
    """Runs one process per rank (rank r on node ``nodes[r]``); each rank's RESULT line,
    or {"code": ..., "stderr": ...} for a rank that printed none."""
    port = str(_free_port())
    children = [
        launch(
            [sys.executable, str(RANKS), str(rank), str(len(nodes)), port, str(base), *args],
            env={**os.environ, **(env or {}), "FASTCKPT_NODE": str(node)},
        )
        for rank, node in enumerate(nodes)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=240)
        lines = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(
            json.loads(lines[-1]) if lines else {"code": child.returncode, "stderr": err[-3000:]}
        )
    return results


def lose_node(base: pathlib.Path, node: int) -> None:
    """A lost node's memory: its fast directory (its own steps and the replicas it held)."""
    shutil.rmtree(base / f"node-{node}")


def test_a_lost_nodes_newest_step_is_restored_from_a_peer_bit_identical(tmp_path):
    nodes = [0, 0, 1, 1]  # 4 ranks on 2 nodes
    saved = run_ranks(tmp_path, nodes, "manager-save", "3", "65536")
    assert all("bytes_sent" in r for r in saved), saved
    assert all(r["bytes_sent"] > 0 for r in saved)
    lose_node(tmp_path, 1)
    for rank in (2, 3):  # the root lags: node 1 died before its newest step drained
        shutil.rmtree(tmp_path / "root" / f"rank-{rank:05d}" / "step-000000000003")
    restored = run_ranks(tmp_path, nodes, "manager-restore")
    assert [r.get("step") for r in restored] == [3, 3, 3, 3], restored
    assert all(r["identical"] for r in restored)
    assert [r["source"] for r in restored] == ["own", "own", "peer 0", "peer 1"]
    # the recovered step is committed in the new node's fast tier and drained to root again
    for rank in (2, 3):
        fast = tmp_path / "node-1" / f"rank-{rank:05d}" / "step-000000000003"
        assert (fast / "COMMITTED").exists()
        assert (tmp_path / "root" / f"rank-{rank:05d}" / "step-000000000003" / "COMMITTED").exists()


@pytest.mark.slow
def test_a_replica_cut_mid_transfer_is_never_restored(tmp_path):
    nodes = [0, 1]
    # step 2's replication is paced to take ~4 s; node 1 is killed 1 s into it
    saved = run_ranks(
        tmp_path,
        nodes,
        "replicator-save",
        "2",
        str(4 << 20),
        str(1 << 20),
        "1.0",
        env={"FASTCKPT_VICTIM": "1"},
    )
    survivor = saved[0]
    assert "code" in saved[1] and saved[1]["code"] == -9, saved[1]
    assert survivor["last"].startswith("failed"), survivor
    assert survivor["held"] == {"1": [1]}  # step 1 complete; step 2 never listed
    assert survivor["seen_incoming"], "the kill did not land mid-transfer"
    assert survivor["incoming"] == []  # the survivor removed the half it had received
    lose_node(tmp_path, 1)
    recovered = run_ranks(tmp_path, nodes, "replicator-recover")
    assert [r.get("step") for r in recovered] == [1, 1], recovered
    assert [r["source"] for r in recovered] == ["own", "peer 0"]
    assert all(r["identical"] for r in recovered)
    # the half-received replica was removed when the survivor's store was opened again
    store = tmp_path / "node-0" / "rank-00000" / ".replicas"
    assert not [n for n in os.listdir(store) if n.startswith(".incoming-")]


def test_peers_lie_in_other_failure_domains_and_each_node_holds_k():
    # 4 nodes, 2 racks: nodes 0,1 in rack a, 2,3 in rack b; each node's copy goes to the other rack
    domains = {0: "a", 1: "a", 2: "b", 3: "b"}
    peers = choose_peers([0, 1, 2, 3], 1, domains)
    assert [domains[p[0]] != domains[n] for n, p in enumerate(peers)] == [True] * 4
    # balanced: every node receives exactly k copies
    peers2 = choose_peers([0, 0, 1, 1, 2, 2, 3, 3], 2, domains)
    received = [t for mine in peers2 for t in mine]
    assert sorted(received) == sorted(list(range(8)) * 2)
    assert ring([0, 1, 2, 3], domains) == [0, 2, 1, 3]


def test_replicas_not_below_the_nodes_or_without_a_fast_tier_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"replicas=1 needs at least 2 nodes"):
        CheckpointManager(tmp_path / "root", fast=tmp_path / "fast", replicas=1)
    with pytest.raises(ValueError, match=r"replicas=1 needs a local fast tier"):
        CheckpointManager(tmp_path / "root", replicas=1)
    with pytest.raises(ValueError, match=r"replicas must be a non-negative int"):
        CheckpointManager(tmp_path / "root", fast=tmp_path / "fast", replicas=-1)
    with pytest.raises(ValueError, match=r"replicas=1 needs full steps"):
        CheckpointManager(tmp_path / "root", fast=tmp_path / "fast", replicas=1, incremental=True)


def test_a_replica_store_lists_only_complete_replicas(tmp_path):
    store = ReplicaStore(tmp_path)
    incoming = store.incoming()
    (pathlib.Path(incoming) / "a.bin").write_bytes(b"12")
    store.commit(incoming, {"step": 4, "rank": 1, "node": 1, "files": [["a.bin", 2]]})
    # a replica whose file lost bytes (or its marker) no longer counts
    (tmp_path / "from-rank-00001" / "step-000000000004" / "a.bin").write_bytes(b"1")
    assert store.held() == {}
    # a newer complete replica replaces the older one
    incoming = store.incoming()
    (pathlib.Path(incoming) / "a.bin").write_bytes(b"34")
    store.commit(incoming, {"step": 5, "rank": 1, "node": 1, "files": [["a.bin", 2]]})
    assert store.held() == {1: [5]}
    assert os.listdir(tmp_path / "from-rank-00001") == ["step-000000000005"]
    with pytest.raises(ValueError, match="not a plain file name"):
        incoming = store.incoming()
        from fastckpt.distributed.replica_store import plain_name

        plain_name("../x")


@pytest.mark.slow
def test_a_step_the_lost_node_lacks_everywhere_is_set_aside_and_the_run_resumes(tmp_path):
    nodes = [0, 0, 1, 1]
    saved = run_ranks(tmp_path, nodes, "manager-save", "3", "4096")
    assert all("bytes_sent" in r for r in saved), saved
    lose_node(tmp_path, 1)
    for rank in (2, 3):  # step 3 of node 1's ranks survives nowhere: not in root, no replica
        shutil.rmtree(tmp_path / "root" / f"rank-{rank:05d}" / "step-000000000003")
        store = tmp_path / "node-0" / f"rank-{rank - 2:05d}" / ".replicas"
        shutil.rmtree(store / f"from-rank-{rank:05d}" / "step-000000000003")
    restored = run_ranks(tmp_path, nodes, "manager-restore", "resume")
    assert [r.get("step") for r in restored] == [2, 2, 2, 2], restored
    assert all(r["identical"] for r in restored)
    assert [r["resumed"] for r in restored] == [3, 3, 3, 3]
    # node 0's own step 3 was set aside (renamed, kept), not deleted
    fast = tmp_path / "node-0" / "rank-00000"
    assert [n for n in os.listdir(fast) if n.startswith("step-000000000003.abandoned-")]


def test_ranks_choose_peers_in_other_failure_domains_from_their_environment(tmp_path):
    # 4 nodes of 1 rank; FASTCKPT_FAILURE_DOMAIN per rank: nodes 0 and 1 in rack a, 2 and 3 in b
    port = str(_free_port())
    children = [
        launch(
            [sys.executable, str(RANKS), str(rank), "4", port, str(tmp_path), "peers", "1"],
            env={
                **os.environ,
                "FASTCKPT_NODE": str(rank),
                "FASTCKPT_FAILURE_DOMAIN": "ab"[rank // 2],
            },
        )
        for rank in range(4)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=240)
        assert child.returncode == 0, err[-3000:]
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    targets = [r["targets"] for r in results]
    assert targets == [[2], [3], [1], [0]]  # the ring 0, 2, 1, 3: every copy in the other rack
    assert [r["sources"] for r in results] == [[3], [2], [0], [1]]
