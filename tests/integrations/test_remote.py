"""Checkpoints at URLs: memory:// and a real S3 server (moto) on loopback, through s3fs."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid

import pytest

torch = pytest.importorskip("torch")
fsspec = pytest.importorskip("fsspec")

import fastckpt  # noqa: E402
from fastckpt.integrations import remote  # noqa: E402

pytestmark = [
    # botocore and moto use datetime.utcnow and friends on some versions
    pytest.mark.filterwarnings("ignore::DeprecationWarning:botocore"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:moto"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

MiB = 1 << 20


# --------------------------------------------------------------------------- fixtures


# s3_endpoint (a moto server on loopback) and s3 (a fresh bucket) are in conftest.py.


def _nested(scale: int = 1) -> dict:
    torch.manual_seed(0)
    shared = torch.randn(64, 32 * scale)
    return {
        "model": collections.OrderedDict(
            [("fc.weight", shared), ("fc.bias", torch.randn(32)), ("emb", torch.arange(10))]
        ),
        "tied": shared,
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "rng": (torch.randint(0, 255, (7,), dtype=torch.uint8), None),
        "half": torch.randn(5, 3).to(torch.bfloat16),
        "epoch": 4,
    }


def _assert_nested_equal(back: dict, state: dict) -> None:
    assert back["epoch"] == state["epoch"]
    assert isinstance(back["model"], collections.OrderedDict)
    for name, t in state["model"].items():
        assert torch.equal(back["model"][name], t), name
    assert back["tied"] is back["model"]["fc.weight"]
    assert back["optimizer"]["param_groups"] == [{"lr": 0.1}]
    assert torch.equal(back["optimizer"]["state"][0]["step"], torch.tensor(3.0))
    assert isinstance(back["rng"], tuple) and back["rng"][1] is None
    assert torch.equal(back["rng"][0], state["rng"][0])
    assert back["half"].dtype == torch.bfloat16 and torch.equal(back["half"], state["half"])


# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "path, url, handled",
    [
        ("s3://b/k.safetensors", True, True),
        ("gs://b/k", True, True),
        ("memory://x", True, True),
        ("simplecache::s3://b/k", True, True),
        ("file:///tmp/x.safetensors", False, True),
        ("/tmp/x.safetensors", False, False),
        ("relative/x.safetensors", False, False),
    ],
)
def test_is_url(path, url, handled):
    assert remote.is_url(path) is url
    assert remote.handles(path) is handled


# --------------------------------------------------------------------------- memory://


def test_memory_round_trip_nested():
    url = f"memory://rt-{uuid.uuid4().hex}/step100.safetensors"
    state = _nested()
    fastckpt.save(state, url, metadata={"step": "100"})
    _assert_nested_equal(fastckpt.load(url), state)
    with fastckpt.open(url) as reader:
        assert reader.metadata() == {"format": "pt", "step": "100"}
        assert "tied" in reader.keys() and "model/fc.bias" in reader.keys()
        got = reader.get_tensors(["model/fc.bias", "tied"], verify=True)
        assert torch.equal(got["tied"], state["tied"])
        assert reader.verify() == []
    # only the final object is left: no temporary name next to it
    fs, path = remote.url_to_fs(url)
    assert fs.ls(path.rsplit("/", 1)[0], detail=False) == [path]


def test_memory_file_is_plain_safetensors():
    safetensors_torch = pytest.importorskip("safetensors.torch")
    url = f"memory://st-{uuid.uuid4().hex}/flat.safetensors"
    flat = {"a": torch.randn(1000, 3), "b": torch.arange(7, dtype=torch.int16)}
    fastckpt.save(flat, url)
    fs, path = remote.url_to_fs(url)
    data = fs.cat_file(path)
    assert int.from_bytes(data[:8], "little") + 8 == 4096  # the data section is aligned
    back = safetensors_torch.load(data)
    assert back.keys() == flat.keys() and all(torch.equal(back[k], flat[k]) for k in flat)


def test_file_url_takes_the_native_path(tmp_path):
    target = tmp_path / "native.safetensors"
    fastckpt.save({"x": torch.arange(5)}, f"file://{target}")
    assert target.is_file()
    assert fastckpt.load(f"file://{target}")["x"].tolist() == [0, 1, 2, 3, 4]
    with fastckpt.open(f"file://{target}") as reader:
        assert isinstance(reader, fastckpt.CheckpointReader)


def test_async_save_to_memory():
    url = f"memory://async-{uuid.uuid4().hex}/a.safetensors"
    state = {"w": torch.ones(1000)}
    future = fastckpt.async_save(state, url)
    state["w"].zero_()  # the snapshot was taken before async_save returned
    assert future.result(timeout=60) is None
    assert fastckpt.load(url)["w"].sum().item() == 1000.0


def test_async_save_error_comes_from_the_future():
    future = fastckpt.async_save({"x": object()}, "memory://e/x.safetensors")
    with pytest.raises(TypeError):
        future.result(timeout=60)


# --------------------------------------------------------------------------- S3


@pytest.mark.parametrize("part_mib", [5, 32])
def test_s3_round_trip_nested(s3, part_mib):
    base, options, fs = s3
    url = f"{base}/run/step100.safetensors"
    state = _nested(scale=700)  # about 6 MiB: one part, or two parts of 5 MiB
    remote.save(state, url, storage_options=options, part_size=part_mib * MiB)
    _assert_nested_equal(fastckpt.load(url, storage_options=options), state)
    assert fs.ls(f"{base}/run", detail=False) == [url[len("s3://") :]]


def test_s3_multipart_over_100_mib(s3):
    base, options, fs = s3
    url = f"{base}/big.safetensors"
    big = torch.arange(27 * MiB + 5, dtype=torch.float32)  # 108 MiB
    fastckpt.save({"big": big, "small": torch.ones(3)}, url, storage_options=options)
    info = fs.info(url)
    parts = -(-info["size"] // remote.DEFAULT_PART_SIZE)
    assert parts > 1 and info["ETag"].strip('"').endswith(f"-{parts}"), info  # multipart
    back = remote.load(url, storage_options=options, part_size=16 * MiB)
    assert torch.equal(back["big"], big) and back["small"].tolist() == [1.0, 1.0, 1.0]
    assert back["big"].data_ptr() % 64 == 0  # a view of the arena, aligned


def test_s3_keys_reads_only_those_tensors(s3):
    base, options, fs = s3
    url = f"{base}/partial.safetensors"
    state = {"a": torch.randn(300_000), "b": torch.randn(300_000), "c": torch.arange(9)}
    fastckpt.save(state, url, storage_options=options)
    with fastckpt.open(url, storage_options=options) as reader:
        offset = reader.header.data_offset + reader.header.entries["b"].begin
    data = bytearray(fs.cat_file(url))
    data[offset + 1000] ^= 0xFF  # damage tensor b on the server
    fs.pipe_file(url, bytes(data))
    part = fastckpt.load(url, storage_options=options, keys=["a", "c"])
    assert list(part) == ["a", "c"] and torch.equal(part["a"], state["a"])
    with pytest.raises(fastckpt.ChecksumError) as info:
        fastckpt.load(url, storage_options=options)
    assert info.value.tensor == "b" and url in str(info.value)


_KILLED_UPLOAD = textwrap.dedent(
    """
    import sys, torch, fastckpt
    url, endpoint = sys.argv[1], sys.argv[2]
    options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
               "client_kwargs": {"region_name": "us-east-1"}}
    state = {f"t{i}": torch.full((16 << 20,), float(i)) for i in range(4)}  # 256 MiB
    from fastckpt.integrations import remote
    remote.save(state, url, storage_options=options, part_size=8 << 20, parallel=2)
    print("finished")
    """
)


def test_s3_upload_killed_half_way_leaves_nothing(s3, s3_endpoint, tmp_path):
    base, options, fs = s3
    url = f"{base}/killed.safetensors"
    bucket = base[len("s3://") :]
    script = tmp_path / "upload.py"
    script.write_text(_KILLED_UPLOAD)
    child = subprocess.Popen([sys.executable, str(script), url, s3_endpoint])
    try:
        deadline = time.monotonic() + 60
        parts = 0
        while parts < 2 and time.monotonic() < deadline:  # wait until parts are on the server
            assert child.poll() is None, "the upload ended before it could be killed"
            uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
            if uploads:
                upload = uploads[0]
                listing = fs.call_s3(
                    "list_parts", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
                parts = len(listing.get("Parts", []))
            time.sleep(0.05)
        assert parts >= 2, "no part reached the server"
    finally:
        child.kill()
        child.wait()
    fs.invalidate_cache()
    assert not fs.exists(url)
    assert fs.ls(base, detail=False) == []
    with pytest.raises(FileNotFoundError) as info:
        fastckpt.load(url, storage_options=options)
    assert url in str(info.value)


def test_s3_missing_bucket_names_the_url(s3):
    _, options, _ = s3
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        fastckpt.save({"x": torch.ones(2)}, url, storage_options=options)
    assert url in str(info.value) and info.value.filename == url
    with pytest.raises(FileNotFoundError) as info:
        fastckpt.load(url, storage_options=options)
    assert url in str(info.value)


def test_s3_missing_key_names_the_url(s3):
    base, options, _ = s3
    url = f"{base}/absent.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        fastckpt.load(url, storage_options=options)
    assert info.value.filename == url and url in str(info.value)
    with pytest.raises(FileNotFoundError):
        fastckpt.open(url, storage_options=options)


def _set_auth(endpoint: str, allowed_unauthenticated: str) -> None:
    """moto's switch for checking credentials: 'inf' turns it off, '0' checks every request."""
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=allowed_unauthenticated.encode(),
        headers={"Content-Type": "text/plain"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


def test_s3_wrong_credentials_name_the_url(s3, s3_endpoint):
    base, _, _ = s3
    url = f"{base}/secret.safetensors"
    bad = {**s3[1], "key": "AKIAWRONGWRONGWRONG0", "secret": "wrong"}
    _set_auth(s3_endpoint, "0")
    try:
        with pytest.raises(PermissionError) as info:
            fastckpt.save({"x": torch.ones(2)}, url, storage_options=bad)
        assert url in str(info.value) and info.value.filename == url
        with pytest.raises(PermissionError) as info:
            fastckpt.load(url, storage_options=bad)
        assert url in str(info.value)
    finally:
        _set_auth(s3_endpoint, "inf")


def test_s3_async_save(s3):
    base, options, _ = s3
    url = f"{base}/async.safetensors"
    state = _nested(scale=100)
    future = fastckpt.async_save(state, url, storage_options=options)
    assert future.result(timeout=60) is None
    _assert_nested_equal(fastckpt.load(url, storage_options=options), state)


def test_s3_sharded_directory(s3):
    base, options, fs = s3
    url = f"{base}/sharded"
    state = {f"layer{i}.weight": torch.randn(256, 256) for i in range(5)}  # 256 KiB each
    fastckpt.save(state, url, storage_options=options, max_shard_size="600KB")
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False))
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [
        "model.safetensors.index.json"
    ]
    back = fastckpt.load(url, storage_options=options)
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    only = fastckpt.load(
        f"{url}/model.safetensors.index.json", storage_options=options, keys=["layer4.weight"]
    )
    assert list(only) == ["layer4.weight"]
    with fastckpt.open(url + "/", storage_options=options) as reader:
        assert torch.equal(reader.get_tensor("layer2.weight"), state["layer2.weight"])


