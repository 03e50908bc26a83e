"""fastckpt.config: one place for settings, resolved in the order the README promises."""

from __future__ import annotations

import re

import pytest

from fastckpt import config


@pytest.fixture
def tuned_here(tmp_path):
    """A tuned configuration recorded for tmp_path's file system."""
    config.save_tuned(
        config.filesystem_key(tmp_path),
        {"queue_depth": 8, "block_size": 1 << 16, "engine": "threads"},
        {"read_gbps": 1.0, "write_gbps": 1.0},
    )
    return tmp_path


def test_precedence_argument_defaults_environment_tuned_builtin(tuned_here, monkeypatch):
    path = tuned_here / "x.safetensors"
    builtin = config.IOConfig()
    # 5. built-in, where nothing else speaks
    assert config.resolve_io(path, {}).intra_op_parallelism == builtin.intra_op_parallelism
    # 4. tuned for this file system
    assert config.resolve_io(path, {}).queue_depth == 8
    # 3. the environment beats tuning
    monkeypatch.setenv("FASTCKPT_QUEUE_DEPTH", "16")
    assert config.resolve_io(path, {}).queue_depth == 16
    # 2. process defaults beat the environment
    config.set_defaults(queue_depth=24)
    try:
        assert config.resolve_io(path, {}).queue_depth == 24
        # 1. the call's own argument beats everything
        assert config.resolve_io(path, {"queue_depth": 32}).queue_depth == 32
        # an argument passed as None means "not given"
        assert config.resolve_io(path, {"queue_depth": None}).queue_depth == 24
    finally:
        config.set_defaults(queue_depth=None)
    assert config.resolve_io(path, {}).queue_depth == 16


def test_tuning_applies_only_to_its_file_system(tuned_here):
    other = config.resolve_io("/proc/self/x", {})
    assert other.queue_depth == config.IOConfig().queue_depth


def test_staging_bytes_precedence(monkeypatch):
    assert config.staging_bytes() == config.DEFAULT_STAGING_BYTES
    monkeypatch.setenv("FASTCKPT_STAGING_BYTES", "64M")
    assert config.staging_bytes() == 64 << 20
    config.set_defaults(staging_bytes=32 << 20)
    try:
        assert config.staging_bytes() == 32 << 20
        assert config.staging_bytes(16 << 20) == 16 << 20
    finally:
        config.set_defaults(staging_bytes=None)


@pytest.mark.parametrize(
    ("text", "expected"), [("1", True), ("on", True), ("0", False), ("off", False), ("", None)]
)
def test_gds_choice_reads_booleans(monkeypatch, text, expected):
    monkeypatch.setenv("FASTCKPT_GDS", text)
    assert config.gds_choice() is expected


def test_bad_environment_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("FASTCKPT_GDS", "maybe")
    with pytest.raises(ValueError, match="FASTCKPT_GDS"):
        config.gds_choice()
    monkeypatch.setenv("FASTCKPT_SINGLE_SUBMIT", "perhaps")
    with pytest.raises(ValueError, match="FASTCKPT_SINGLE_SUBMIT"):
        config.resolve_io(None, {})


def test_unknown_default_is_refused():
    with pytest.raises(TypeError, match="queue_dept"):
        config.set_defaults(queue_dept=3)


def test_other_settings(monkeypatch):
    assert not config.progress_hidden()
    monkeypatch.setenv("FASTCKPT_NO_PROGRESS", "1")
    assert config.progress_hidden()
    monkeypatch.setenv("FASTCKPT_ASYNC_STAGING_BYTES", "1G")
    assert config.async_staging_bytes() == 1 << 30
    monkeypatch.setenv("FASTCKPT_CUFILE_LIBRARY", "/x/libcufile.so.0")
    assert config.cufile_library() == "/x/libcufile.so.0"


def test_only_config_reads_fastckpt_environment():
    """config.py is the one reader of FASTCKPT_* variables."""
    from pathlib import Path

    package = Path(config.__file__).parent
    reads = re.compile(r"""(environ\.get|getenv)\(\s*["']FASTCKPT_|environ\[\s*["']FASTCKPT_""")
    readers = [
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "config.py" and reads.search(p.read_text())
    ]
    assert readers == []


# -- caching of the tuned file and the mount table -----------------------------------------------


class _OpenCounter:
    """Counts the files this process opens (an audit hook: hooks cannot be removed, so it
    counts only while ``active``)."""

    def __init__(self):
        import sys

        self.active = False
        self.paths: list[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event, args):
        if self.active and event == "open" and args and isinstance(args[0], (str, bytes)):
            self.paths.append(str(args[0]))


_opens = _OpenCounter()


def _record_gds(fs_key, read_gbps):
    config.save_tuned(fs_key, {"queue_depth": 8}, {"read_gbps": 1.0, "gpu": True})
    config.save_tuned_gds(fs_key, {"read_gbps": read_gbps})


def test_gds_preference_is_cached_not_reread(tmp_path):
    path = tmp_path / "x.safetensors"
    _record_gds(config.filesystem_key(tmp_path), 5.0)
    assert config.gds_preferred(path)
    _opens.paths.clear()
    _opens.active = True
    try:
        for _ in range(20):
            assert config.gds_preferred(path)
            config.resolve_io(path, {})
    finally:
        _opens.active = False
    read = [p for p in _opens.paths if "mountinfo" in p or p.endswith("tuned.json")]
    assert not read, f"re-read on every call: {read[:4]}"


def test_gds_preference_follows_changes_to_the_tuned_file(tmp_path):
    import json

    path = tmp_path / "x.safetensors"
    key = config.filesystem_key(tmp_path)
    _record_gds(key, 5.0)
    assert config.gds_preferred(path)
    config.save_tuned_gds(key, {"read_gbps": 0.5})  # what `fastckpt tune --gds` does
    assert not config.gds_preferred(path)
    # Edited by another process: the file's stamp changes, the cache follows.
    tuned = config.tuned_config_path()
    data = json.loads(tuned.read_text())
    data["filesystems"][key]["gds"]["read_gbps"] = 9.0
    tuned.write_text(json.dumps(data) + " " * 16)
    assert config.gds_preferred(path)
    tuned.unlink()
    assert not config.gds_preferred(path)
    config.reload()
    assert config.filesystem_key(tmp_path) == key
