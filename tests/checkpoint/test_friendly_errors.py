"""Errors someone coming from torch.save/safetensors meets first say what to do."""

import io
import os

import pytest
import torch
from safetensors.torch import save_file

import fastckpt
from fastckpt.errors import ChecksumError, NoChecksumsError


def test_verify_of_a_file_without_checksums_is_not_called_damage(tmp_path):
    path = str(tmp_path / "st.safetensors")
    save_file({"w": torch.ones(3)}, path)
    with pytest.raises(NoChecksumsError, match="records no checksums") as caught:
        fastckpt.load(path, verify=True)
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, ChecksumError)
    assert caught.value.filename == path
    assert "verify=None" in str(caught.value) and "damaged" in str(caught.value)
    assert torch.equal(fastckpt.load(path)["w"], torch.ones(3))  # verify=None reads it
    with fastckpt.open(path) as r, pytest.raises(NoChecksumsError):
        r.verify()


def test_damage_is_still_a_checksum_error(tmp_path):
    path = tmp_path / "d.safetensors"
    fastckpt.save({"w": torch.ones(1024)}, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="damaged"):
        fastckpt.load(path, verify=True)


@pytest.mark.parametrize("wrap", [lambda m: m, lambda m: {"model": m}])
def test_saving_a_whole_module_suggests_its_state_dict(tmp_path, wrap):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"state_dict\(\)") as caught:
        fastckpt.save(wrap(model), tmp_path / "m.safetensors")
    assert "Linear" in str(caught.value) and "load_state_dict" in str(caught.value)
    assert not (tmp_path / "m.safetensors").exists()


def test_saving_an_optimizer_suggests_its_state_dict(tmp_path):
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"state_dict\(\)"):
        fastckpt.save({"opt": opt}, tmp_path / "o.safetensors")


# ------------------------------------------------- directories that another reader reads


def _series(root, steps=(4, 8)) -> None:
    with fastckpt.CheckpointManager(str(root)) as manager:
        for step in steps:
            manager.save(step, {"w": torch.full((2,), float(step))})


@pytest.mark.parametrize("read", [fastckpt.load, fastckpt.open])
def test_a_series_root_names_the_manager_that_restores_it(tmp_path, read):
    root = tmp_path / "run"
    _series(root)
    with pytest.raises(FileNotFoundError) as caught:
        read(root)
    message = str(caught.value)
    assert "the root of a checkpoint series (2 committed steps, the newest step-000000000008)" in (
        message
    )
    assert f"fastckpt.CheckpointManager({str(root)!r}).restore()" in message
    assert "model.safetensors" in message and caught.value.filename == str(root)
    with fastckpt.CheckpointManager(str(root)) as manager:  # what the message says reads it
        step, state = manager.restore()
    assert step == 8 and state["w"].tolist() == [8.0, 8.0]


def test_a_single_file_step_names_its_state_file(tmp_path):
    root = tmp_path / "run"
    _series(root)
    step = root / "step-000000000004"
    with pytest.raises(FileNotFoundError) as caught:
        fastckpt.load(step)
    message = str(caught.value)
    assert "step 4 of a checkpoint series, in one file (state.safetensors)" in message
    state_file = str(step / "state.safetensors")
    assert f"fastckpt.load({state_file!r})" in message
    assert f"CheckpointManager({str(root)!r}).restore(step=4)" in message
    assert fastckpt.load(state_file)["w"].tolist() == [4.0, 4.0]


def test_a_step_without_its_marker_is_called_unfinished(tmp_path):
    step = tmp_path / "run" / "step-000000000012"
    step.mkdir(parents=True)
    fastckpt.save({"w": torch.ones(2)}, step / "state.safetensors")
    with pytest.raises(FileNotFoundError, match="step 12 of a checkpoint series, not committed"):
        fastckpt.load(step)


