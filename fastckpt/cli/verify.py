"""``fastckpt verify FILE|DIR``: check headers and every tensor's CRC32C and XXH3-128.

Each file is reported as one of:

- ``OK``: the header is valid (its own checksum matches, aliases and the structure
  description resolve against the stored tensors: everything ``fastckpt.load`` relies on)
  and every tensor matches the checksums saved with it: its CRC32C and, where the file
  records one (every fastckpt save does), its XXH3-128 (a compressed tensor's decoded
  bytes, a few chunks at a time: memory stays bounded whatever its size);
- ``DAMAGED``: the header is malformed, or the named tensors do not match their checksums
  (each named with the check it failed: ``CRC32C``, ``XXH3-128`` or ``decompressed CRC32C``);
- ``UNVERIFIABLE``: the file has no checksums (written with ``checksum=False`` or by another
  library) — which is not the same as intact; ``fastckpt convert`` can add them;
- ``NOT CHECKED``: a file named on the command line is a torch.save file, not a
  fastckpt/safetensors file (``fastckpt convert`` writes a fastckpt copy that can be checked).

A directory means every fastckpt/safetensors file directly inside it, whatever its suffix
(Lightning's ``.ckpt`` files written by ``fastckpt.lightning`` included): the kind is read from
each file's first bytes. The other files there (torch.save files, notes) are listed on stderr
as skipped and do not change the exit status.

A torch.distributed.checkpoint directory (one holding ``.metadata``) is checked as one
checkpoint: its metadata, that every file and tensor it names exists, and every CRC32C (DCP's
own ``FileSystemWriter`` format has no checksums: ``UNVERIFIABLE``).

The root of a checkpoint series (a ``CheckpointManager``'s, holding ``step-<12 digits>``
directories) means each of its committed steps: the step's file, or its DCP directory
(``fastckpt ls --verify ROOT`` lists the steps with the verdict of each). A step directory
means the checkpoint it holds.

Exit status: 0 when every file is OK, 1 when any is damaged, unverifiable or unreadable,
2 on usage and input errors (no such path, a directory without fastckpt/safetensors files,
a torch.save file named on the command line) when nothing is damaged.

Example (shell)::

    $ fastckpt verify checkpoints/
    OK            checkpoints/model-00001.safetensors (291 tensors, 4.95 GiB)
    DAMAGED       checkpoints/model-00002.safetensors: 1 tensor does not match its checksum: lm_head.weight (CRC32C)
    2 files: 1 OK, 1 damaged
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from fastckpt.cli._common import FAILURE, USAGE, format_bytes
from fastckpt.cli.file_kinds import (
    checkpoint_targets,
    is_dcp_checkpoint,
    skipped_summary,
    sniff,
)
from fastckpt.cli.inspect import EXIT_STATUS_HELP, add_allow_pickle
from fastckpt.cli.unpickling import trusted_unpickling

__all__ = ["Verdict", "add_parser", "run", "verify_file"]

OK, DAMAGED, UNVERIFIABLE, UNREADABLE = "OK", "DAMAGED", "UNVERIFIABLE", "ERROR"
#: A file of another kind (a torch.save file): nothing to verify, and not damage either.
NOT_CHECKED = "NOT CHECKED"


class Verdict:
    """What :func:`verify_file` found: a ``status`` (``OK``, ``DAMAGED``, ``UNVERIFIABLE``,
    ``ERROR``, ``NOT CHECKED``), a one-line ``detail`` and the ``damaged`` tensor names.

    Example:
        >>> v = Verdict("OK", "3 tensors")
        >>> v.ok, str(v)
        (True, 'OK            3 tensors')
    """

    def __init__(self, status: str, detail: str, damaged: list[str] | None = None):
        self.status, self.detail, self.damaged = status, detail, list(damaged or [])

    @property
    def ok(self) -> bool:
        return self.status == OK

    def __str__(self) -> str:
        return f"{self.status:<13} {self.detail}"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``verify`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "verify",
        help="check the headers and CRC32C checksums of checkpoint files",
        description=(
            "Checks the header and every tensor's CRC32C (and XXH3-128, where recorded) of "
            "safetensors/fastckpt files. A directory means every safetensors/fastckpt file "
            "directly in it, whatever its suffix (such as Lightning .ckpt files written by "
            "fastckpt.lightning); the other files there are listed as skipped. A checkpoint "
            "series' root means each of its committed steps. Files without checksums are "
            "reported as UNVERIFIABLE, not as intact; a torch.save file as NOT CHECKED "
            "(`fastckpt convert` writes a fastckpt copy)."
        ),
        epilog="exit status: 0 every file is intact; 1 a file is damaged (the damaged tensors "
        "are named), unverifiable or unreadable; " + EXIT_STATUS_HELP,
    )
    parser.add_argument("paths", nargs="+", metavar="FILE|DIR", help="files or directories")
    add_allow_pickle(parser)
    parser.set_defaults(run=run)
    return parser


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def verify_file(
    path: str | os.PathLike[str], *, progress: bool | None = None, allow_pickle: bool = False
) -> Verdict:
    """Checks one file: its header, then every tensor against its saved CRC32C and
    XXH3-128 (where recorded).

    ``progress`` shows a bar over the file's bytes (default: on a terminal). A DCP
    checkpoint directory is checked as one checkpoint; its ``.metadata`` is unpickled
    without limits only with ``allow_pickle=True`` (trusted checkpoints only).

    Example:
        >>> verify_file("/no/such.safetensors").status
        'ERROR'
    """
    from fastckpt import api
    from fastckpt.cli.inspect import describe_file
    from fastckpt.errors import FastCkptError, HeaderError
    from fastckpt.storage.locations import is_url

    name = os.fspath(path)
    if os.path.isdir(name) or is_dcp_checkpoint(name):  # a DCP checkpoint
        # only now: the DCP integration imports torch.distributed.checkpoint (seconds)
        from fastckpt.integrations.dcp import verify_dcp

        return Verdict(*verify_dcp(name, allow_pickle=allow_pickle))
    if not is_url(name) and os.path.isfile(name):
        try:
            kind = sniff(name)
        except OSError as exc:
            return Verdict(UNREADABLE, f"{name}: {exc.strerror or exc}")
        if kind.kind == "torch":
            return Verdict(
                NOT_CHECKED,
                f"{name}: {kind.description}, not a fastckpt/safetensors file, so it has no "
                f"checksums to verify; `fastckpt convert {name} OUT.safetensors` writes a "
                "fastckpt copy that can be verified",
            )
    try:
        info = describe_file(path)  # validates the header without reading any data
    except HeaderError as exc:
        return Verdict(DAMAGED, f"{name}: bad header: {exc}")
    except OSError as exc:
        return Verdict(UNREADABLE, f"{name}: {exc.strerror or exc}")
    size = f"{_plural(info['tensor_count'], 'tensor')}, {format_bytes(info['total_bytes'])}"
    try:
        _check_structure(path)
    except HeaderError as exc:
        return Verdict(DAMAGED, f"{name}: bad header: {exc}")
    except OSError as exc:
        return Verdict(UNREADABLE, f"{name}: {exc.strerror or exc}")
    if not info["checksums"]:
        return Verdict(
            UNVERIFIABLE,
            f"{name}: no checksums ({size}); written without them or "
            "by another library, so its data cannot be checked",
        )
    try:
        with api.open(path) as reader:  # one Reader type, whatever the storage
            failures = reader.verify_failures(progress=progress)
    except HeaderError as exc:
        return Verdict(DAMAGED, f"{name}: bad header: {exc}")
    except OSError as exc:  # a missing base of an incremental file included
        return Verdict(UNREADABLE, f"{name}: {exc.strerror or exc}")
    except FastCkptError as exc:  # a base changed since this file referred to it, ...
        return Verdict(DAMAGED, f"{name}: {exc}")
    damaged = list(failures)
    if damaged:
        shown = ", ".join(f"{n} ({failures[n]})" for n in damaged[:20]) + (
            f", ... ({len(damaged) - 20} more)" if len(damaged) > 20 else ""
        )
        verb = (
            "does not match its checksum" if len(damaged) == 1 else "do not match their checksums"
        )
        return Verdict(
            DAMAGED, f"{name}: {_plural(len(damaged), 'tensor')} {verb}: {shown}", damaged
        )
    unchecked = info["tensor_count"] - info["checksummed"]
    if unchecked:
        return Verdict(
            UNVERIFIABLE,
            f"{name}: {_plural(unchecked, 'tensor')} of "
            f"{info['tensor_count']} have no checksum; the others match",
        )
    return Verdict(OK, f"{name} ({size})")


def _check_structure(path: str | os.PathLike[str]) -> None:
    """HeaderError unless ``fastckpt.load`` could rebuild the saved object from the header:
    dtypes torch holds, aliases and every tree node resolving to stored tensors (checked
    on ``meta`` tensors, reading no data and unpickling nothing)."""
    import torch

    from fastckpt.checkpoint import compressed_tensors, dtypes, tree
    from fastckpt.cli.inspect import read_header
    from fastckpt.format import split_metadata

    header = read_header(path)
    meta = split_metadata(header.metadata)
    packed = compressed_tensors.table_of(header, os.fspath(path))  # their true dtypes and shapes
    entries = [
        compressed_tensors.logical_entry(e, packed[e.name]) if e.name in packed else e
        for e in header.entries.values()
    ]
    stand_ins = {
        e.name: torch.empty(e.shape, dtype=dtypes.to_torch(e.dtype), device="meta")
        for e in entries
        if e.name not in meta.aliases  # a tied tensor's stored copy: the alias resolves it
    }
    if meta.references is not None:  # an incremental checkpoint: tensors held by its bases
        stand_ins.update(
            (
                name,
                torch.empty(
                    dtypes.torch_shape(r.dtype, r.shape, tensor=name),
                    dtype=dtypes.to_torch(r.dtype),
                    device="meta",
                ),
            )
            for name, r in meta.references.tensors.items()
            if name not in meta.aliases
        )
    tree.validate(meta.tree, stand_ins, meta.aliases)


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt verify``; returns 0 only when every file is intact, 1 when any is not,
    else 2 when a file named was not a fastckpt/safetensors file."""
    from fastckpt.cli._common import warn

    allow_pickle = getattr(args, "allow_pickle", False)
    if allow_pickle:
        warn("--allow-pickle: DCP .metadata files are unpickled without limits")
    files: list[Any] = []
    for target in args.paths:
        if is_dcp_checkpoint(target):
            files.append(target)
            continue
        steps = _series_steps(target)
        if steps is not None:
            files.extend(steps)
            continue
        found, listing = checkpoint_targets(target)
        files.extend(found)
        if listing is not None and listing.skipped:
            warn(skipped_summary(listing))
    with trusted_unpickling(allow_pickle):
        counts = _verify_all(files, allow_pickle)
    if len(files) > 1:
        parts = [
            f"{counts[s]} {s.lower() if s != OK else s}"
            for s in (OK, DAMAGED, UNVERIFIABLE, UNREADABLE, NOT_CHECKED)
            if counts.get(s)
        ]
        print(f"{len(files)} files: {', '.join(parts)}")
    if counts.get(OK, 0) + counts.get(NOT_CHECKED, 0) < len(files):
        return FAILURE
    return USAGE if counts.get(NOT_CHECKED) else 0


