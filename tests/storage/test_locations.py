"""Where a location leads: ``file://`` URLs are local paths (handled in one place), other
URLs go to fsspec; the small-file helpers work on both."""

from __future__ import annotations

import uuid

import pytest
import torch

import fastckpt
from fastckpt import storage


@pytest.mark.parametrize(
    "url, path",
    [
        ("file:///tmp/x.safetensors", "/tmp/x.safetensors"),
        ("file://localhost/tmp/x.safetensors", "/tmp/x.safetensors"),
        ("FILE://LOCALHOST/tmp/x", "/tmp/x"),
        ("file:///tmp/a%20b", "/tmp/a b"),
        ("local:///tmp/y", "/tmp/y"),
    ],
)
def test_file_urls_are_absolute_local_paths(url, path):
    assert storage.local_path(url) == path
    assert storage.to_local(url) == path
    assert not storage.is_url(url) and storage.handles(url)


def test_a_file_url_naming_another_host_is_refused():
    with pytest.raises(ValueError, match="names host 'server'"):
        storage.local_path("file://server/share/x")


def test_save_load_open_of_file_localhost_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative "localhost/..." path would land here
    target = tmp_path / "sub" / "x.safetensors"
    target.parent.mkdir()
    url = f"file://localhost{target}"
    fastckpt.save({"x": torch.arange(3)}, url)
    assert target.is_file() and not (tmp_path / "localhost").exists()
    assert fastckpt.load(url)["x"].tolist() == [0, 1, 2]
    with fastckpt.open(url) as reader:
        assert reader.path == str(target)
        assert reader.read_mode in ("direct", "buffered")  # the native path, not fsspec


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_small_files_list_and_delete(tmp_path, kind):
    base = str(tmp_path) if kind == "local" else f"memory://loc-{uuid.uuid4().hex[:8]}"
    storage.write_whole(storage.join(base, "a.json"), b"{}")
    storage.write_whole(storage.join(base, "b.bin"), b"")
    assert storage.list_names(base) == ["a.json", "b.bin"]
    assert storage.read_whole(storage.join(base, "a.json")) == b"{}"
    assert storage.exists(storage.join(base, "b.bin"))
    storage.delete(storage.join(base, "b.bin"))
    assert not storage.exists(storage.join(base, "b.bin"))
    with pytest.raises(FileNotFoundError):
        storage.delete(storage.join(base, "b.bin"))
