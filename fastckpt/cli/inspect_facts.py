"""The facts ``fastckpt inspect`` reports about a checkpoint file, gathered from its header
alone (never its tensor data): the header read and validated (:func:`read_header`, shared
with ``verify`` and ``convert``), each tensor's layout, the checksums and metadata, a nested
checkpoint's other values (:func:`tree_values`), how a load would read the data now, and the
chain of files an incremental checkpoint is made of (:func:`describe_chain`).

Everything is returned as JSON-able dicts and lists; :mod:`fastckpt.cli.inspect_render`
prints them.

Example:
    >>> import os, tempfile
    >>> from fastckpt.format import build_metadata, encode_header, plan_layout
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny.safetensors")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(encode_header(plan_layout([("w", "F32", (2,))]), build_metadata({})) + bytes(8))
    >>> info = describe_file(path)
    >>> info["tensor_count"], info["checksums"], info["nested"]
    (1, False, False)
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from fastckpt.format import DEFAULT_ALIGNMENT

__all__ = ["describe_chain", "describe_file", "offset_alignment", "read_header", "tree_values"]

_MAX_ALIGNMENT = DEFAULT_ALIGNMENT


def offset_alignment(offset: int) -> int:
    """The largest power of two dividing ``offset``, capped at 4096 (0 counts as 4096).

    Example:
        >>> offset_alignment(4096 * 3), offset_alignment(4100), offset_alignment(0)
        (4096, 4, 4096)
    """
    if offset == 0:
        return _MAX_ALIGNMENT
    return min(offset & -offset, _MAX_ALIGNMENT)


def read_header(path: str | os.PathLike[str]) -> Any:
    """Reads and validates the header of a safetensors file (not its data).

    Returns:
        a :class:`fastckpt.format.Header`.

    Raises:
        fastckpt.HeaderError: not a valid safetensors file (the message says why).
        OSError: the file cannot be read, or is not a regular file (a FIFO, a device: refused
            at once, where opening would wait for a writer).

    Example:
        >>> read_header("/no/such.safetensors")
        Traceback (most recent call last):
        ...
        FileNotFoundError: [Errno 2] No such file or directory: '/no/such.safetensors'
    """
    from fastckpt.format import read_header_from
    from fastckpt.storage.locations import is_url

    if is_url(path):
        from fastckpt.integrations.remote import RemoteReader

        return RemoteReader(os.fspath(path)).header  # reads the header's bytes only
    # Non-blocking, so a FIFO does not wait for a writer; then only a regular file is read.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _require_regular(fd, os.fspath(path))
        os.set_blocking(fd, True)
        return read_header_from(
            lambda offset, nbytes: os.pread(fd, nbytes, offset), os.fstat(fd).st_size
        )
    finally:
        os.close(fd)


def _require_regular(fd: int, path: str) -> None:
    """OSError(EINVAL) naming ``path`` unless ``fd`` is a regular file."""
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
    kind = (
        "a named pipe (FIFO)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a file"
    )
    raise OSError(errno.EINVAL, f"not a regular file ({kind}); checkpoints are files", path)


def describe_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything ``inspect`` reports about one file, as a JSON-able dict.

    Keys: ``path``, ``file_size``, ``header_bytes``, ``data_offset``, ``tensors`` (a list of
    ``name, dtype, shape, bytes, offset, alignment``), ``tensor_count``, ``total_bytes``,
    ``aligned_4096`` (tensors starting on a 4096-byte boundary), ``metadata`` (the user's),
    ``checksums`` (bool), ``checksummed`` (how many tensors), ``aliases``, ``nested``,
    ``values`` (a nested checkpoint's values other than tensors: path -> Python literal, see
    :func:`tree_values`),
    ``fastckpt_version`` (None for files other writers made), ``read_mode`` (how a load
    would read the data now and why: ``{"mode", "why"}``), ``chain`` (None unless the file is
    an incremental checkpoint: see :func:`describe_chain`), ``compressed`` (how many tensors
    are stored compressed: each of those has its true ``dtype`` and ``shape``, ``bytes`` as
    stored, ``raw_bytes`` and ``ratio``), ``raw_bytes`` (the tensors' uncompressed size).

    Raises:
        fastckpt.HeaderError, OSError: as :func:`read_header`.
    """
    from fastckpt.format import split_metadata
    from fastckpt.format.compressed import parse_table

    header = read_header(path)
    meta = split_metadata(header.metadata)
    packed = parse_table(header.metadata, header.entries)
    tensors = []
    for entry in header.entries.values():
        offset = header.data_offset + entry.begin
        described: dict[str, Any] = {
            "name": entry.name,
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "bytes": entry.nbytes,
            "offset": offset,
            "alignment": offset_alignment(offset),
        }
        c = packed.get(entry.name)
        if c is not None:  # its true dtype and shape; "bytes" stays what the file stores
            described.update(dtype=c.dtype, shape=list(c.shape), compressed=True)
            described.update(raw_bytes=c.nbytes, ratio=entry.nbytes / c.nbytes if c.nbytes else 1.0)
        tensors.append(described)
    crcs = meta.crcs or {}
    return {
        "path": os.fspath(path),
        "file_size": header.data_offset + header.data_size,
        "header_bytes": header.data_offset - 8,
        "data_offset": header.data_offset,
        "tensors": tensors,
        "tensor_count": len(tensors),
        "total_bytes": header.data_size,
        "aligned_4096": sum(1 for t in tensors if t["alignment"] == _MAX_ALIGNMENT),
        "metadata": meta.user,
        "checksums": meta.crcs is not None,
        "checksummed": sum(1 for t in tensors if t["name"] in crcs),
        "aliases": meta.aliases,
        "nested": meta.tree is not None,
        "values": _values(meta.tree),
        "fastckpt_version": meta.version,
        "read_mode": _read_mode(path, header.data_offset, header.data_size),
        "chain": describe_chain(path) if meta.references is not None else None,
        "compressed": len(packed),
        "raw_bytes": sum(t.get("raw_bytes", t["bytes"]) for t in tensors),
    }


