"""``fastckpt convert SRC DST``: torch and safetensors files to the fastckpt layout, and back.

- SRC a torch file (``.pt``/``.pth``/``.bin``, zip or legacy format) is loaded with
  ``torch.load(weights_only=True)``, which refuses arbitrary pickled objects;
  ``--allow-pickle`` lifts that (with a warning: unpickling runs code from the file) and,
  as ``python -m`` does, lets the classes it names be imported from the working directory.
- SRC a safetensors or fastckpt file is read with ``fastckpt.load`` (nested objects come
  back as saved); its metadata is kept.
- DST ending in ``.pt``, ``.pth`` or ``.bin`` is written with ``torch.save``; any other name
  gets the fastckpt layout (a safetensors file aligned for direct I/O, with checksums).

- SRC a torch.distributed.checkpoint directory (written by ``fastckpt.dcp.FastCkptWriter``
  or DCP's ``FileSystemWriter``) is consolidated into the single file DST (full tensors);
  its ``.metadata`` admits only DCP's metadata classes and its non-tensor values are loaded
  with ``weights_only=True``, unless ``--allow-pickle``;
  ``--to-dcp`` goes the other way: DST becomes a DCP checkpoint directory of fastckpt files.

- SRC an incremental checkpoint (saved with ``base=``) gives a self-contained DST: every
  tensor it refers to in earlier files is copied in. ``--materialize`` says so explicitly
  and also allows DST to be SRC itself (rewritten in place, atomically), so that its bases
  can then be deleted.

DST is written atomically (a temporary file renamed over it) and never overwritten
unless ``--force`` is given. A DST that is a directory (an existing one, or a name ending
with ``/``, created) gets ``DST/model.safetensors``, as ``fastckpt.save`` writes.

Exit status: 0 converted; 1 SRC is damaged, holds objects refused without
``--allow-pickle``, or DST could not be written; 2 on usage and input errors (no such SRC,
SRC not a checkpoint, DST exists without ``--force``, a module the pickle names cannot be
imported). Options with two words take ``-`` or ``_`` (``--allow-pickle``, ``--allow_pickle``).

Example (shell)::

    $ fastckpt convert pytorch_model.bin model.safetensors
    $ fastckpt convert model.safetensors model.pt
    $ fastckpt convert checkpoints/step-1000 step-1000.safetensors
    $ fastckpt convert --to-dcp step-1000.safetensors checkpoints/step-1000-copy
    $ fastckpt convert --materialize step-9/state.safetensors step-9/state.safetensors
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import secrets
import time
from pathlib import Path
from typing import Any

from fastckpt.cli._common import USAGE, CliError, format_bytes, warn
from fastckpt.cli.unpickling import trusted_unpickling

__all__ = ["TORCH_SUFFIXES", "add_parser", "run", "source_kind"]

#: Destination suffixes written with ``torch.save``.
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``convert`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "convert",
        help="convert torch .pt/.bin and safetensors files to the fastckpt layout (or to .pt)",
        description=(
            "Converts SRC (a torch .pt/.pth/.bin file, or a safetensors/fastckpt file) to DST. DST "
            "ending in .pt, .pth or .bin is written with torch.save; any other DST gets the fastckpt "
            "layout (safetensors-compatible, aligned for direct I/O, with CRC32C checksums). "
            "Metadata is kept. Torch files are loaded with weights_only=True."
        ),
        epilog="exit status: 0 converted; 1 SRC is damaged, holds objects refused without "
        "--allow-pickle, or DST could not be written; 2 usage and input errors: no such SRC, "
        "SRC not a torch.save/safetensors file or DCP directory, DST exists without --force, "
        "a module the pickle names cannot be imported. Options with two words take - or _ "
        "(--to-dcp, --to_dcp, --allow-pickle, --allow_pickle).",
    )
    parser.add_argument("src", metavar="SRC", help="the file to convert")
    parser.add_argument("dst", metavar="DST", help="the file to write")
    parser.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    parser.add_argument(
        "--to-dcp",
        "--to_dcp",
        dest="to_dcp",
        action="store_true",
        help="write DST as a torch.distributed.checkpoint directory (fastckpt files, loadable "
        "with fastckpt.dcp.FastCkptReader by any number of ranks); a DCP directory as SRC is "
        "always consolidated into the single file DST",
    )
    parser.add_argument(
        "--materialize",
        action="store_true",
        help="SRC is an incremental checkpoint: write DST with every tensor it refers to in "
        "earlier files copied in (self-contained); DST may be SRC itself, rewritten in place "
        "atomically",
    )
    parser.add_argument(
        "--allow-pickle",
        "--allow_pickle",
        dest="allow_pickle",
        action="store_true",
        help="load torch files with weights_only=False and keep arbitrary Python "
        "objects (pickled into the fastckpt metadata); for a DCP checkpoint, unpickle its "
        ".metadata and non-tensor values without limits. Unpickling runs code from "
        "the file: only for files you trust. The classes it names are imported from the "
        "working directory too, as with `python -m fastckpt`",
    )
    parser.set_defaults(run=run)
    return parser


def source_kind(path: str | os.PathLike[str]) -> str:
    """``"safetensors"`` or ``"torch"``, from the file's content (not its name).

    Example:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "x.bin")
        >>> torch.save({"a": torch.zeros(1)}, p)
        >>> source_kind(p)
        'torch'
    """
    from fastckpt.cli.inspect import read_header
    from fastckpt.errors import HeaderError
    from fastckpt.format.torch_save import SNIFF_BYTES, torch_save_format

    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if torch_save_format(head) is not None:
        return "torch"
    try:
        read_header(path)
    except HeaderError:
        return "torch"  # legacy pickle format, or not a checkpoint: torch.load will say
    return "safetensors"


def _check_torch_magic(src: str) -> None:
    """CliError naming ``src`` unless it starts as torch.save writes: a zip archive, a
    pickle (protocol 2 to 5) or a legacy tar archive; torch.load would fail on anything
    else with a bare ``KeyError`` or ``UnpicklingError``."""
    from fastckpt.format.other_formats import other_format
    from fastckpt.format.torch_save import SNIFF_BYTES, torch_save_format

    with open(src, "rb") as f:
        head = f.read(SNIFF_BYTES)
    other = other_format(head)
    if other is not None and other.reader != "torch.load":  # NumPy's zip, GGUF, JSON, ...
        read = f" (read it with {other.reader})" if other.reader else ""
        raise CliError(
            f"{src}: {other.description}, not a torch.save or safetensors file{read}; "
            "convert reads torch.save (.pt/.bin) and safetensors files",
            USAGE,
        )
    if torch_save_format(head) is not None:
        return
    raise CliError(
        f"{src}: not a torch.save or safetensors file (it starts with {head[:4]!r}); "
        "convert reads torch.save (.pt/.bin) and safetensors files",
        USAGE,
    )


def _load_torch(src: str, allow_pickle: bool) -> Any:
    import torch

    _check_torch_magic(src)

    if allow_pickle:
        warn(
            f"--allow-pickle: unpickling {src} with weights_only=False runs any code it holds; "
            "use it only on files you trust"
        )
        return torch.load(src, map_location="cpu", weights_only=False)
    try:
        return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CliError(_refusal_message(src, str(exc))) from None
    except Exception as exc:  # noqa: BLE001 - see below
        # torch.load's own errors for damaged files, of many types (some as bare as
        # "KeyError: 101", a fake zip's from safetensors' Rust reader); with weights_only
        # it runs no code of the file's, so every one of them is about the file
        raise CliError(
            f"{src}: not a readable torch or safetensors file ({type(exc).__name__}: {exc})"
        ) from None


def _refusal_message(src: str, torch_message: str) -> str:
    """fastckpt's one line for torch's weights_only refusal (a page of advice with terminal
    escape codes), naming the refused class when torch's message does.

    Example:
        >>> print(_refusal_message("a.pt", "Weights only load failed...\x1b[1mdo\x1b[0m "
        ...     "Unsupported global: GLOBAL mymod.Box was not an allowed global by default."))
        a.pt: holds mymod.Box, an object other than tensors and plain containers, which is not unpickled by default (unpickling runs code from the file); if you trust the file, pass --allow-pickle
    """
    found = re.search(r"GLOBAL ([\w.]+)", torch_message)
    what = (
        f"holds {found.group(1)}, an object other than tensors and plain containers,"
        if found
        else "holds objects other than tensors and plain containers,"
    )
    return (
        f"{src}: {what} which is not unpickled by default (unpickling runs code from the "
        "file); if you trust the file, pass --allow-pickle"
    )


def _referenced_count(src: str) -> int:
    """How many tensors ``src`` takes from earlier files (0: it is self-contained)."""
    from fastckpt.cli.inspect import read_header
    from fastckpt.format import split_metadata

    refs = split_metadata(read_header(src).metadata).references
    return 0 if refs is None else len(refs.tensors)


def _user_metadata(src: str) -> dict[str, str]:
    from fastckpt.cli.inspect import read_header
    from fastckpt.format import split_metadata

    return split_metadata(read_header(src).metadata).user


def _own_storages(obj: Any) -> Any:
    """Gives every tensor of ``obj`` its own storage, in place; tensors that shared memory
    (tied weights) keep sharing their copy.

    ``fastckpt.load`` returns views into one buffer, and ``torch.save`` refuses views of one
    storage with different dtypes.
    """
    import torch

    copies: dict[tuple[Any, ...], Any] = {}

    def own(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.dtype, tuple(value.shape), tuple(value.stride()))
            if key not in copies:
                copy = value.detach().clone()
                if isinstance(value, torch.nn.Parameter):
                    copy = torch.nn.Parameter(copy, requires_grad=value.requires_grad)
                else:
                    copy.requires_grad_(value.requires_grad)
                copies[key] = copy
            return copies[key]
        if isinstance(value, dict):
            for k in list(value):
                value[k] = own(value[k])
            return value
        if isinstance(value, list):
            value[:] = [own(v) for v in value]
            return value
        if type(value) is tuple:
            return tuple(own(v) for v in value)
        return value

    return own(obj)


def _modules_as_state_dicts(obj: Any, where: str = "") -> tuple[Any, list[str]]:
    """``obj`` with each ``torch.nn.Module`` in it (whole models that ``torch.save`` pickled)
    replaced by its state dict, and where each was (``"the top level"``, ``['model']``):
    stored as a pickle, a module would keep no tensor in the fastckpt layout.

    Example:
        >>> import torch
        >>> new, where = _modules_as_state_dicts({"model": torch.nn.Linear(2, 1), "epoch": 3})
        >>> sorted(new["model"]), new["epoch"], where
        (['bias', 'weight'], 3, ["['model'] (Linear)"])
    """
    import torch

    if isinstance(obj, torch.nn.Module):
        return obj.state_dict(), [f"{where or 'the top level'} ({type(obj).__name__})"]
    found: list[str] = []
    if isinstance(obj, dict):
        for key in list(obj):
            obj[key], inner = _modules_as_state_dicts(obj[key], f"{where}[{key!r}]")
            found += inner
    elif isinstance(obj, (list, tuple)):
        items = []
        for i, value in enumerate(obj):
            value, inner = _modules_as_state_dicts(value, f"{where}[{i}]")
            items.append(value)
            found += inner
        obj = items if isinstance(obj, list) else type(obj)(items)
    return obj, found


def _new_temporary(dst: str) -> tuple[int, str]:
    """A new ``<dst>.<12 hex>.tmp`` beside ``dst`` (the name fastckpt's clean-up knows),
    created with mode 0o666 less the umask, as every file fastckpt writes."""
    while True:
        tmp = f"{dst}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue


def _torch_save_atomic(obj: Any, dst: str) -> None:
    import torch

    directory = os.path.dirname(os.path.abspath(dst))
    fd, tmp = _new_temporary(os.path.join(directory, os.path.basename(dst)))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _check_source(src: str) -> None:
    from fastckpt.integrations.remote import is_url

    if not is_url(src) and not os.path.isfile(src):
        raise CliError(
            f"no such file: {src}" if not os.path.exists(src) else f"not a file: {src}", USAGE
        )


def destination_file(dst: str) -> str:
    """The file that ``convert`` writes for ``dst``: ``dst/model.safetensors`` when ``dst``
    is a directory (an existing one, or a name ending with ``/``), as ``fastckpt.save``
    writes; ``dst`` itself otherwise.

    Example:
        >>> destination_file("out/"), destination_file("out.safetensors")
        ('out/model.safetensors', 'out.safetensors')
    """
    from fastckpt.api import weights_file

    return weights_file(dst, for_save=True) or dst


def _make_directory_of(dst: str) -> None:
    """Creates the directory that a DST written as a directory names (``out/``)."""
    from fastckpt.integrations.remote import is_url

    if not is_url(dst):
        os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)


def _check_destination(
    src: str, dst: str, force: bool, in_place: bool = False, *, creates_directory: bool = False
) -> None:
    from fastckpt.integrations.remote import is_url, url_to_fs

    if is_url(dst):
        if Path(dst).suffix.lower() in TORCH_SUFFIXES:
            raise CliError(f"DST {dst}: torch files are written to local paths only", USAGE)
        if src == dst:
            raise CliError("SRC and DST are the same file", USAGE)
        fs, path = url_to_fs(dst)
        if not force and fs.exists(path):
            raise CliError(f"{dst} exists; pass --force to overwrite it", USAGE)
        return
    if os.path.isdir(dst):
        raise CliError(f"DST {dst} is a directory; name the file to write", USAGE)
    if os.path.exists(dst):
        if not is_url(src) and os.path.samefile(src, dst):
            if in_place:
                return  # --materialize rewrites SRC itself
            raise CliError("SRC and DST are the same file", USAGE)
        if not force:
            raise CliError(f"{dst} exists; pass --force to overwrite it", USAGE)
    if not creates_directory and not os.path.isdir(os.path.dirname(os.path.abspath(dst))):
        raise CliError(f"the directory of {dst} does not exist", USAGE)


def _url_kind(src: str) -> str:
    """A source at a URL must be a safetensors file (torch files: download them first)."""
    from fastckpt.cli.inspect import read_header
    from fastckpt.errors import HeaderError

    try:
        read_header(src)
    except HeaderError as exc:
        raise CliError(f"{src}: only safetensors files are read from URLs ({exc})", USAGE) from None
    return "safetensors"


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt convert``; 1 when the source is damaged or refused, 2 on usage and
    input errors (DST exists without ``--force``, no such SRC)."""
    with trusted_unpickling(args.allow_pickle, args.src):
        return _convert(args)


def _convert(args: argparse.Namespace) -> int:
    from fastckpt import api
    from fastckpt.integrations.remote import is_url

    src = args.src
    if _convert_dcp(args):
        return 0
    _check_source(src)
    materialize = getattr(args, "materialize", False)
    dst = destination_file(args.dst)
    into_directory = dst != args.dst  # DST named a directory: DST/model.safetensors
    _check_destination(src, dst, args.force, in_place=materialize, creates_directory=into_directory)
    started = time.perf_counter()
    kind = _url_kind(src) if is_url(src) else source_kind(src)
    metadata: dict[str, str] = {}
    if materialize and kind != "safetensors":
        raise CliError(f"--materialize: {src} is not a fastckpt/safetensors file", USAGE)
    if kind == "torch":
        obj = _load_torch(src, args.allow_pickle)
        if Path(dst).suffix.lower() not in TORCH_SUFFIXES:
            obj, modules = _modules_as_state_dicts(obj)
            if modules:
                warn(
                    f"{src} holds whole modules, pickled with their code; their state dicts "
                    f"are written (at {', '.join(modules)}): restore with "
                    "model.load_state_dict(...)"
                )
                kind = "torch, modules as state dicts"
    else:
        metadata = _user_metadata(src)
        from_bases = _referenced_count(src)
        if from_bases:
            kind = f"incremental, {from_bases} tensor{'' if from_bases == 1 else 's'} from earlier files"
        if args.allow_pickle:
            warn(
                f"--allow-pickle: objects pickled in {src} are unpickled, which runs any code "
                "they hold; use it only on files you trust"
            )
        try:
            obj = api.load(src, weights_only=not args.allow_pickle)
        except pickle.UnpicklingError as exc:
            raise CliError(f"{exc}; if you trust the file, pass --allow-pickle") from None

    to_torch = Path(dst).suffix.lower() in TORCH_SUFFIXES
    if to_torch:
        dropped = sorted(k for k in metadata if k != "format")
        if dropped:
            warn(f"torch files have no place for metadata; not kept: {', '.join(dropped)}")
        _torch_save_atomic(_own_storages(obj) if kind == "safetensors" else obj, dst)
        written = f"torch file, {format_bytes(os.path.getsize(dst))}"
    else:
        try:
            # the directory itself when DST named one: save refuses to write over another
            # tool's checkpoint there, and retires its own older shards
            target = args.dst if into_directory else dst
            api.save(obj, target, metadata=metadata or None, allow_pickle=args.allow_pickle)
        except TypeError as exc:
            hint = "" if args.allow_pickle else "; --allow-pickle keeps such objects (pickled)"
            raise CliError(
                f"{src}: cannot store this object in the fastckpt layout: {exc}{hint}"
            ) from None
        from fastckpt.cli.inspect import describe_file

        info = describe_file(dst)
        written = (
            f"fastckpt layout, {info['tensor_count']} "
            f"tensor{'' if info['tensor_count'] == 1 else 's'}, "
            f"{format_bytes(info['total_bytes'])}, checksums {'on' if info['checksums'] else 'off'}"
        )
    seconds = time.perf_counter() - started
    print(f"Converted {src} ({kind}) -> {dst} ({written}) in {seconds:.1f} s")
    return 0


def _convert_dcp(args: argparse.Namespace) -> bool:
    """Consolidates a DCP directory SRC into DST, or writes DST as one with ``--to-dcp``;
    False when neither applies (an ordinary file conversion)."""
    from fastckpt.integrations import dcp
    from fastckpt.integrations.remote import is_url, url_to_fs

    src, dst = args.src, args.dst
    to_dcp = getattr(args, "to_dcp", False)
    if not to_dcp and not dcp.is_dcp_checkpoint(src):
        return False
    if not to_dcp:
        dst = destination_file(dst)  # DST/model.safetensors for a directory
    if is_url(dst):
        fs, inner = url_to_fs(dst)
        exists = fs.exists(inner)
    else:
        exists = os.path.exists(dst)
    if exists and not args.force:
        raise CliError(f"{dst} exists; pass --force to overwrite it", USAGE)
    started = time.perf_counter()
    if to_dcp:
        if not is_url(src) and not os.path.isfile(src):
            raise CliError(f"no such file: {src}", USAGE)
        dcp.to_dcp(src, dst)
        written = "DCP checkpoint"
    else:
        if not is_url(dst) and os.path.isdir(dst):
            raise CliError(f"DST {dst} is a directory; name the file to write", USAGE)
        if args.allow_pickle:
            warn(
                f"--allow-pickle: {src}/.metadata and the checkpoint's non-tensor values are "
                "unpickled without limits, which runs any code they hold"
            )
        if dst != args.dst:
            _make_directory_of(dst)
        dcp.consolidate(src, dst, allow_pickle=args.allow_pickle)
        written = "one file" if is_url(dst) else f"one file, {format_bytes(os.path.getsize(dst))}"
    seconds = time.perf_counter() - started
    print(f"Converted {src} -> {dst} ({written}) in {seconds:.1f} s")
    return True
