"""``fastckpt inspect FILE|DIR``: what a safetensors/fastckpt file holds and how it is laid out.

For each file: a table of tensors (name, dtype, shape, bytes, absolute file offset and
the alignment of that offset, up to 4096), the totals, a nested checkpoint's other values
(``epoch: 3``, ``args: {...}``), the user's metadata, and whether
CRC32C checksums are present (without them ``fastckpt verify`` cannot check the file), and
for an incremental checkpoint the chain of files it is made of (what each holds and refers
to; a missing one makes the exit status 1).
A directory means every safetensors/fastckpt file directly inside it, whatever its suffix
(Lightning's ``.ckpt`` files written by ``fastckpt.lightning`` included; the kind is read from
the first bytes, and the other files are listed on stderr as skipped), except a
torch.distributed.checkpoint directory (one holding ``.metadata``), which is described as one
checkpoint: its keys, dtypes, global shapes, chunk counts and files. ``--json`` prints a
JSON list with one object per file instead. Only headers are read, never tensor data.

Exit status: 0 every file was described; 1 a file is damaged or unreadable; 2 on usage and
input errors (no such path, a directory without fastckpt/safetensors files, a torch.save
file named on the command line) when no file is damaged.

Example (shell)::

    $ fastckpt inspect model.safetensors
    $ fastckpt inspect --json checkpoints/ | jq '.[].total_bytes'

Example (Python):
    >>> import json, os, tempfile
    >>> from fastckpt.format import build_metadata, encode_header, plan_layout
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny.safetensors")
    >>> entries = plan_layout([("w", "F32", (2, 2))])
    >>> with open(path, "wb") as f:
    ...     _ = f.write(encode_header(entries, build_metadata({"step": "3"})) + bytes(16))
    >>> info = describe_file(path)
    >>> info["tensors"][0]["offset"], info["tensors"][0]["alignment"], info["metadata"]
    (4096, 4096, {'format': 'pt', 'step': '3'})
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
from typing import Any

from fastckpt.cli._common import FAILURE, USAGE, format_bytes, warn
from fastckpt.format import DEFAULT_ALIGNMENT

__all__ = [
    "EXIT_STATUS_HELP",
    "add_allow_pickle",
    "add_parser",
    "describe_file",
    "offset_alignment",
    "printable",
    "read_header",
    "run",
    "tree_values",
]

_MAX_ALIGNMENT = DEFAULT_ALIGNMENT

#: The end of the exit-status epilog that ``inspect`` and ``verify`` share.
EXIT_STATUS_HELP = (
    "2 usage and input errors when nothing is damaged: no such path, a directory without "
    "fastckpt/safetensors files, a torch.save file named on the command line (convert it "
    "with `fastckpt convert`). Options with two words take - or _ (--allow-pickle, "
    "--allow_pickle)."
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``inspect`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "inspect",
        help="list the tensors, layout, metadata and checksums of checkpoint files",
        description=(
            "Prints a table of the tensors of a safetensors/fastckpt file (name, dtype, shape, "
            "bytes, file offset, alignment of the offset), the totals, the user metadata and "
            "whether checksums are present. A directory means every safetensors/fastckpt file "
            "directly in it, whatever its suffix (such as Lightning .ckpt files written by "
            "fastckpt.lightning); the other files there are listed as skipped. A "
            "torch.distributed.checkpoint directory is described as one checkpoint."
        ),
        epilog="exit status: 0 every file was described; 1 a file is damaged or unreadable; "
        + EXIT_STATUS_HELP,
    )
    parser.add_argument("paths", nargs="+", metavar="FILE|DIR", help="files or directories")
    parser.add_argument(
        "--json", action="store_true", help="print a JSON list, one object per file"
    )
    add_allow_pickle(parser)
    parser.set_defaults(run=run)
    return parser


def add_allow_pickle(parser: argparse.ArgumentParser) -> None:
    """``--allow-pickle`` of the commands that read a DCP checkpoint's ``.metadata``."""
    parser.add_argument(
        "--allow-pickle",
        "--allow_pickle",
        dest="allow_pickle",
        action="store_true",
        help="unpickle a DCP checkpoint's .metadata without limits (by default only DCP's "
        "metadata classes are admitted). Unpickling runs code from the file: only for "
        "checkpoints you trust. Modules in the working directory can be imported, as with "
        "`python -m`",
    )


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