def _files_referred(path: str, references: Any) -> list[str]:
    from fastckpt.storage.locations import is_url

    if is_url(path):
        import posixpath

        scheme, _, rest = path.partition("://")
        return [
            f"{scheme}://{posixpath.normpath(posixpath.join(posixpath.dirname(rest), f))}"
            for f in references.files
        ]
    directory = os.path.dirname(os.path.abspath(path))
    return [os.path.normpath(os.path.join(directory, f)) for f in references.files]


def describe_chain(path: str | os.PathLike[str], limit: int = 64) -> list[dict[str, Any]]:
    """The files an incremental checkpoint is made of, itself first, then every file it
    refers to (breadth first, each once): per file ``path``, ``stored_tensors`` and
    ``stored_bytes`` (what it holds), ``referenced_tensors`` and ``referenced_bytes`` (what
    it takes from ``refers_to``, the files it names), or ``error`` (missing, unreadable).
    Headers only; references are resolved as ``fastckpt.load`` resolves them.

    Example:
        >>> import os, tempfile, torch, fastckpt
        >>> d = tempfile.mkdtemp()
        >>> fastckpt.save({"a": torch.ones(4), "b": torch.ones(2)}, os.path.join(d, "0.safetensors"))
        >>> fastckpt.save({"a": torch.ones(4), "b": torch.zeros(2)}, os.path.join(d, "1.safetensors"),
        ...               base=os.path.join(d, "0.safetensors"))
        >>> [(os.path.basename(f["path"]), f["stored_tensors"], f["referenced_tensors"])
        ...  for f in describe_chain(os.path.join(d, "1.safetensors"))]
        [('1.safetensors', 1, 1), ('0.safetensors', 2, 0)]
    """
    from fastckpt.errors import HeaderError
    from fastckpt.format import split_metadata
    from fastckpt.format.schema import tensor_nbytes

    queue: list[str] = [os.fspath(path)]
    seen: set[str] = set()
    chain: list[dict[str, Any]] = []
    while queue and len(chain) < limit:
        current = queue.pop(0)
        if current in seen:
            continue
        seen.add(current)
        try:
            header = read_header(current)
            meta = split_metadata(header.metadata)
        except (HeaderError, OSError) as exc:
            reason = "missing" if isinstance(exc, FileNotFoundError) else str(exc)
            chain.append({"path": current, "error": reason})
            continue
        refs = meta.references
        referred = _files_referred(current, refs) if refs is not None else []
        tensors = refs.tensors.values() if refs is not None else ()
        chain.append(
            {
                "path": current,
                "stored_tensors": len(header.entries),
                "stored_bytes": header.data_size,
                "referenced_tensors": len(tensors),
                "referenced_bytes": sum(
                    tensor_nbytes(r.dtype, list(r.shape)) or 0 for r in tensors
                ),
                "refers_to": referred,
            }
        )
        queue.extend(referred)
    return chain


