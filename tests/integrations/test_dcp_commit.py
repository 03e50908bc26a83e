"""The commit of DCP saves into a local directory (fastckpt.integrations.dcp.writer and its
_stale_files): ``.metadata`` publishes a save, and only files that neither the published
checkpoint nor a save still running needs are removed. Real ranks (gloo on loopback), real
files, real flocks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_ranks import commit_cases, run_ranks

from fastckpt.integrations.dcp import FastCkptWriter, load_full, read_dcp_metadata
from fastckpt.integrations.dcp._stale_files import LiveSave

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _published_files(path: str) -> set[str]:
    return {".metadata", *(f for f, _ in read_dcp_metadata(path).storage_data.values())}


@pytest.fixture(scope="module")
def commit_run(tmp_path_factory):
    """One run of 2 ranks for both cases (see dcp_ranks.commit_cases); the ranks assert."""
    base = str(tmp_path_factory.mktemp("commit"))
    os.makedirs(base + "/concurrent")
    run_ranks(2, commit_cases, base)
    return base


def test_concurrent_savers_into_one_directory_leave_one_loadable_checkpoint(commit_run):
    # Each rank saved into one directory at once (every save succeeded) and then loaded
    # whichever checkpoint was published last, whole. One more save after both: everything
    # the others left behind goes, the markers of running saves included.
    path = commit_run + "/concurrent"
    writer = FastCkptWriter(path)
    dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)
    writer.close()
    assert sorted(os.listdir(path)) == sorted(_published_files(path))
    assert torch.equal(load_full(path)["w"], torch.ones(2))


def test_a_failed_save_leaves_the_previous_checkpoint_unchanged(commit_run):
    # The ranks checked .metadata's bytes, the old files and a 2-rank load after the failure.
    assert torch.equal(
        load_full(commit_run + "/failed")["plain"], torch.arange(7, dtype=torch.int32)
    )


def test_files_of_a_running_save_are_not_removed_by_another_commit(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.zeros(2)}, storage_writer=FastCkptWriter(path), no_dist=True)
    # A save still running: its marker is held and one rank's file is already durable.
    running = LiveSave(path, "00112233aabb")
    rank_file = os.path.join(path, "__1_00112233aabb.safetensors")
    with open(rank_file, "wb") as f:
        f.write(b"rank 1's shard")
    other = FastCkptWriter(path)
    dcp.save({"w": torch.ones(2)}, storage_writer=other, no_dist=True)
    other.close()
    assert os.path.exists(rank_file)  # not referenced by .metadata, but its save is running
    # Once that save is over (here: it failed), the next commit removes its file.
    running.release()
    last = FastCkptWriter(path)
    dcp.save({"w": torch.full((2,), 2.0)}, storage_writer=last, no_dist=True)
    last.close()
    assert sorted(os.listdir(path)) == sorted(_published_files(path))


def test_temporary_files_of_live_writers_are_kept(tmp_path):
    """A commit removes only the temporaries whose writer is gone (their flock is free)."""
    from fastckpt.io.commit import AtomicFile

    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.zeros(2)}, storage_writer=FastCkptWriter(path), no_dist=True)
    live = AtomicFile(os.path.join(path, ".metadata"), direct=False)
    dead = os.path.join(path, "__0_0123456789ab.safetensors.0123456789ab.tmp")
    open(dead, "wb").close()
    writer = FastCkptWriter(path)
    dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)
    writer.close()
    assert os.path.exists(live.tmp_path) and not os.path.exists(dead)
    live.abort()