def test_cli_inspect_verify_convert_take_urls(s3, tmp_path, monkeypatch, capsys):
    from fastckpt.cli import main

    base, options, fs = s3
    monkeypatch.setenv("FASTCKPT_STORAGE_OPTIONS", json.dumps(options))
    url = f"{base}/cli.safetensors"
    fastckpt.save({"w": torch.ones(4, 4), "step": 2}, url)  # options from the environment
    assert main(["inspect", url]) == 0
    assert url in capsys.readouterr().out
    assert main(["verify", url]) == 0
    assert "OK" in capsys.readouterr().out
    local = tmp_path / "copy.safetensors"
    assert main(["convert", url, str(local)]) == 0
    assert fastckpt.load(local)["step"] == 2
    assert main(["convert", str(local), f"{base}/back.safetensors"]) == 0
    assert torch.equal(fastckpt.load(f"{base}/back.safetensors")["w"], torch.ones(4, 4))
    # damage a byte of the data: verify names the tensor
    data = bytearray(fs.cat_file(url))
    data[-1] ^= 0xFF
    fs.pipe_file(url, bytes(data))
    assert main(["verify", url]) == 1
    assert "does not match its checksum: w" in capsys.readouterr().out
    assert main(["inspect", f"{base}/absent.safetensors"]) == 1