def _read_mode(path: str | os.PathLike[str], offset: int, nbytes: int) -> dict[str, str] | None:
    """How a load would read the data section now, and why (None where it cannot say)."""
    from fastckpt.storage.local import LocalStorage

    try:
        with LocalStorage(path) as storage:
            mode, why = storage.choose_mode((offset, nbytes))
    except (OSError, ValueError):
        return None
    return {"mode": mode, "why": why}


def _literal(node: Any) -> str:
    """A structure-tree node (docs/format.md, "The structure tree") as Python would print it;
    a tensor as ``<tensor NAME>``, a pickled object as ``<pickled TYPE>``.

    Example:
        >>> _literal({"t": "dict", "k": ["lr", 5], "v": [0.1, {"t": "tuple", "v": [True, "a"]}]})
        "{'lr': 0.1, 5: (True, 'a')}"
    """
    if isinstance(node, list):
        return "[" + ", ".join(_literal(v) for v in node) + "]"
    if not isinstance(node, dict):
        return repr(node)
    tag, value = node.get("t"), node.get("v")
    if tag in ("dict", "odict"):
        pairs = zip(node.get("k", []), value or [])
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in pairs) + "}"
    if tag == "tuple":
        items = [_literal(v) for v in value or []]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    simple = {
        "none": lambda: "None",
        "tensor": lambda: f"<tensor {node.get('n')}>",
        "float": lambda: f"float({value!r})",
        "int": lambda: str(int(value, 16)) if isinstance(value, str) else repr(value),
        "dtype": lambda: f"torch.{value}",
        "size": lambda: f"torch.Size({value!r})",
        "device": lambda: f"device({value!r})",
        "bytes": lambda: f"<{len(value or '') * 3 // 4} bytes>",
        "pickle": lambda: f"<pickled {node.get('type', 'object')}>",
    }
    return simple[tag]() if tag in simple else f"<{tag}>"


def _holds_tensors(node: Any) -> bool:
    if isinstance(node, list):
        return any(_holds_tensors(v) for v in node)
    if not isinstance(node, dict):
        return False
    if node.get("t") == "tensor":
        return True
    return (
        any(_holds_tensors(v) for v in node.get("v") or [])
        if node.get("t")
        in (
            "dict",
            "odict",
            "tuple",
        )
        else False
    )


def tree_values(tree: Any, path: str = "") -> list[tuple[str, str]]:
    """The values of a nested checkpoint other than its tensors (which the tensor table
    lists): ``(path, value)`` pairs, a path joining keys with ``/`` as tensor names do, and
    each part that holds no tensor shown whole.

    Example:
        >>> tree = {"t": "dict", "k": ["model", "epoch", "args"], "v": [
        ...     {"t": "dict", "k": ["w"], "v": [{"t": "tensor", "n": "model/w"}]},
        ...     3, {"t": "dict", "k": ["lr"], "v": [0.1]}]}
        >>> tree_values(tree)
        [('epoch', '3'), ('args', "{'lr': 0.1}")]
    """
    if not _holds_tensors(tree):
        return [(path or "(the object)", _literal(tree))]
    if isinstance(tree, list):
        children = [(str(i), v) for i, v in enumerate(tree)]
    elif tree.get("t") in ("dict", "odict"):
        children = [
            (str(k) if not isinstance(k, dict) else _literal(k), v)
            for k, v in zip(tree.get("k", []), tree.get("v") or [])
        ]
    elif tree.get("t") == "tuple":
        children = [(str(i), v) for i, v in enumerate(tree.get("v") or [])]
    else:
        return []  # a tensor: in the table
    found: list[tuple[str, str]] = []
    for key, child in children:
        found += tree_values(child, f"{path}/{key}" if path else key)
    return found


def _values(tree: Any) -> dict[str, str]:
    """:func:`tree_values` as a dict; a tree it cannot walk (a hostile or damaged header that
    the format layer let through) is reported, not raised: inspect describes what it can."""
    if tree is None:
        return {}
    try:
        return dict(tree_values(tree))
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as exc:
        return {"(the object)": f"<a structure inspect cannot show: {type(exc).__name__}>"}
