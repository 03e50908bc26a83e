"""fastckpt.dcp at fsspec URLs: real ranks (spawned processes, gloo on loopback) saving to and
loading from a real S3 server (moto on loopback, see conftest.py), and ``memory://`` in one
process. The ranks' values are those of dcp_ranks, so every process knows what a checkpoint
must hold."""

from __future__ import annotations

import copy
import json
import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_ranks import (
    EXTRAS_TARGET,
    PIECE,
    check_full,
    full_values,
    run_ranks,
    s3_four_rank_loads,
    s3_two_rank_cases,
)

import fastckpt
from fastckpt.cli import main as cli
from fastckpt.dcp import FastCkptReader, FastCkptWriter, load_full
from fastckpt.integrations import remote
from fastckpt.integrations.dcp import (
    describe_dcp,
    is_dcp_checkpoint,
    read_dcp_metadata,
    verify_dcp,
)

pytest.importorskip("fsspec")

pytestmark = [
    # DCP says so whenever a no_dist=True call runs in one process, which these tests mean to do.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    # botocore and moto use datetime.utcnow and friends on some versions
    pytest.mark.filterwarnings("ignore::DeprecationWarning:botocore"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:moto"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def _names(fs, url: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(url, detail=False))


def _full_target() -> dict:
    full = {"model": {k: torch.zeros_like(v) for k, v in full_values().items() if k != "plain"}}
    full.update(plain=torch.zeros(7, dtype=torch.int32), **copy.deepcopy(EXTRAS_TARGET))
    return full


def _copy_damaged(fs, src: str, dst: str, tensor: str, offset: int) -> str:
    """Copies the checkpoint ``src`` to ``dst`` (URLs) with one byte flipped at ``offset``
    bytes into the stored tensor ``tensor`` (the first file holding it); returns that file."""
    metadata = read_dcp_metadata(src, storage_options=fs.storage_options)
    damaged = sorted({f for f, name in metadata.storage_data.values() if name == tensor})[0]
    for name in _names(fs, src):
        data = bytearray(fs.cat_file(f"{src}/{name}"))
        if name == damaged:
            with remote.open_url(f"{src}/{name}", storage_options=fs.storage_options) as r:
                data[r.info(tensor).offset + offset] ^= 0xFF
        fs.pipe_file(f"{dst}/{name}", bytes(data))
    return damaged


# -- S3, real ranks -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_two_rank_run(new_bucket, s3_options):
    """One run of 2 ranks saving to S3 (see dcp_ranks.s3_two_rank_cases): (base URL, fs)."""
    bucket, fs = new_bucket()
    base = f"{bucket}/run"
    run_ranks(2, s3_two_rank_cases, base, s3_options)
    return base, fs


def test_s3_two_ranks_save_then_load_with_one_and_four_ranks(s3_two_rank_run, s3_options):
    base, fs = s3_two_rank_run
    url = f"{base}/ckpt"
    names = _names(fs, url)
    assert names[0] == ".metadata" and len(names) == 3  # one file per rank
    for name in names[1:]:  # each a checksummed fastckpt file with piece checksums
        with remote.open_url(f"{url}/{name}", storage_options=s3_options) as r:
            assert r.has_checksums and r.meta.pieces.piece_size == PIECE
    assert is_dcp_checkpoint(url, storage_options=s3_options)

    # one process, full tensors
    full = _full_target()
    reader = FastCkptReader(url, storage_options=s3_options)
    dcp.load(full, storage_reader=reader, no_dist=True)
    check_full(full)

    # four ranks, resharded: each fetches half a stored shard; a damaged piece (piece 5 of
    # rank 0's "model.wide") is caught by the one rank whose range covers it
    _copy_damaged(fs, url, f"{base}/damaged", "model.wide", 5 * PIECE + 123)
    run_ranks(4, s3_four_rank_loads, base, s3_options)


def test_s3_async_save_holds_values_at_call_time(s3_two_rank_run, s3_options):
    base, _ = s3_two_rank_run
    check_full(load_full(f"{base}/async", storage_options=s3_options))
    second = load_full(f"{base}/async-second", storage_options=s3_options)
    assert torch.equal(second["model"]["sharded"], torch.full((10, 6), -7.0))
    assert second["cfg"]["betas"] == [0.9, 0.99, 0.5] and second["cfg"]["lr"] == 9.0


def test_s3_failed_save_keeps_previous_checkpoint(s3_two_rank_run, s3_options, monkeypatch, capsys):
    base, fs = s3_two_rank_run
    url = f"{base}/failed"
    before = read_dcp_metadata(url, storage_options=s3_options)
    check_full(load_full(url, storage_options=s3_options), version=0)  # the first save, whole
    referenced = {f for f, _ in before.storage_data.values()}
    leftovers = set(_names(fs, url)) - referenced - {".metadata"}
    assert len(leftovers) == 1  # rank 0's file of the failed save: uploaded, never referenced

    # the CLI reads DCP checkpoints at URLs (storage options from the environment)
    monkeypatch.setenv("FASTCKPT_STORAGE_OPTIONS", json.dumps(s3_options))
    assert FastCkptReader.validate_checkpoint_id(url)
    assert cli(["verify", url]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli(["inspect", url]) == 0
    assert "DCP checkpoint written by fastckpt" in capsys.readouterr().out

    # the next good save replaces it and removes every file no checkpoint refers to
    dcp.save({"w": torch.ones(2)}, storage_writer=FastCkptWriter(url), no_dist=True)
    after = read_dcp_metadata(url)
    assert after.storage_meta.save_id != before.storage_meta.save_id
    assert torch.equal(load_full(url)["w"], torch.ones(2))
    assert _names(fs, url) == sorted({".metadata", *(f for f, _ in after.storage_data.values())})


# -- memory://, one process ----------------------------------------------------------------------


def test_memory_url_round_trip(tmp_path, capsys):
    url = f"memory://dcp-{uuid.uuid4().hex}/ckpt"
    state = {
        "model": {"w": torch.randn(64, 1024), "b": torch.arange(5.0)},  # w: 4 pieces of 64 KiB
        "step": 3,
        "cfg": {"lr": 0.5, "name": "run"},
    }
    dcp.save(state, storage_writer=FastCkptWriter(url, piece_size=PIECE), no_dist=True)
    assert FastCkptReader.validate_checkpoint_id(url)
    target = {
        "model": {"w": torch.zeros(64, 1024), "b": torch.zeros(5)},
        "step": 0,
        "cfg": {"lr": 0.0, "name": ""},
    }
    reader = FastCkptReader(url)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert torch.equal(target["model"]["b"], state["model"]["b"])
    assert target["step"] == 3 and target["cfg"] == state["cfg"]
    tensors = 64 * 1024 * 4 + 5 * 4  # each fetched once, beside the few pickled values
    assert tensors < reader.bytes_read < tensors + 8192, reader.bytes_read

    full = load_full(url)
    assert torch.equal(full["model"]["w"], state["model"]["w"]) and full["cfg"] == state["cfg"]
    assert verify_dcp(url)[0] == "OK"
    info = describe_dcp(url)
    assert info["writer"] == "fastckpt" and all(f["bytes"] for f in info["files"])

    # fastckpt convert both ways between a DCP checkpoint at a URL and a local file
    single = str(tmp_path / "full.safetensors")
    assert cli(["convert", url, single]) == 0
    assert torch.equal(fastckpt.load(single)["model"]["w"], state["model"]["w"])
    again = f"memory://dcp-{uuid.uuid4().hex}/again"
    assert cli(["convert", "--to-dcp", single, again]) == 0
    assert load_full(again)["step"] == 3
    capsys.readouterr()

    # one flipped byte in piece 2 of "model.w": the load fails naming URL, tensor and key
    fs, _ = remote.url_to_fs(url)
    damaged = f"memory://dcp-{uuid.uuid4().hex}/damaged"
    rank_file = _copy_damaged(fs, url, damaged, "model.w", 2 * PIECE + 7)
    target["model"]["w"].zero_()
    with pytest.raises(dcp.CheckpointException) as caught:
        dcp.load(target, storage_reader=FastCkptReader(damaged), no_dist=True)
    message = str(caught.value)
    assert f"{damaged}/{rank_file}" in message and "'model.w'" in message, message
    assert "piece 2 of 4" in message and "state-dict key model.w" in message, message
    assert "ChecksumError" in message
    status, _, bad = verify_dcp(damaged)
    assert status == "DAMAGED" and bad == [f"{rank_file}:model.w"]


def test_file_url_is_the_local_directory(tmp_path):
    path = str(tmp_path / "ckpt")
    writer = FastCkptWriter(f"file://{path}")
    assert writer.path == path
    dcp.save({"w": torch.ones(3)}, storage_writer=writer, no_dist=True)
    assert sorted(os.listdir(path))[0] == ".metadata"
    out = {"w": torch.zeros(3)}
    dcp.load(out, storage_reader=FastCkptReader(f"file://{path}"), no_dist=True)
    assert torch.equal(out["w"], torch.ones(3))


def test_url_writer_refuses_local_io_options():
    url = f"memory://dcp-{uuid.uuid4().hex}/ckpt"
    writer = FastCkptWriter(url, engine="threads")
    with pytest.raises(dcp.CheckpointException, match="engine apply to local paths"):
        dcp.save({"w": torch.ones(3)}, storage_writer=writer, no_dist=True)
    assert not is_dcp_checkpoint(url)  # nothing committed


def test_remote_reader_read_range_verifies_pieces():
    from fastckpt.checkpoint.save import plan_save

    url = f"memory://range-{uuid.uuid4().hex}/w.safetensors"
    w = torch.arange(30000, dtype=torch.int32)  # 120000 bytes: 30 pieces of 4 KiB
    remote.write_plan(plan_save({"w": w}, piece_size=4096), url)
    with remote.open_url(url) as r:
        got = r.read_range("w", 20000, 36000, verify=True)  # pieces 4 to 8
        assert torch.equal(got.view(torch.int32), w[5000:9000])
        assert r.bytes_read == 5 * 4096
        out = torch.empty(1024, dtype=torch.int32)
        assert r.read_range("w", 4096, 8192, out=out, verify=True) is out  # exactly piece 1
        assert torch.equal(out, w[1024:2048])
        assert r.read_range("w", 8, 12).view(torch.int32).item() == 2  # unverified: exact
        with pytest.raises(ValueError, match="not within tensor"):
            r.read_range("w", 0, 120004)
    fs, path = remote.url_to_fs(url)
    data = bytearray(fs.cat_file(path))
    with remote.open_url(url) as r:
        data[r.info("w").offset + 6 * 4096 + 1] ^= 0x01
    fs.pipe_file(path, bytes(data))
    with remote.open_url(url) as r:
        assert r.read_range("w", 0, 4096, verify=True).numel() == 4096  # other pieces are fine
        with pytest.raises(fastckpt.ChecksumError, match=r"piece 6 of 30") as caught:
            r.read_range("w", 20000, 36000, verify=True)
    assert caught.value.tensor == "w" and url in str(caught.value)


def test_remote_reader_read_range_without_piece_checksums_reads_whole_tensor():
    from fastckpt.checkpoint.save import plan_save

    url = f"memory://range-{uuid.uuid4().hex}/w.safetensors"
    w = torch.arange(30000, dtype=torch.int32)
    remote.write_plan(plan_save({"w": w}, piece_size=0), url)  # a CRC32C per tensor only
    with remote.open_url(url) as r:
        assert r.meta.pieces is None
        got = r.read_range("w", 20000, 20008, verify=True)
        assert torch.equal(got.view(torch.int32), w[5000:5002])
        assert r.bytes_read == 120000  # the whole tensor, to check its CRC32C
