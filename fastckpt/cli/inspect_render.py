"""How ``fastckpt inspect`` prints what :mod:`fastckpt.cli.inspect_facts` gathered: a file's
summary line, its tensor table, totals, checksums, compression, read mode, shared tensors,
values, incremental chain and metadata, with every name and value from the file made
printable first (a hostile header cannot drive the terminal).

Example:
    >>> print(printable("step\\x1b[2J"))
    step\\x1b[2J
"""

from __future__ import annotations

from typing import Any

from fastckpt.cli._common import format_bytes

__all__ = ["printable"]


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