def printable(text: str) -> str:
    """``text`` with control characters escaped, so a hostile name or metadata value
    cannot move the cursor, retitle the terminal or hide lines.

    Example:
        >>> print(printable("lr\\x1b[2J\\tok\\u202e"))
        lr\\x1b[2J\\tok\\u202e
    """
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        else:
            escaped = repr(ch)[1:-1]
            out.append(escaped if escaped != ch else f"\\u{ord(ch):04x}")
    return "".join(out)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


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


def _print_file(info: dict[str, Any]) -> None:
    version = info["fastckpt_version"]
    made_by = f"fastckpt format {printable(version)}" if version else "not written by fastckpt"
    print(
        f"{printable(info['path'])}: {_plural(info['tensor_count'], 'tensor')}, {format_bytes(info['total_bytes'])} "
        f"of data, header {info['header_bytes']} bytes (data at offset {info['data_offset']}), "
        f"{made_by}"
    )
    packed = info.get("compressed", 0)
    rows = [("name", "dtype", "shape", "bytes", "offset", "align", *(("ratio",) if packed else ()))]
    for t in info["tensors"]:
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        ratio = (f"{t['ratio']:.3f}",) if "ratio" in t else ("-",) if packed else ()
        rows.append(
            (
                printable(t["name"]),
                t["dtype"],
                shape,
                str(t["bytes"]),
                str(t["offset"]),
                str(t["alignment"]),
                *ratio,
            )
        )
    columns = len(rows[0])
    widths = [max(len(row[i]) for row in rows) for i in range(columns)]
    for n, row in enumerate(rows):
        left = "  ".join(row[i].ljust(widths[i]) for i in range(3))
        right = "  ".join(row[i].rjust(widths[i]) for i in range(3, columns))
        print(f"  {left}  {right}")
        if n == 0:
            print("  " + "-" * (sum(widths) + 2 * (columns - 1)))
    print(
        f"  total: {_plural(info['tensor_count'], 'tensor')}, {info['total_bytes']} bytes "
        f"({format_bytes(info['total_bytes'])}); {info['aligned_4096']} start on a 4096-byte "
        f"boundary; file {info['file_size']} bytes"
    )
    if info["checksums"]:
        print(
            f"  checksums: CRC32C for {info['checksummed']} of "
            f"{_plural(info['tensor_count'], 'tensor')}"
        )
    else:
        print(
            "  checksums: none (`fastckpt verify` cannot check this file; "
            "`fastckpt convert` it to add them)"
        )
    if packed:
        stored = sum(t["bytes"] for t in info["tensors"] if t.get("compressed"))
        raw = sum(t["raw_bytes"] for t in info["tensors"] if t.get("compressed"))
        print(
            f"  compressed: {_plural(packed, 'tensor')} (dtype and shape as loaded; bytes as "
            f"stored), {format_bytes(stored)} of {format_bytes(raw)} (ratio "
            f"{stored / raw if raw else 1:.3f}); the file holds "
            f"{format_bytes(info['raw_bytes'])} of tensors uncompressed"
        )
    if info.get("read_mode"):
        print(f"  read mode now: {info['read_mode']['mode']} ({info['read_mode']['why']})")
    if info["aliases"]:
        shared = ", ".join(f"{printable(a)} -> {printable(b)}" for a, b in info["aliases"].items())
        print(f"  shared tensors: {shared}")
    if info["nested"]:
        print("  structure: a nested object (fastckpt.load rebuilds it)")
        values = info.get("values") or {}
        if values:
            print("  values (other than tensors):")
        for where, value in values.items():
            shown = value if len(value) <= 200 else value[:197] + "..."
            print(f"    {printable(where)}: {printable(shown)}")
    if info.get("chain"):
        _print_chain(info["chain"])
    if info["metadata"]:
        print("  metadata:")
        for key, value in info["metadata"].items():
            shown = value if len(value) <= 200 else value[:197] + "..."
            print(f"    {printable(key)}: {printable(shown)}")
    else:
        print("  metadata: none")


