"""One place for fastckpt's I/O settings.

Each setting is resolved in this order, first match wins:

1. the keyword argument of the call (``fastckpt.save(..., queue_depth=64)``);
2. process-wide defaults set with :func:`set_defaults`;
3. ``FASTCKPT_*`` environment variables (``FASTCKPT_ENGINE``, ``FASTCKPT_BLOCK_SIZE``,
   ``FASTCKPT_QUEUE_DEPTH``, ``FASTCKPT_INTRA_OP_PARALLELISM``, ``FASTCKPT_SINGLE_SUBMIT``,
   ``FASTCKPT_OVERLAP_EVENTS``, ``FASTCKPT_STAGING_BYTES``);
4. the configuration ``fastckpt tune`` measured for the file system of the path;
5. built-in defaults.

This module is the only reader of ``FASTCKPT_*`` variables. Besides the I/O settings above:
``FASTCKPT_GDS`` (use GPUDirect Storage for CUDA loads: 1/0, unset = as tuned),
``FASTCKPT_ASYNC_STAGING_BYTES`` (cap on the asynchronous staging pool),
``FASTCKPT_DIRECT_IO`` (1/0: force or forbid O_DIRECT; unset: chosen per file),
``FASTCKPT_READ_MODE`` (``direct``/``buffered``/``mapped``: how cold local files are read;
unset: as tuned, else O_DIRECT),
``FASTCKPT_STORAGE_OPTIONS`` (a JSON object of fsspec storage options for URLs),
``FASTCKPT_NO_PROGRESS`` (1 hides progress bars), ``FASTCKPT_CUFILE_LIBRARY`` (the libcufile
file to open) and ``FASTCKPT_CONFIG`` (the tuned-configuration file).

The tuned configurations live in one JSON file, ``$XDG_CONFIG_HOME/fastckpt/tuned.json``
(``~/.config/fastckpt/tuned.json`` without ``XDG_CONFIG_HOME``); ``FASTCKPT_CONFIG`` names
another file. It is read once and re-read only when it changes (its modification time,
size or inode), and the file system of each directory is looked up once per device
(the mount table is not re-read on every load); :func:`reload` drops both caches,
and saving a tuned configuration does so itself.

Example:
    >>> import fastckpt.config as cfg
    >>> cfg.set_defaults(queue_depth=64)
    >>> cfg.resolve_io(None, {}).queue_depth
    64
    >>> cfg.set_defaults(queue_depth=None)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from fastckpt.mounts import mount_of

__all__ = [
    "IOConfig",
    "IO_KEYS",
    "set_defaults",
    "resolve_io",
    "staging_bytes",
    "tuned_config_path",
    "filesystem_key",
    "load_tuned",
    "save_tuned",
    "save_tuned_gds",
    "gds_preferred",
    "environment",
    "gds_choice",
    "direct_io",
    "READ_MODES",
    "read_mode_override",
    "force_read_mode",
    "ARENA_PAGES",
    "arena_pages",
    "force_arena_pages",
    "save_tuned_read_mode",
    "tuned_read_mode",
    "WRITE_MODES",
    "save_tuned_write_mode",
    "tuned_write_mode",
    "progress_hidden",
    "cufile_library",
    "async_staging_bytes",
    "reload",
]


@dataclasses.dataclass(frozen=True)
class IOConfig:
    """How an executor moves bytes; the keys are exactly ``aio_handle``'s constructor's."""

    block_size: int = 1 << 20
    queue_depth: int = 32
    single_submit: bool = False
    overlap_events: bool = True
    intra_op_parallelism: int = 2
    engine: str = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "intra_op_parallelism"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.queue_depth > 65536:
            raise ValueError(f"queue_depth must be at most 65536, got {self.queue_depth}")
        if self.intra_op_parallelism > 1024:
            raise ValueError(
                f"intra_op_parallelism must be at most 1024, got {self.intra_op_parallelism}"
            )
        if not isinstance(self.engine, str):
            raise TypeError(f"engine must be a str, got {type(self.engine).__name__}")


IO_KEYS = tuple(f.name for f in dataclasses.fields(IOConfig))

# The save/load path keeps at most this much in staging buffers, whatever the checkpoint size.
DEFAULT_STAGING_BYTES = 224 << 20  # 7 buffers of 32 MiB: the save extra RSS stays under 256 MiB

_process_defaults: dict[str, Any] = {}
_SETTINGS = IO_KEYS + ("staging_bytes", "open_files")


def set_defaults(**settings: Any) -> None:
    """Sets process-wide defaults (any of :data:`IO_KEYS`, ``staging_bytes`` and
    ``open_files``); ``None`` clears one.

    Example:
        >>> import fastckpt.config
        >>> fastckpt.config.set_defaults(engine="threads")
        >>> fastckpt.config.set_defaults(engine=None)
    """
    for key, value in settings.items():
        if key not in _SETTINGS:
            raise TypeError(f"unknown setting {key!r}; expected one of {_SETTINGS}")
        if value is None:
            _process_defaults.pop(key, None)
        else:
            _process_defaults[key] = value


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={text!r} is not a boolean")


def parse_size(text: str) -> int:
    """Parses ``"4096"``, ``"64K"``, ``"1M"``, ``"400M"``, ``"1G"`` (powers of 1024) into bytes.

    Example:
        >>> parse_size("1M")
        1048576
    """
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = 1
    if value and value[-1] in units:
        scale = units[value[-1]]
        value = value[:-1]
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64K, 1M, 1G)") from None
    if number < 0:
        raise ValueError(f"size must not be negative: {text!r}")
    return int(number * scale)


def environment(name: str) -> str | None:
    """The value of the environment variable ``FASTCKPT_<name>``, or None when unset or empty.

    Example:
        >>> environment("SURELY_UNSET_SETTING") is None
        True
    """
    text = os.environ.get("FASTCKPT_" + name)
    return text if text else None


def gds_choice() -> bool | None:
    """``FASTCKPT_GDS`` as a bool, or None when unset (then tuning decides).

    Example:
        >>> gds_choice() in (True, False, None)
        True
    """
    text = environment("GDS")
    return None if text is None or not text.strip() else _parse_bool("FASTCKPT_GDS", text)


#: The ways a local file's cold bytes can come in (see :mod:`fastckpt.storage.local`).
READ_MODES = ("direct", "staged", "buffered", "mapped")


def direct_io() -> bool | None:
    """``FASTCKPT_DIRECT_IO``: 1 forces O_DIRECT reads, 0 forces reads through the page
    cache; None (unset) lets each read choose by what is already in memory.

    Example:
        >>> direct_io() in (True, False, None)
        True
    """
    text = environment("DIRECT_IO")
    return None if text is None or not text.strip() else _parse_bool("FASTCKPT_DIRECT_IO", text)


_forced_read_mode: str | None = None  # force_read_mode's, over FASTCKPT_READ_MODE


def force_read_mode(mode: str | None) -> None:
    """Forces how this process reads cold local files (``direct``, ``buffered``,
    ``mapped``; None: back to ``FASTCKPT_READ_MODE``, then tuning). For benchmarks and
    ``fastckpt tune``, which time each mode.

    Example:
        >>> force_read_mode("mapped"); read_mode_override()
        'mapped'
        >>> force_read_mode(None)
    """
    global _forced_read_mode
    if mode is not None and mode not in READ_MODES:
        raise ValueError(f"read mode must be one of {', '.join(READ_MODES)}, got {mode!r}")
    _forced_read_mode = mode


def read_mode_override() -> str | None:
    """The read mode forced for cold local files: :func:`force_read_mode`'s, else
    ``FASTCKPT_READ_MODE`` (``direct``, ``buffered`` or ``mapped``); None when neither.
    Bytes already in memory are still read buffered.

    Example:
        >>> read_mode_override() in (None, *READ_MODES)
        True
    """
    if _forced_read_mode is not None:
        return _forced_read_mode
    text = environment("READ_MODE")
    if text is None or not text.strip():
        return None
    mode = text.strip().lower()
    if mode not in READ_MODES:
        raise ValueError(f"FASTCKPT_READ_MODE must be one of {', '.join(READ_MODES)}, got {text!r}")
    return mode


#: How a load's large arena gets its pages (see :func:`fastckpt.io.aligned_memory.arena_tensor`).
ARENA_PAGES = ("plain", "huge", "populate")
_forced_arena_pages: str | None = None  # force_arena_pages's, over FASTCKPT_ARENA_PAGES


def force_arena_pages(pages: str | None) -> None:
    """Sets how this process's load arenas get their pages (None: back to
    ``FASTCKPT_ARENA_PAGES``). For benchmarks, which time each way.

    Example:
        >>> force_arena_pages("populate"); arena_pages()
        'populate'
        >>> force_arena_pages(None)
    """
    global _forced_arena_pages
    if pages is not None and pages not in ARENA_PAGES:
        raise ValueError(f"arena pages must be one of {', '.join(ARENA_PAGES)}, got {pages!r}")
    _forced_arena_pages = pages


def arena_pages() -> str:
    """How load arenas get their pages: :func:`force_arena_pages`'s, else
    ``FASTCKPT_ARENA_PAGES`` (``plain``, ``huge`` or ``populate``), else ``plain``.

    Example:
        >>> arena_pages() in ARENA_PAGES
        True
    """
    if _forced_arena_pages is not None:
        return _forced_arena_pages
    text = (environment("ARENA_PAGES") or "plain").strip().lower()
    if text not in ARENA_PAGES:
        raise ValueError(
            f"FASTCKPT_ARENA_PAGES must be one of {', '.join(ARENA_PAGES)}, got {text!r}"
        )
    return text


def progress_hidden() -> bool:
    """Whether ``FASTCKPT_NO_PROGRESS`` hides progress bars (any value but 0)."""
    return environment("NO_PROGRESS") not in (None, "0")


def cufile_library() -> str | None:
    """``FASTCKPT_CUFILE_LIBRARY``: the libcufile file to open instead of searching."""
    return environment("CUFILE_LIBRARY")


def async_staging_bytes() -> int | None:
    """``FASTCKPT_ASYNC_STAGING_BYTES``: a cap on the asynchronous staging pool, or None."""
    text = environment("ASYNC_STAGING_BYTES")
    return None if text is None else parse_size(text)


#: Files a reader of many files (a sharded directory, a distributed checkpoint) keeps open
#: at once; it opens the others on demand, closing the least recently used. Far below the
#: common soft limit of 1024 open files, so a load of any number of files never meets it.
DEFAULT_OPEN_FILES = 64


def open_files(explicit: int | None = None) -> int:
    """How many files a reader of many files keeps open at once (default 64):
    ``explicit``, else ``set_defaults(open_files=...)``, else ``FASTCKPT_OPEN_FILES``.

    Example:
        >>> open_files(), open_files(8)
        (64, 8)
    """
    if explicit is not None:
        value: Any = explicit
    elif "open_files" in _process_defaults:
        value = _process_defaults["open_files"]
    elif environment("OPEN_FILES"):
        text = environment("OPEN_FILES") or ""
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"environment variable FASTCKPT_OPEN_FILES={text!r} is not an int"
            ) from None
    else:
        value = DEFAULT_OPEN_FILES
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"open_files must be a positive int, got {value!r}")
    return value


#: Seconds a checkpoint collective waits for a rank that hangs, unless FASTCKPT_GROUP_TIMEOUT
#: says otherwise: long enough for a slow file system's fsync, short enough that a hung rank
#: is noticed within a job's patience (torch's own default is 30 minutes).
DEFAULT_GROUP_TIMEOUT = 300.0

#: Seconds a rank waits for the others at the handshake before a checkpoint collective,
#: unless FASTCKPT_HANDSHAKE_TIMEOUT says otherwise.
DEFAULT_HANDSHAKE_TIMEOUT = 10.0


def group_timeout_seconds() -> float:
    """``FASTCKPT_GROUP_TIMEOUT``: seconds every checkpoint collective (saves, loads,
    replication, restore) waits for a rank before failing (a rank that hangs rather than
    dies); default 300.

    Example:
        >>> group_timeout_seconds()
        300.0
    """
    return _seconds("GROUP_TIMEOUT", DEFAULT_GROUP_TIMEOUT)


def handshake_timeout_seconds() -> float:
    """``FASTCKPT_HANDSHAKE_TIMEOUT``: seconds a rank waits at the handshake before a
    checkpoint collective for the other ranks to make the same call; default 10.

    Example:
        >>> handshake_timeout_seconds()
        10.0
    """
    return _seconds("HANDSHAKE_TIMEOUT", DEFAULT_HANDSHAKE_TIMEOUT)


def _seconds(name: str, default: float) -> float:
    text = environment(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"environment variable FASTCKPT_{name}={text!r} is not a number of seconds"
        ) from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"FASTCKPT_{name} must be a positive number of seconds, got {text!r}")
    return value


def _from_environment() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key in IO_KEYS:
        name = "FASTCKPT_" + key.upper()
        text = environment(key.upper())
        if text is None:
            continue
        if key == "engine":
            found[key] = text.strip()
        elif key in ("single_submit", "overlap_events"):
            found[key] = _parse_bool(name, text)
        else:
            found[key] = parse_size(text)
    return found


def tuned_config_path() -> Path:
    """Where ``fastckpt tune`` stores what it measured (``FASTCKPT_CONFIG`` overrides)."""
    override = environment("CONFIG")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "fastckpt" / "tuned.json"


_cache_lock = threading.Lock()
_tuned_cache: tuple[tuple[Any, ...], dict[str, dict[str, Any]]] | None = None
_filesystem_keys: dict[tuple[str, int], str] = {}


def _after_fork_in_child() -> None:
    global _cache_lock
    _cache_lock = threading.Lock()  # another thread may have held it at fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def reload() -> None:
    """Forgets the cached tuned configuration and file-system lookups: the next use reads
    the tuned file and the mount table again (after a mount, say).

    Example:
        >>> reload()
    """
    global _tuned_cache
    with _cache_lock:
        _tuned_cache = None
        _filesystem_keys.clear()


def filesystem_key(path: str | os.PathLike[str]) -> str:
    """Names the file system holding ``path`` (which need not exist yet), as ``type:source:mount``.

    Example:
        >>> filesystem_key("/proc/self").startswith("proc:")
        True
    """
    p = Path(os.path.abspath(os.fspath(path)))
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    try:
        # A mount over a directory changes its device: the cached answer then no longer fits.
        cache_key: tuple[str, int] | None = (real, os.stat(real).st_dev)
    except OSError:
        cache_key = None
    if cache_key is not None:
        with _cache_lock:
            known = _filesystem_keys.get(cache_key)
        if known is not None:
            return known
    mount = mount_of(real)
    key = f"{mount.fs_type}:{mount.source}:{mount.mount_point}"
    if cache_key is not None:
        with _cache_lock:
            _filesystem_keys[cache_key] = key
    return key


def _tuned_stamp(path: Path) -> tuple[Any, ...]:
    """What identifies one version of the tuned file (a changed file gets another)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (str(path), None)
    except OSError:
        return (str(path), "unreadable", time.monotonic())  # never matches: read (and warn)
    return (str(path), st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)


