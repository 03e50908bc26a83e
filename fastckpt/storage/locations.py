"""Where a checkpoint lives, read from how it is written: a local path, a ``file://`` URL
(which is a local path too) or an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

This is the one place that turns a ``file://`` URL into a path.

Example:
    >>> local_path("file:///tmp/x.safetensors"), local_path("file://localhost/tmp/x")
    ('/tmp/x.safetensors', '/tmp/x')
    >>> is_url("s3://bucket/x"), is_url("file:///tmp/x"), is_url("/tmp/x")
    (True, False, False)
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

from fastckpt import config

__all__ = ["handles", "is_url", "join", "local_path", "to_local", "url_to_fs"]

_LOCAL_PROTOCOLS = ("file", "local")


def _protocol(path: Any) -> str | None:
    if not isinstance(path, str) or "://" not in path:
        return None
    return path.split("://", 1)[0].split("::")[-1].lower()


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL that goes through fsspec (any protocol but ``file``/``local``).

    Example:
        >>> is_url("memory://b/x"), is_url("local:///tmp/x")
        (True, False)
    """
    protocol = _protocol(path)
    return protocol is not None and protocol not in _LOCAL_PROTOCOLS


def handles(path: Any) -> bool:
    """Whether ``path`` is written as a URL (``scheme://``), ``file://`` included.

    Example:
        >>> handles("file:///tmp/x.safetensors"), handles("/tmp/x.safetensors")
        (True, False)
    """
    return _protocol(path) is not None


def local_path(url: str) -> str:
    """The path of a ``file://`` or ``local://`` URL: ``file:///x`` and ``file://localhost/x``
    are ``/x``; percent-escapes are decoded. A URL naming another host is refused.

    Raises:
        ValueError: the URL names a host other than ``localhost``, or is not a local URL.

    Example:
        >>> local_path("file:///tmp/a%20b"), local_path("local://localhost/tmp/y")
        ('/tmp/a b', '/tmp/y')
        >>> local_path("file://server/share/x")
        Traceback (most recent call last):
        ...
        ValueError: file://server/share/x: names host 'server'; only local files (file:///path or file://localhost/path) are read as files
    """
    if _protocol(url) not in _LOCAL_PROTOCOLS:
        raise ValueError(f"{url!r} is not a file:// URL")
    rest = url.split("://", 1)[1]
    host, slash, path = rest.partition("/")
    if host.lower() not in ("", "localhost"):  # host names are case-insensitive
        raise ValueError(
            f"{url}: names host {host!r}; only local files (file:///path or "
            "file://localhost/path) are read as files"
        )
    return urllib.parse.unquote(slash + path)


def to_local(path: Any) -> str | None:
    """The local path that ``path`` (a str, an ``os.PathLike`` or a ``file://`` URL) names,
    or None for an fsspec URL or what is not a path.

    Example:
        >>> to_local("file:///tmp/x"), to_local("s3://b/x"), to_local("rel/x")
        ('/tmp/x', None, 'rel/x')
    """
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str) or is_url(path):
        return None
    return local_path(path) if handles(path) else path


def join(base: str, name: str) -> str:
    """``name`` inside ``base``, a local directory or a URL.

    Example:
        >>> join("s3://bucket/run/", "model.safetensors"), join("/tmp/run", "a")
        ('s3://bucket/run/model.safetensors', '/tmp/run/a')
    """
    return base.rstrip("/") + "/" + name if is_url(base) else os.path.join(base, name)


def url_to_fs(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(filesystem, path)`` for ``url``, as ``fsspec.core.url_to_fs`` resolves it.

    ``storage_options`` None means the JSON object in ``FASTCKPT_STORAGE_OPTIONS`` (or none).

    Raises:
        ImportError: fsspec (or the package of this protocol, such as s3fs) is not installed.
        ValueError: the protocol is unknown.

    Example:
        >>> fs, path = url_to_fs("memory://bucket/x.safetensors")
        >>> type(fs).__name__, path
        ('MemoryFileSystem', '/bucket/x.safetensors')
    """
    try:
        import fsspec.core
    except ImportError:
        raise ImportError(
            f"{url}: URLs need fsspec (pip install s3fs for S3, or fsspec; in a clone of fastckpt, pip install '.[s3]')"
        ) from None
    if storage_options is None:
        storage_options = _options_from_environment()
    if not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    return fsspec.core.url_to_fs(url, **dict(storage_options))


def _options_from_environment() -> dict[str, Any]:
    """``FASTCKPT_STORAGE_OPTIONS`` (a JSON object): storage options when a call passes none."""
    text = (config.environment("STORAGE_OPTIONS") or "").strip()
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"FASTCKPT_STORAGE_OPTIONS is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError("FASTCKPT_STORAGE_OPTIONS must be a JSON object")
    return options