@pytest.mark.parametrize("writer", ["fastckpt", "torch"])
def test_a_dcp_directory_names_load_full(tmp_path, writer):
    import torch.distributed.checkpoint as dcp

    from fastckpt.dcp import FastCkptWriter, load_full

    path = str(tmp_path / "ckpt")
    storage = FastCkptWriter(path) if writer == "fastckpt" else dcp.FileSystemWriter(path)
    dcp.save({"w": torch.arange(4.0)}, storage_writer=storage, no_dist=True)
    for read in (fastckpt.load, fastckpt.open):
        with pytest.raises(FileNotFoundError) as caught:
            read(path)
        assert "a torch.distributed.checkpoint (DCP) checkpoint (.metadata and rank files)" in str(
            caught.value
        )
        assert f"fastckpt.dcp.load_full({path!r})" in str(caught.value)
    assert load_full(path)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_plain_directory_still_says_what_it_lacks(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json or model"):
        fastckpt.load(tmp_path)


def test_the_names_recognised_are_the_series_and_dcp_names():
    from fastckpt.integrations.dcp import METADATA_FILE
    from fastckpt.series import steps
    from fastckpt.storage import directory_kinds

    assert directory_kinds.DCP_METADATA == METADATA_FILE
    assert directory_kinds.SERIES_MARKER == steps.MARKER
    assert directory_kinds.STEP_STATE_FILE == steps.STATE_FILE
    assert directory_kinds.STEP_DIRECTORY.pattern == steps._STEP.pattern


# ------------------------------------------------------------------- other tools' files


def _npz(path):
    import numpy as np

    with open(path, "wb") as f:  # a file object: numpy adds no suffix
        np.savez(f, x=np.ones(3))


def _npy(path):
    import numpy as np

    with open(path, "wb") as f:
        np.save(f, np.ones(3))


def _pickle(path):
    import pickle

    path.write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=4))


OTHER_FILES = {
    "a NumPy .npz archive (a zip of .npy files)": (_npz, "numpy.load"),
    "a NumPy .npy file": (_npy, "numpy.load"),
    "a GGUF file (llama.cpp)": (lambda p: p.write_bytes(b"GGUF\x03\0\0\0" + bytes(64)), None),
    "a JSON document": (lambda p: p.write_text('{"model": {"w": [1, 2]}}'), None),
    "a Python pickle (protocol 4, not torch.save)": (_pickle, "pickle.load"),
    "a torch.save file (a zip archive)": (
        lambda p: torch.save({"w": torch.ones(2)}, p),
        "torch.load",
    ),
}


@pytest.mark.parametrize("described", sorted(OTHER_FILES))
def test_another_tools_file_is_named(tmp_path, described):
    make, reader = OTHER_FILES[described]
    path = tmp_path / "file.bin"
    make(path)
    with pytest.raises(fastckpt.HeaderError) as caught:
        fastckpt.load(path)
    message = str(caught.value)
    assert f"this is {described}" in message and "not a safetensors/fastckpt file" in message
    assert "header length" not in message
    if not described.startswith("a torch.save"):
        assert "torch.save file" not in message
    if reader is not None:
        assert reader in message


def test_a_truncated_file_says_truncated_with_both_sizes(tmp_path):
    path = tmp_path / "cut.safetensors"
    fastckpt.save({"a": torch.ones(1024), "b": torch.ones(1024)}, path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])
    with pytest.raises(fastckpt.HeaderError) as caught:
        fastckpt.load(path)
    assert (
        f"truncated: the file is {len(whole) - 100} bytes, its header says the data ends at "
        f"{len(whole)}"
    ) in str(caught.value)


# ------------------------------------------------------------------- misplaced arguments


