"""Read-once loads across a process group: real ranks (processes on loopback over gloo), real
files. Every rank compares what it got with what it reads alone, bit for bit, and the ranks
count the bytes they read from storage together (see read_once_ranks.read_once_cases)."""

from __future__ import annotations

import pytest
from read_once_ranks import (
    dcp_cases,
    differing_content_cases,
    manager_case,
    read_once_cases,
    run_ranks,
    write_checkpoints,
    write_steps,
)

from fastckpt.distributed.read_once import plan_pieces


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    base = str(tmp_path_factory.mktemp("read-once"))
    write_checkpoints(base)
    return base


@pytest.mark.parametrize("world", [2, 3])
def test_read_once_matches_reading_alone(checkpoints, world):
    run_ranks(world, read_once_cases, checkpoints)


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_reader_reads_every_stored_byte_once(tmp_path, world):
    run_ranks(world, dcp_cases, str(tmp_path))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_opened_other_content_all_stop_naming_both_files(tmp_path, world):
    """Two steps of a run with the same shapes, a file saved over the path between the
    ranks' opens, a sharded directory saved again: every rank raises, naming the ranks and
    both files (the shard, the file of a chain), and nothing is read into the model."""
    write_steps(str(tmp_path))
    run_ranks(world, differing_content_cases, str(tmp_path))


def test_manager_restore_reads_once_across_ranks(tmp_path):
    run_ranks(2, manager_case, str(tmp_path / "run"))


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_stripes_cover_every_tensor_once_balanced_by_bytes(world):
    sizes = [(f"t{i}", (i * 7919) % 5000 + 1) for i in range(200)]
    pieces = plan_pieces(sizes, world, piece_bytes=20_000)
    names = [n for p in pieces for n in p.names]
    assert sorted(names) == sorted(n for n, _ in sizes)
    per_rank = [0] * world
    for p in pieces:
        per_rank[p.owner] += sum(n for name, n in sizes if name in p.names)
        assert p.nbytes <= 20_000 or len(p.names) == 1
    largest = max(n for _, n in sizes)
    assert max(per_rank) - min(per_rank) <= 2 * largest  # whole tensors: within two of one


def test_a_tensor_larger_than_a_piece_is_a_piece_of_its_own():
    sizes = [("a", 10), ("huge", 1000), ("b", 10), ("c", 1000)]
    pieces = plan_pieces(sizes, 2, piece_bytes=100)
    assert [p.names for p in pieces if p.owner == 0] == [("a",), ("huge",)]
    assert [p.names for p in pieces if p.owner == 1] == [("b",), ("c",)]
    assert [(p.round, p.owner) for p in pieces] == sorted((p.round, p.owner) for p in pieces)
