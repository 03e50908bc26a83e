"""Reading a DCP checkpoint's ``.metadata`` and its non-tensor values without running code
from it (fastckpt.integrations.dcp.metadata and conversion): hostile pickles are refused by
``fastckpt inspect``, ``verify`` and ``convert`` and by ``dcp.load`` through FastCkptReader,
and real checkpoints written by DCP's FileSystemWriter and by FastCkptWriter still load and
convert."""

from __future__ import annotations

import datetime
import os
import pickle
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastckpt
from fastckpt.cli import main as cli
from fastckpt.dcp import FastCkptReader, FastCkptWriter, UnsafePickleError, load_full
from fastckpt.errors import FastCkptError
from fastckpt.integrations.dcp import read_dcp_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _RunsShell:
    """Unpickling it runs ``touch marker`` through os.system."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _RunsExec:
    """Unpickling it runs Python code through builtins.exec."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


#: the global each names, as pickle writes it (os.system is posix.system on Linux)
HOSTILE = {f"{os.system.__module__}.system": _RunsShell, "builtins.exec": _RunsExec}


def _checkpoint(path: str, writer: str = "fastckpt") -> dict:
    state = {"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(2, dtype=torch.bfloat16)}
    state.update(step=3, cfg={"lr": 0.1, "betas": [0.9, 0.99]})
    storage = FastCkptWriter(path) if writer == "fastckpt" else dcp.FileSystemWriter(path)
    dcp.save(state, storage_writer=storage, no_dist=True)
    return state


def _poison_metadata(path: str, payload: object) -> None:
    """Replaces ``.metadata`` by the real metadata with ``payload`` hidden inside it."""
    metadata = read_dcp_metadata(path)
    metadata.planner_data = {"w": ("w",), "evil": payload}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


@pytest.fixture(params=sorted(HOSTILE))
def hostile(request, tmp_path):
    """A fastckpt-written checkpoint whose .metadata runs code when unpickled; the name of
    the global it calls; the marker file that code would create."""
    path = str(tmp_path / "ckpt")
    marker = str(tmp_path / "pwned")
    _checkpoint(path)
    _poison_metadata(path, HOSTILE[request.param](marker))
    return path, request.param, marker


def test_cli_refuses_hostile_metadata(hostile, tmp_path, capsys):
    path, global_name, marker = hostile
    for command in (["inspect", path], ["verify", path], ["convert", path, str(tmp_path / "o")]):
        assert cli(command) == 1, command
        captured = capsys.readouterr()
        out = captured.out + captured.err
        assert global_name in out and "--allow-pickle" in out, (command, out)
        assert not os.path.exists(marker), command
    assert not os.path.exists(tmp_path / "o")


def test_dcp_load_refuses_hostile_metadata(hostile):
    path, global_name, marker = hostile
    target = {"w": torch.zeros(2, 3)}
    with pytest.raises((UnsafePickleError, dcp.CheckpointException)) as caught:
        dcp.load(target, storage_reader=FastCkptReader(path), no_dist=True)
    assert global_name in str(caught.value) and "allow_pickle=True" in str(caught.value)
    assert not os.path.exists(marker)
    with pytest.raises(UnsafePickleError) as caught:
        read_dcp_metadata(path)
    assert caught.value.global_name == global_name and not os.path.exists(marker)


def test_allow_pickle_opts_out(tmp_path, capsys):
    """A harmless object outside DCP's metadata is refused by default, read with
    allow_pickle=True / --allow-pickle."""
    path = str(tmp_path / "ckpt")
    _checkpoint(path)
    _poison_metadata(path, datetime.date(2024, 1, 2))
    with pytest.raises(UnsafePickleError, match="datetime.date"):
        load_full(path)
    target = {"w": torch.zeros(2, 3)}
    dcp.load(target, storage_reader=FastCkptReader(path, allow_pickle=True), no_dist=True)
    assert torch.equal(target["w"], torch.arange(6.0).reshape(2, 3))
    assert cli(["inspect", path]) == 1
    assert cli(["inspect", "--allow-pickle", path]) == 0
    assert cli(["verify", "--allow-pickle", path]) == 0
    assert "unpickled without limits" in capsys.readouterr().err


@pytest.mark.parametrize("writer", ["fastckpt", "dcp"])
def test_hostile_value_in_a_rank_file_is_not_unpickled_by_convert(writer, tmp_path, capsys):
    """Non-tensor values are pickles too (DCP stores them with torch.save): converting loads
    them with weights_only=True."""
    path = str(tmp_path / "ckpt")
    marker = str(tmp_path / "pwned")
    storage = FastCkptWriter(path) if writer == "fastckpt" else dcp.FileSystemWriter(path)
    state = {"w": torch.ones(2), "evil": _RunsShell(marker)}
    dcp.save(state, storage_writer=storage, no_dist=True)
    assert not os.path.exists(marker)
    out = str(tmp_path / "full.safetensors")
    assert cli(["convert", path, out]) == 1
    assert "allow_pickle" in capsys.readouterr().err
    with pytest.raises(UnsafePickleError, match="'evil'"):
        load_full(path)
    assert not os.path.exists(marker) and not os.path.exists(out)


@pytest.mark.parametrize("writer", ["fastckpt", "dcp"])
def test_real_checkpoints_still_load_inspect_verify_and_convert(writer, tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    state = _checkpoint(path, writer)
    metadata = read_dcp_metadata(path)  # restricted, and enough for real metadata
    assert {"w", "h", "step", "cfg.lr"} <= set(metadata.state_dict_metadata)
    full = load_full(path)
    assert torch.equal(full["w"], state["w"]) and full["cfg"] == state["cfg"]
    assert full["h"].dtype == torch.bfloat16 and full["step"] == 3
    assert cli(["inspect", path]) == 0
    assert cli(["verify", path]) == (0 if writer == "fastckpt" else 1)  # DCP's: UNVERIFIABLE
    single = str(tmp_path / "full.safetensors")
    assert cli(["convert", path, single]) == 0
    assert torch.equal(fastckpt.load(single)["w"], state["w"])
    if writer == "fastckpt":
        target = {"w": torch.zeros(2, 3), "step": 0}
        dcp.load(target, storage_reader=FastCkptReader(path), no_dist=True)
        assert target["step"] == 3
    capsys.readouterr()


def test_damaged_metadata_is_a_header_error(tmp_path):
    path = str(tmp_path / "ckpt")
    _checkpoint(path)
    with open(os.path.join(path, ".metadata"), "r+b") as f:
        f.truncate(40)
    with pytest.raises(fastckpt.HeaderError):
        read_dcp_metadata(path)
    assert issubclass(UnsafePickleError, FastCkptError)


def test_a_fifo_for_metadata_is_refused_at_once(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    os.mkfifo(path / ".metadata")
    raised: list[BaseException] = []

    def read() -> None:
        try:
            read_dcp_metadata(path)
        except BaseException as exc:
            raised.append(exc)

    # A blocking read would wait for a writer forever: run it where a hang is seen.
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "reading a FIFO .metadata hung"
    assert isinstance(raised[0], OSError) and "not a regular file" in str(raised[0])
