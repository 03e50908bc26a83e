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

This module is the command (its options, the walk over the paths, the exit status);
:mod:`fastckpt.cli.inspect_facts` gathers what a file's header says and
:mod:`fastckpt.cli.inspect_render` prints it. Their public names are importable from here.

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
import json
import os
from typing import Any

from fastckpt.cli._common import FAILURE, USAGE, warn
from fastckpt.cli.inspect_facts import describe_chain as describe_chain  # public, not in __all__
from fastckpt.cli.inspect_facts import (
    describe_file,
    offset_alignment,
    read_header,
    tree_values,
)
from fastckpt.cli.inspect_render import _print_file, printable

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
