"""Node replicas never restore a wrong step and never touch what fastckpt did not make:
3 ranks on 3 simulated nodes (``FASTCKPT_NODE``), gloo on loopback, small tensors.

With ``replicas=1`` on 3 nodes each rank's copies go to the next node: rank 0's steps are
held by rank 1, rank 1's by rank 2, rank 2's by rank 0."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import socket
import sys

import pytest
import torch

from fastckpt.checkpoint.save import save
from fastckpt.distributed.peers import choose_peers
from tests.python_processes import launch

RANKS = pathlib.Path(__file__).with_name("replica_safety_ranks.py")
NODES = [0, 1, 2]
STEP3 = "step-000000000003"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(base: pathlib.Path, *args: str) -> list[dict]:
    """One process per rank, rank r on node r; each rank's RESULT line, or its exit code
    and the tail of its stderr."""
    port = str(_free_port())
    children = [
        launch(
            [sys.executable, str(RANKS), str(rank), str(len(NODES)), port, str(base), *args],
            env={**os.environ, "FASTCKPT_NODE": str(node), "FASTCKPT_NO_PROGRESS": "1"},
        )
        for rank, node in enumerate(NODES)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=240)
        lines = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(
            json.loads(lines[-1]) if lines else {"code": child.returncode, "stderr": err[-3000:]}
        )
    return results


def fast(base: pathlib.Path, rank: int) -> pathlib.Path:
    return base / f"node-{rank}" / f"rank-{rank:05d}"


def store(base: pathlib.Path, rank: int, source: int) -> pathlib.Path:
    """Where ``rank`` keeps ``source``'s replicas."""
    return fast(base, rank) / ".replicas" / f"from-rank-{source:05d}"


def root(base: pathlib.Path, rank: int) -> pathlib.Path:
    return base / "root" / f"rank-{rank:05d}"


def lose_node(base: pathlib.Path, node: int) -> None:
    shutil.rmtree(base / f"node-{node}")


def digest(path: pathlib.Path) -> dict[str, str]:
    """Every entry under ``path``: a file's SHA-256, a link's target (links not followed)."""
    found = {}
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(folder, name)
            key = os.path.relpath(full, path)
            if os.path.islink(full):
                found[key] = "link " + os.readlink(full)
            elif os.path.isfile(full):
                found[key] = hashlib.sha256(pathlib.Path(full).read_bytes()).hexdigest()
            else:
                found[key] = "dir"
    return found


def outside(base: pathlib.Path) -> pathlib.Path:
    """Another run's files, outside every tier: planted links point here."""
    there = base / "outside"
    (there / "victim-run" / "step-000000000001").mkdir(parents=True)
    (there / "victim-run" / "step-000000000001" / "state.safetensors").write_bytes(b"v" * 999)
    (there / "plain").mkdir()
    (there / "plain" / "a.bin").write_bytes(os.urandom(4096))
    generator = torch.Generator().manual_seed(7)
    save({"w": torch.randn(256, generator=generator)}, str(there / "other.safetensors"))
    return there


def flip_last_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_peers_of_three_nodes_form_a_ring():
    assert choose_peers([0, 1, 2], 1) == [[1], [2], [0]]


def test_close_keeps_keep_fast_steps_and_one_replica_per_source(tmp_path):
    saved = run_ranks(tmp_path, "save", "3", "0")
    assert [r.get("steps") for r in saved] == [[STEP3]] * 3, saved
    sources = [2, 0, 1]
    assert [r["replicas"] for r in saved] == [[f"from-rank-{s:05d}/{STEP3}"] for s in sources]