def _print_chain(chain: list[dict[str, Any]]) -> None:
    print(f"  incremental: made of {_plural(len(chain), 'file')} (a load reads each)")
    for link in chain:
        where = printable(link["path"])
        if "error" in link:
            print(f"    {where}: ERROR {printable(link['error'])}")
            continue
        line = (
            f"    {where}: holds {_plural(link['stored_tensors'], 'tensor')} "
            f"({format_bytes(link['stored_bytes'])})"
        )
        if link["referenced_tensors"]:
            line += (
                f", refers to {_plural(link['referenced_tensors'], 'tensor')} "
                f"({format_bytes(link['referenced_bytes'])}) in "
                f"{_plural(len(link['refers_to']), 'file')}"
            )
        print(line)


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt inspect``; exit status 1 when any file could not be read, else 2 when
    a file named was a torch.save file."""
    from fastckpt.cli.unpickling import trusted_unpickling

    with trusted_unpickling(getattr(args, "allow_pickle", False)):
        return _inspect(args)


def _inspect(args: argparse.Namespace) -> int:
    from fastckpt.cli.file_kinds import checkpoint_targets, skipped_summary
    from fastckpt.errors import HeaderError

    status = 0
    described: list[dict[str, Any]] = []
    targets = _inspect_dcp_dirs(args, described)
    files: list[Any] = []
    for target in targets:
        found, listing = checkpoint_targets(target)
        files.extend(found)
        if listing is not None and listing.skipped:
            warn(skipped_summary(listing))
    for n, path in enumerate(files):
        torch_file = _torch_file_message(path)
        if torch_file is not None:
            status = status or USAGE
            described.append({"path": os.fspath(path), "error": torch_file})
            if not args.json:
                print(f"{printable(os.fspath(path))}: {printable(torch_file)}", flush=True)
            continue
        try:
            info = describe_file(path)
        except (HeaderError, OSError) as exc:
            status = FAILURE
            message = (
                f"{exc.strerror} ({exc.filename})"
                if isinstance(exc, OSError) and exc.strerror
                else str(exc)
            )
            info = {"path": os.fspath(path), "error": message}
            if not args.json:
                print(f"{printable(os.fspath(path))}: error: {printable(message)}", flush=True)
        else:
            if any("error" in link for link in info.get("chain") or ()):
                status = FAILURE  # an incremental checkpoint missing a base cannot be loaded
            if not args.json:
                if n:
                    print()
                _print_file(info)
        described.append(info)
    if args.json:
        print(json.dumps(described, indent=2))
    return status


def _torch_file_message(path: Any) -> str | None:
    """What to say of a local torch.save file, or None for any other file."""
    from fastckpt.cli.file_kinds import sniff
    from fastckpt.storage.locations import is_url

    if is_url(path) or not os.path.isfile(path):
        return None
    try:
        kind = sniff(path)
    except OSError:
        return None  # describe_file reports it
    if kind.kind != "torch":
        return None
    return (
        f"{kind.description}, not a fastckpt/safetensors file; "
        f"`fastckpt convert {os.fspath(path)} OUT.safetensors` writes a fastckpt copy"
    )


def _inspect_dcp_dirs(args: argparse.Namespace, described: list[dict[str, Any]]) -> list[str]:
    """Describes the torch.distributed.checkpoint directories among ``args.paths``; returns
    the other paths."""
    from fastckpt.cli.file_kinds import is_dcp_checkpoint

    allow_pickle = getattr(args, "allow_pickle", False)
    others = []
    for target in args.paths:
        if not is_dcp_checkpoint(target):
            others.append(target)
            continue
        # only now: the DCP integration imports torch.distributed.checkpoint (seconds)
        from fastckpt.integrations.dcp import describe_dcp, format_dcp

        if allow_pickle:
            warn(f"--allow-pickle: {target}/.metadata is unpickled without limits")
        info = describe_dcp(target, allow_pickle=allow_pickle)
        described.append(info)
        if not args.json:
            print(format_dcp(info), flush=True)
    return others