def _tuned_entries() -> dict[str, dict[str, Any]]:
    """The tuned configurations, read again only when the file changed; not to be mutated."""
    global _tuned_cache
    path = tuned_config_path()
    stamp = _tuned_stamp(path)
    with _cache_lock:
        if _tuned_cache is not None and _tuned_cache[0] == stamp:
            return _tuned_cache[1]
    entries = _read_tuned(path)
    with _cache_lock:
        _tuned_cache = (stamp, entries)
    return entries


def load_tuned() -> dict[str, dict[str, Any]]:
    """Every tuned configuration, keyed by :func:`filesystem_key`; empty when none is saved."""
    return copy.deepcopy(_tuned_entries())


def _read_tuned(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        # A damaged or unreadable cache of measurements must not stop any I/O: say so, go on.
        warnings.warn(
            f"ignoring the tuned configuration {path}: {exc}", RuntimeWarning, stacklevel=4
        )
        return {}
    entries = data.get("filesystems", {}) if isinstance(data, dict) else {}
    return {k: v for k, v in entries.items() if isinstance(v, dict)}


def save_tuned(fs_key: str, settings: Mapping[str, Any], measured: Mapping[str, Any]) -> Path:
    """Records the best configuration for one file system; returns the file written."""
    entries = load_tuned()
    entry = {
        "config": {k: settings[k] for k in IO_KEYS if k in settings},
        "measured": dict(measured),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if "gds" in entries.get(fs_key, {}):
        entry["gds"] = entries[fs_key]["gds"]  # a GDS measurement stays until re-measured
    entries[fs_key] = entry
    return _write_tuned(entries)


def save_tuned_gds(fs_key: str, measured: Mapping[str, Any]) -> Path:
    """Records what GPUDirect Storage measured on one file system (``read_gbps`` and/or
    ``write_gbps``), next to that file system's tuned configuration; returns the file."""
    entries = load_tuned()
    entry = entries.setdefault(fs_key, {"config": {}, "measured": {}})
    entry["gds"] = {**dict(measured), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    entry.setdefault("time", entry["gds"]["time"])
    return _write_tuned(entries)


def save_tuned_read_mode(
    fs_key: str,
    mode: str,
    gbps: Mapping[str, float],
    *,
    contended: bool = False,
    busy: Mapping[str, Any] | None = None,
) -> Path:
    """Records which way of reading a cold file was fastest on one file system (``mode``:
    ``"direct"``, ``"staged"``, ``"buffered"`` or ``"mapped"``) and what each measured;
    returns the file. ``contended``: measured beside a training-like load on every core
    (``busy`` says how: processes, load averages), kept apart as ``"read_busy"``."""
    if mode not in READ_MODES:
        raise ValueError(f"read mode must be one of {', '.join(READ_MODES)}, got {mode!r}")
    entries = load_tuned()
    entry = entries.setdefault(fs_key, {"config": {}, "measured": {}})
    record: dict[str, Any] = {
        "mode": mode,
        "gbps": {k: round(float(v), 3) for k, v in gbps.items()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if busy is not None:
        record["busy"] = dict(busy)
    key = "read_busy" if contended else "read"
    entry[key] = record
    entry.setdefault("time", record["time"])
    return _write_tuned(entries)


def tuned_read_mode(
    path: str | os.PathLike[str], *, contended: bool = False
) -> tuple[str, str] | None:
    """The way of reading a cold file that ``fastckpt tune`` found fastest on the file system
    of ``path``, and why (the figures); None when it was not measured there. ``contended``:
    the winner measured beside a training-like load on every core (None when tune did not
    measure that).

    Example:
        >>> tuned_read_mode("/nonexistent/x.safetensors", contended=True) is None
        True
    """
    key = "read_busy" if contended else "read"
    read = _tuned_entries().get(filesystem_key(path), {}).get(key, {})
    mode, gbps = read.get("mode"), read.get("gbps", {})
    if mode not in READ_MODES or not isinstance(gbps, dict):
        return None
    figures = ", ".join(f"{k} {v} GB/s" for k, v in gbps.items())
    beside = " beside a busy machine" if contended else ""
    return mode, f"fastckpt tune measured cold reads here{beside}: {figures}"


#: The ways a save can write a local file (see :mod:`fastckpt.io.write_mode`).
WRITE_MODES = ("direct", "buffered")


def save_tuned_write_mode(
    fs_key: str, mode: str, gbps: Mapping[str, float], settings: Mapping[str, Any] | None = None
) -> Path:
    """Records which way of writing a checkpoint until durable was fastest on one file system
    (``mode``: ``"direct"`` or ``"buffered"``), what each measured, and the I/O settings
    (``block_size``, ``queue_depth``, ``staging_bytes``) the direct figure was measured
    with; returns the file written.

    Example:
        >>> import os, tempfile
        >>> os.environ["FASTCKPT_CONFIG"] = os.path.join(tempfile.mkdtemp(), "t.json")
        >>> _ = save_tuned_write_mode("ext4:/dev/x:/", "buffered", {"direct": 0.4, "buffered": 0.5})
        >>> load_tuned()["ext4:/dev/x:/"]["write"]["mode"]
        'buffered'
        >>> del os.environ["FASTCKPT_CONFIG"]; reload()
    """
    if mode not in WRITE_MODES:
        raise ValueError(f"write mode must be one of {', '.join(WRITE_MODES)}, got {mode!r}")
    entries = load_tuned()
    entry = entries.setdefault(fs_key, {"config": {}, "measured": {}})
    entry["write"] = {
        "mode": mode,
        "gbps": {k: round(float(v), 3) for k, v in gbps.items()},
        "settings": dict(settings or {}),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    entry.setdefault("time", entry["write"]["time"])
    return _write_tuned(entries)


def tuned_write_mode(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """The way of writing a checkpoint that ``fastckpt tune`` found fastest on the file
    system of ``path``, and why (the figures); None when it was not measured there.

    Example:
        >>> tuned_write_mode("/nonexistent/x.safetensors") is None
        True
    """
    write = _tuned_entries().get(filesystem_key(path), {}).get("write", {})
    mode, gbps = write.get("mode"), write.get("gbps", {})
    if mode not in WRITE_MODES or not isinstance(gbps, dict):
        return None
    figures = ", ".join(f"{k} {v} GB/s" for k, v in gbps.items())
    return mode, f"fastckpt tune measured saves here: {figures}"


def _write_tuned(entries: Mapping[str, Any]) -> Path:
    path = tuned_config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"filesystems": entries}, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    reload()  # what tune measured applies from the next call on
    return path


def gds_preferred(path: str | os.PathLike[str]) -> bool:
    """Whether tuning found GPUDirect Storage reads faster than reads through page-locked
    staging buffers into GPU memory on the file system of ``path``.

    True only when both were measured there: ``fastckpt tune --gpu`` (the staging pipeline)
    and ``fastckpt tune --gds``, and GDS read faster.

    Example:
        >>> gds_preferred("/nonexistent/x.safetensors")
        False
    """
    entry = _tuned_entries().get(filesystem_key(path), {})
    gds, measured = entry.get("gds", {}), entry.get("measured", {})
    try:
        return bool(measured.get("gpu")) and float(gds["read_gbps"]) > float(measured["read_gbps"])
    except (KeyError, TypeError, ValueError):
        return False


def tuned_for(
    path: str | os.PathLike[str] | None, *, any_filesystem: bool = False
) -> dict[str, Any]:
    """The tuned settings for the file system of ``path``.

    With ``any_filesystem`` (used where no path is known yet, as by ``aio_handle()``), the
    newest entry stands in when that file system was never tuned.
    """
    entries = _tuned_entries()
    if not entries:
        return {}
    if path is not None and filesystem_key(path) in entries:
        return dict(entries[filesystem_key(path)].get("config", {}))
    if any_filesystem:
        newest = max(entries.values(), key=lambda e: str(e.get("time", "")))
        return dict(newest.get("config", {}))
    return {}


def resolve_io(
    path: str | os.PathLike[str] | None,
    explicit: Mapping[str, Any],
    *,
    builtin: IOConfig | None = None,
    any_filesystem: bool = False,
) -> IOConfig:
    """Merges explicit arguments, process defaults, environment, tuning and built-ins.

    ``explicit`` holds only the arguments the caller actually passed (``None`` means unset).
    """
    merged: dict[str, Any] = dataclasses.asdict(builtin or IOConfig())
    layers = (
        tuned_for(path, any_filesystem=any_filesystem),
        _from_environment(),
        _process_defaults,
        explicit,
    )
    for layer in layers:
        for key in IO_KEYS:
            if layer.get(key) is not None:
                merged[key] = layer[key]
    return IOConfig(**merged)


def staging_bytes(explicit: int | None = None) -> int:
    """The staging-memory budget of save/load (default 224 MiB)."""
    if explicit is not None:
        value = explicit
    elif "staging_bytes" in _process_defaults:
        value = _process_defaults["staging_bytes"]
    elif environment("STAGING_BYTES"):
        value = parse_size(environment("STAGING_BYTES") or "")
    else:
        value = DEFAULT_STAGING_BYTES
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 << 20):
        raise ValueError(f"staging_bytes must be an int of at least 1 MiB, got {value!r}")
    return value