def _series_steps(target: str) -> list[str] | None:
    """The checkpoints of the committed steps of the series whose root is ``target`` (a
    step's file, or its directory when ranks saved it as a DCP checkpoint), said on stderr;
    None when ``target`` is not a series' root.

    Raises:
        CliError: (status 2) the series has no committed step.
    """
    from fastckpt.cli._common import CliError, warn
    from fastckpt.series import steps as series_steps
    from fastckpt.storage.directory_kinds import directory_kind

    kind = directory_kind(target)
    if kind is None or kind.kind != "series":
        return None
    committed = series_steps.committed_steps(target)
    if not committed:
        raise CliError(f"{target}: {kind.what}: no committed step to verify", USAGE)
    found = []
    for step in committed:
        directory = series_steps.step_dir(target, step)
        state = os.path.join(directory, series_steps.STATE_FILE)
        found.append(state if os.path.isfile(state) else directory)
    warn(
        f"{target}: {kind.what}: verifying each committed step "
        f"(`fastckpt ls --verify {target}` lists the steps, each with its verdict)"
    )
    return found


def _verify_all(files: list[Any], allow_pickle: bool) -> dict[str, int]:
    """Verifies and reports each file; returns how many got each status."""
    from fastckpt.progress import progress_bar

    counts: dict[str, int] = {}
    with progress_bar(
        len(files), "verifying", unit="file", enabled=None if len(files) > 1 else False
    ) as bar:
        for path in files:
            verdict = verify_file(
                path, progress=None if len(files) == 1 else False, allow_pickle=allow_pickle
            )
            counts[verdict.status] = counts.get(verdict.status, 0) + 1
            writer = getattr(bar, "write", None)
            (writer or print)(str(verdict))
            bar.update(1)
    return counts