@pytest.mark.slow
def test_a_replica_of_a_step_set_aside_and_saved_again_is_never_restored(tmp_path):
    run_ranks(tmp_path, "save", "3", "0")
    lose_node(tmp_path, 2)  # node 2 is lost before its step 3 drained or was replicated
    shutil.rmtree(root(tmp_path, 2) / STEP3)
    shutil.rmtree(store(tmp_path, 0, 2) / STEP3)
    old = tmp_path / "old-replica"
    shutil.copytree(store(tmp_path, 1, 0) / STEP3, old)
    # the ranks go back to step 2, set step 3 aside, and save step 3 again (other values)
    resumed = run_ranks(tmp_path, "restore", "none", "0", "1")
    assert [r.get("step") for r in resumed] == [2, 2, 2], resumed
    assert [r["resumed"] for r in resumed] == [3, 3, 3]
    # the new step 3 never reached rank 0's peer: it still holds the copy set aside
    shutil.rmtree(store(tmp_path, 1, 0))
    store(tmp_path, 1, 0).mkdir()
    shutil.copytree(old, store(tmp_path, 1, 0) / STEP3)
    lose_node(tmp_path, 0)
    restored = run_ranks(tmp_path, "restore", "none", "0,1")
    assert [r.get("step") for r in restored] == [3, 3, 3], restored
    assert [r["salt"] for r in restored] == [1, 1, 1]  # the step committed, on every rank
    assert restored[0]["source"] == "fallback"


def test_ranks_asking_for_different_steps_all_fail_naming_them(tmp_path):
    run_ranks(tmp_path, "save", "3", "0")
    results = run_ranks(tmp_path, "restore", "2,3,3", "0")
    for result in results:
        assert "step" not in result, results
        error = result["error"]
        assert "rank 0" in error and "step=2" in error and "step=3" in error, error
    for rank, result in enumerate(results):  # nothing set aside: the step is still there
        assert STEP3 in result["steps"], results
        assert not [p for p in fast(tmp_path, rank).iterdir() if ".abandoned-" in p.name]


def test_a_damaged_own_copy_is_replaced_by_a_peers_intact_replica(tmp_path):
    run_ranks(tmp_path, "save", "3", "0")
    flip_last_byte(fast(tmp_path, 1) / STEP3 / "state.safetensors")
    shutil.rmtree(root(tmp_path, 1) / STEP3)  # not drained: the peer's copy is the only one
    results = run_ranks(tmp_path, "restore", "none", "0")
    assert [r.get("step") for r in results] == [3, 3, 3], results
    assert [r["salt"] for r in results] == [0, 0, 0]
    assert [r["source"] for r in results] == ["own", "peer 2", "own"]
    assert any(n.startswith(f"{STEP3}.damaged-") for n in results[1]["steps"])


@pytest.mark.slow  # the torture harness and the peer-rescue test above cover the path
def test_no_intact_copy_left_fails_every_rank_at_once(tmp_path):
    run_ranks(tmp_path, "save", "3", "0")
    flip_last_byte(fast(tmp_path, 1) / STEP3 / "state.safetensors")
    flip_last_byte(store(tmp_path, 2, 1) / STEP3 / "state.safetensors")
    shutil.rmtree(root(tmp_path, 1) / STEP3)
    results = run_ranks(tmp_path, "restore", "3,3,3", "0")
    for result in results:
        assert "step" not in result, results
        assert "rank 1's step 3" in result["error"], result
        assert "damaged tensors" in result["error"]
    # ranks 0 and 2 lost nothing
    assert STEP3 in results[0]["steps"] and STEP3 in results[2]["steps"]


def test_steps_newer_than_the_restored_are_set_aside_in_a_url_root(tmp_path):
    results = run_ranks(tmp_path, "url-root")
    assert [r.get("step") for r in results] == [2, 2, 2], results
    assert [r["salt"] for r in results] == [0, 0, 0]
    assert [r["resumed"] for r in results] == [3, 3, 3]  # no rank refuses step 3
    for result in results[:2]:  # ranks 0 and 1 had a step 3: set aside in root, kept
        assert any(n.startswith(f"{STEP3}.abandoned-") for n in result["root"]), result
    assert [r["committed"] for r in results] == [[1, 2, 3]] * 3