def test_s3_upload_refused_half_way_raises_and_leaves_no_object(s3, s3_endpoint):
    """The server starts refusing parts mid-upload: the save fails naming the URL, and the
    key never appears (the upload is aborted, or left uncompleted when even that is refused)."""
    base, options, fs = s3
    url = f"{base}/refused.safetensors"
    bucket = base[len("s3://") :]
    state = {f"t{i}": torch.full((2 * MiB,), float(i)) for i in range(8)}  # 64 MiB
    refused = threading.Event()

    def refuse_after_two_parts() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
            if uploads:
                listing = fs.call_s3(
                    "list_parts",
                    Bucket=bucket,
                    Key=uploads[0]["Key"],
                    UploadId=uploads[0]["UploadId"],
                )
                if len(listing.get("Parts", [])) >= 2:
                    _set_auth(s3_endpoint, "0")  # every later request needs real credentials
                    refused.set()
                    return
            time.sleep(0.02)

    watcher = threading.Thread(target=refuse_after_two_parts)
    watcher.start()
    try:
        with pytest.raises(PermissionError) as info:
            remote.save(state, url, storage_options=options, part_size=5 * MiB, parallel=1)
    finally:
        watcher.join()
        _set_auth(s3_endpoint, "inf")
    assert refused.is_set()
    assert url in str(info.value) and "part" in str(info.value)
    fs.invalidate_cache()
    assert not fs.exists(url)
    with pytest.raises(FileNotFoundError):
        fastckpt.load(url, storage_options=options)