@pytest.mark.parametrize("save", [fastckpt.save, fastckpt.async_save])
def test_save_names_a_missing_or_wrong_destination(tmp_path, save):
    name = save.__name__
    with pytest.raises(TypeError) as caught:
        save({"w": torch.ones(2)}, None)
    assert f"{name}(obj, f): f (where to save) is None" in str(caught.value)
    assert "io.BytesIO()" in str(caught.value) and "direct I/O" not in str(caught.value)
    with pytest.raises(TypeError, match="f \\(where to save\\) is of type int"):
        save({"w": torch.ones(2)}, 3)


@pytest.mark.parametrize("save", [fastckpt.save, fastckpt.async_save])
def test_swapped_save_arguments_are_named(tmp_path, save, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError) as caught:
        save("ckpt.safetensors", {"w": torch.ones(2)})
    assert "takes what to save first and where second" in str(caught.value)
    assert "f is of type dict" in str(caught.value)
    assert f"call {save.__name__}(state, 'ckpt.safetensors')" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("read", [fastckpt.load, fastckpt.open])
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_a_checkpoints_bytes_point_to_load_bytes(read, kind):
    data = kind(fastckpt.save_bytes({"w": torch.ones(2)}))
    with pytest.raises(TypeError, match=r"fastckpt\.load_bytes\(data\)") as caught:
        read(data)
    assert "embedded null byte" not in str(caught.value)
    assert fastckpt.load_bytes(data)["w"].tolist() == [1.0, 1.0]


def test_a_bytes_path_is_still_a_path(tmp_path):
    path = tmp_path / "w.safetensors"
    fastckpt.save({"w": torch.ones(2)}, path)
    assert fastckpt.load(os.fsencode(path))["w"].tolist() == [1.0, 1.0]


# ------------------------------------------------------ async_save into a file object


def test_async_save_into_a_file_object_snapshots_at_the_call():
    state = {"w": torch.zeros(1000), "step": 3}
    buffer = io.BytesIO()
    future = fastckpt.async_save(state, buffer)
    state["w"].add_(1)  # after the call: not in the checkpoint
    assert future.result() is None
    back = fastckpt.load_bytes(buffer.getvalue())
    assert back["step"] == 3 and float(back["w"].sum()) == 0.0
    assert buffer.getvalue() == fastckpt.save_bytes({"w": torch.zeros(1000), "step": 3})


def test_async_saves_into_one_file_object_do_not_interleave():
    buffer = io.BytesIO()
    futures = [fastckpt.async_save({"i": torch.full((4096,), i)}, buffer) for i in range(4)]
    for future in futures:
        future.result()
    data = buffer.getvalue()
    size = len(data) // 4
    values = [int(fastckpt.load_bytes(data[n * size : (n + 1) * size])["i"][0]) for n in range(4)]
    assert values == [0, 1, 2, 3]


def test_async_save_into_a_file_object_without_snapshot_and_its_errors(tmp_path):
    buffer = io.BytesIO()
    fastckpt.async_save({"w": torch.ones(8)}, buffer, snapshot=False).result()
    assert fastckpt.load_bytes(buffer.getvalue())["w"].tolist() == [1.0] * 8
    with pytest.raises(TypeError, match="engine= applies to files on disk"):
        fastckpt.async_save({"w": torch.ones(8)}, io.BytesIO(), engine="threads")

    class Settings:
        pass

    failed = fastckpt.async_save({"s": Settings()}, io.BytesIO())
    with pytest.raises(TypeError, match="Settings"):
        failed.result()
    with open(tmp_path / "f.safetensors", "wb") as f:
        fastckpt.async_save({"w": torch.ones(8)}, f).result()
    assert fastckpt.load(tmp_path / "f.safetensors")["w"].tolist() == [1.0] * 8


def test_save_to_bytes_points_to_a_str_path_or_save_bytes(tmp_path):
    with pytest.raises(TypeError, match=r"os\.fsdecode\(f\).*fastckpt\.save_bytes\(obj\)"):
        fastckpt.save({"w": torch.ones(2)}, os.fsencode(tmp_path / "w.safetensors"))
    assert list(tmp_path.iterdir()) == []