def test_links_planted_in_the_replica_stores_are_never_followed(tmp_path):
    there = outside(tmp_path)
    # rank 1 keeps rank 0's replicas: its folder for them is a link to another run's
    (fast(tmp_path, 1) / ".replicas").mkdir(parents=True)
    os.symlink(there / "victim-run", store(tmp_path, 1, 0))
    # rank 2 keeps rank 1's: links named like the steps to come and gone
    store(tmp_path, 2, 1).mkdir(parents=True)
    os.symlink(there / "plain", store(tmp_path, 2, 1) / STEP3)
    os.symlink(
        there / "victim-run" / "step-000000000001", store(tmp_path, 2, 1) / "step-000000000001"
    )
    # rank 0 keeps rank 2's: a complete-looking replica whose file is a link to another run's
    planted = store(tmp_path, 0, 2) / "step-000000000007"
    planted.mkdir(parents=True)
    os.symlink(there / "other.safetensors", planted / "state.safetensors")
    (planted / "COMMITTED").write_text(json.dumps({"step": 7, "files": {}}))
    size = (there / "other.safetensors").stat().st_size
    files = [["state.safetensors", size], ["COMMITTED", (planted / "COMMITTED").stat().st_size]]
    (planted / "REPLICA").write_text(json.dumps({"step": 7, "rank": 2, "node": 2, "files": files}))
    before = digest(there)
    saved = run_ranks(tmp_path, "save", "3", "0")
    assert all("steps" in r for r in saved), saved
    assert digest(there) == before
    # each planted link is still a link to its target (renamed aside or left)
    links = {
        os.readlink(os.path.join(folder, name))
        for folder, dirs, names in os.walk(tmp_path / "node-1")
        for name in dirs + names
        if os.path.islink(os.path.join(folder, name))
    }
    assert str(there / "victim-run") in links
    # rank 2's links named like rank 1's steps were renamed aside, each still a link to its
    # target, and the real replica took the name
    for step, target in ((1, there / "victim-run" / "step-000000000001"), (3, there / "plain")):
        aside = list(store(tmp_path, 2, 1).glob(f"step-{step:012d}.link-*"))
        assert len(aside) == 1 and os.readlink(aside[0]) == str(target), aside
    # rank 0's real replica of rank 2's step 3 arrived beside the planted one
    assert (store(tmp_path, 0, 2) / STEP3 / "REPLICA").is_file()
    assert (store(tmp_path, 1, 0) / STEP3 / "REPLICA").is_file()
    lose_node(tmp_path, 2)
    shutil.rmtree(root(tmp_path, 2) / STEP3)
    results = run_ranks(tmp_path, "restore", "none", "0")
    assert [r.get("step") for r in results] == [3, 3, 3], results
    assert [r["salt"] for r in results] == [0, 0, 0]
    assert results[2]["source"] == "peer 0"
    assert digest(there) == before


def test_a_drain_refuses_a_linked_state_file(tmp_path):
    there = outside(tmp_path)
    run_ranks(tmp_path, "save", "1", "0")
    step1 = fast(tmp_path, 0) / "step-000000000001"
    planted = fast(tmp_path, 0) / "step-000000000002"
    planted.mkdir()
    os.symlink(there / "other.safetensors", planted / "state.safetensors")
    marker = json.loads((step1 / "COMMITTED").read_text())
    marker.update(step=2, files={"state.safetensors": (there / "other.safetensors").stat().st_size})
    (planted / "COMMITTED").write_text(json.dumps(marker))
    before = digest(there)
    results = run_ranks(tmp_path, "drain")
    assert "drain" in results[0], results
    assert "state.safetensors" in results[0]["drain"] and "symbolic link" in results[0]["drain"]
    assert results[0]["root_steps"] == [1]  # nothing of step 2 committed in root
    assert [r["step"] for r in results] == [1, 1, 1]
    assert [r["salt"] for r in results] == [0, 0, 0]
    assert digest(there) == before
    assert os.path.islink(planted / "state.safetensors") or any(
        os.path.islink(p / "state.safetensors")
        for p in fast(tmp_path, 0).glob("step-000000000002.*")
    )
