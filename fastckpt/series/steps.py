"""The layout of a checkpoint series in one directory or URL prefix (a tier).

Each step is a directory ``step-<12 digits>`` holding the checkpoint (``state.safetensors``,
or a DCP checkpoint's rank files and ``.metadata`` for a multi-rank run) and, written last,
the commit marker ``COMMITTED`` (JSON: the step, its layout, each file's size, the metrics,
the time).
A step without its marker does not exist: it is a save that did not finish (or a deletion
that did), removed by the next manager. Deleting a step removes its marker first, so a crash
mid-deletion leaves a step that no longer exists, never a partial one that does.

A tier is a local directory or an fsspec URL (``s3://bucket/run``, ``memory://run``; a
``file://`` URL is a local directory), given as a string or as a :class:`Tier` carrying the
URL's ``storage_options``. Locally the marker is written atomically and durably (temporary
file, fsync, rename, directory fsync); at a URL it is one object written after every file of
the step is complete (on S3 an object is visible only once its upload completes), so the
same rule holds: listed steps without a marker are ignored.

Example:
    >>> import tempfile, os
    >>> tier = tempfile.mkdtemp()
    >>> os.makedirs(step_dir(tier, 7))
    >>> committed_steps(tier), uncommitted_dirs(tier) == [step_dir(tier, 7)]
    ([], True)
    >>> url = Tier("memory://doc-steps/run")
    >>> storage.write_whole(join(step_dir(url, 3), STATE_FILE), b"x")
    >>> committed_steps(url), uncommitted_steps(url)
    ([], [3])
    >>> commit(url, 3, {"loss": 0.5}); committed_steps(url), marker_of(url, 3)["files"]
    ([3], {'state.safetensors': 1})
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Mapping
from typing import Any

from fastckpt import storage
from fastckpt.io import spare_files
from fastckpt.io.commit import fsync_directory, write_atomically
from fastckpt.storage import join
from fastckpt.storage.url import url_errors

_log = logging.getLogger("fastckpt")

__all__ = [
    "FILE_LAYOUT",
    "MARKER",
    "SET_ASIDE",
    "SPARE_FILE",
    "STATE_FILE",
    "Tier",
    "abort_unfinished_uploads",
    "check_file_name",
    "commit",
    "committed_steps",
    "files_problem",
    "join",
    "marker_of",
    "quarantine_step",
    "remove_step",
    "set_aside",
    "set_aside_dirs",
    "step_dir",
    "step_files",
    "uncommitted_dirs",
    "uncommitted_steps",
]

MARKER = "COMMITTED"
#: The layout of a step holding one ``state.safetensors`` (markers without one mean it).
FILE_LAYOUT = "file"
STATE_FILE = "state.safetensors"
#: A local fast tier's spare file: a deleted step's state file kept for the next save to
#: write over (:mod:`fastckpt.io.spare_files`); never a step, removed when its manager closes.
SPARE_FILE = ".spare.safetensors"
# ASCII digits only: ``\d`` also takes other scripts' digits, and a directory named with
# them would alias a real step (``int`` reads them as the same number).
_STEP = re.compile(r"step-([0-9]{12})", re.ASCII)


@dataclasses.dataclass(frozen=True)
class Tier:
    """Where a tier lives: a local directory (absolute) or an fsspec URL, with the URL's
    ``storage_options`` (None: ``FASTCKPT_STORAGE_OPTIONS``).

    Example:
        >>> Tier("file:///tmp/run").location, Tier("s3://b/run/").is_url
        ('/tmp/run', True)
    """

    location: str
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        local = storage.to_local(self.location)
        if local is not None:
            object.__setattr__(self, "location", os.path.abspath(local))
        else:
            object.__setattr__(self, "location", self.location.rstrip("/"))

    @property
    def is_url(self) -> bool:
        """Whether the tier is at an fsspec URL (not a local directory)."""
        return storage.is_url(self.location)

    def fs(self) -> tuple[Any, str]:
        """``(file system, path)`` of a URL tier, its listings not cached (another process
        may have written since)."""
        with url_errors(self.location, "resolving the URL"):
            fs, path = storage.url_to_fs(self.location, self.storage_options)
        fs.invalidate_cache(path)
        return fs, path.rstrip("/")

    def __str__(self) -> str:
        return self.location


def _tier(tier: Tier | str | os.PathLike[str]) -> Tier:
    return tier if isinstance(tier, Tier) else Tier(os.fspath(tier))


def step_dir(tier: Tier | str, step: int) -> str:
    """The directory (or URL prefix) of ``step`` in ``tier``."""
    return join(_tier(tier).location, f"step-{step:012d}")


def _step_of(name: str) -> int | None:
    match = _STEP.fullmatch(name)
    return int(match.group(1)) if match else None


def _listing(tier: Tier) -> dict[int, dict[str, int]]:
    """Each step directory of ``tier`` and its files (name -> size): for a URL one listing of
    the prefix; locally the step directories (file sizes only for markers' sake)."""
    if not tier.is_url:
        try:
            names = os.listdir(tier.location)
        except FileNotFoundError:
            return {}
        found: dict[int, dict[str, int]] = {}
        for name in names:
            step = _step_of(name)
            if step is not None and _real_directory(os.path.join(tier.location, name)):
                marker = os.path.join(tier.location, name, MARKER)
                # a marker that is there counts, whatever it is: one that cannot be read
                # is reported (and quarantined), never taken for a save cut short
                found[step] = {MARKER: 0} if os.path.lexists(marker) else {}
        return found
    fs, path = tier.fs()
    with url_errors(tier.location, "listing"):
        try:
            files = fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
    found = {}
    for name, info in files.items():
        parts = name.rstrip("/")[len(path) :].strip("/").split("/")
        step = _step_of(parts[0]) if len(parts) >= 2 else None
        if step is not None:
            found.setdefault(step, {})["/".join(parts[1:])] = int(info.get("size") or 0)
    return found


def _real_directory(path: str) -> bool:
    """Whether ``path`` is a directory itself, not a symbolic link to one: a link in a tier
    is not fastckpt's, and is never followed (for deletion above all)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def check_file_name(name: Any, where: str) -> str:
    """``name`` (read from a marker or a listing) as a plain relative path inside its step:
    no absolute path, no ``..`` or empty part, no backslash or NUL. A marker is data that
    anyone who can write the tier can plant; what it names is opened, copied and deleted.

    Raises:
        ValueError: naming ``where`` (the marker) and the name.

    Example:
        >>> check_file_name("state.safetensors", "m")
        'state.safetensors'
        >>> check_file_name("../../etc/passwd", "step 3's marker")
        Traceback (most recent call last):
        ...
        ValueError: step 3's marker: file name '../../etc/passwd' is not a plain name inside its step
    """
    parts = name.split("/") if isinstance(name, str) else []
    if (
        not parts
        or name.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or "\\" in name
        or "\0" in name
    ):
        raise ValueError(f"{where}: file name {name!r} is not a plain name inside its step")
    return name


def committed_steps(tier: Tier | str) -> list[int]:
    """The steps of ``tier`` with a commit marker, ascending."""
    return sorted(s for s, files in _listing(_tier(tier)).items() if MARKER in files)


def uncommitted_steps(tier: Tier | str) -> list[int]:
    """The steps of ``tier`` with files but no marker: saves or deletions cut short."""
    return sorted(s for s, files in _listing(_tier(tier)).items() if MARKER not in files)


def uncommitted_dirs(tier: Tier | str) -> list[str]:
    """The directories (URL prefixes) of :func:`uncommitted_steps`."""
    return [step_dir(tier, s) for s in uncommitted_steps(tier)]


def step_files(tier: Tier | str, step: int) -> dict[str, int]:
    """The files of ``step`` in ``tier`` (name -> size), marker and temporary files left out."""
    tier = _tier(tier)
    directory = step_dir(tier, step)
    if tier.is_url:
        fs, path = tier.fs()
        base = f"{path}/{os.path.basename(directory)}"
        with url_errors(directory, "listing"):
            files = fs.find(base, detail=True)
        found = {n[len(base) :].strip("/"): int(i.get("size") or 0) for n, i in files.items()}
    else:
        found = {}
        for folder, _, names in os.walk(directory):
            for name in names:
                full = os.path.join(folder, name)
                found[os.path.relpath(full, directory)] = os.path.getsize(full)
    return {n: s for n, s in sorted(found.items()) if n != MARKER and not n.endswith(".tmp")}


def commit(
    tier: Tier | str,
    step: int,
    metrics: Mapping[str, float] | None,
    layout: str = FILE_LAYOUT,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Writes ``step``'s marker once its files are durable: the step exists from now on.
    ``layout`` says what the files are: ``"file"`` (``state.safetensors``) or ``"dcp"`` (a
    DCP checkpoint of several ranks); ``extra`` adds fields (an incremental step's ``base``,
    ``depends_on`` and ``since_full``)."""
    tier = _tier(tier)
    document = {
        "step": step,
        "layout": layout,
        "files": step_files(tier, step),
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(extra or {}),
    }
    marker = join(step_dir(tier, step), MARKER)
    data = json.dumps(document).encode()
    if tier.is_url:
        storage.write_whole(marker, data, tier.storage_options)  # one object, whole or absent
        return
    directory = step_dir(tier, step)
    if not _real_directory(directory):  # never a marker into a link's target
        raise FileExistsError(
            errno.EEXIST,
            f"{directory} in tier {tier} is not a step directory fastckpt made: not committed",
            directory,
        )
    write_atomically(marker, data)
    fsync_directory(tier.location)


def marker_of(tier: Tier | str, step: int) -> dict[str, Any]:
    """The marker of a committed step (its files, metrics and time)."""
    tier = _tier(tier)
    marker = join(step_dir(tier, step), MARKER)
    if not tier.is_url and not stat.S_ISREG(os.lstat(marker).st_mode):
        raise ValueError(f"{marker}: the commit marker of step {step} is not a regular file")
    try:
        document = json.loads(storage.read_whole(marker, tier.storage_options))
    except (UnicodeDecodeError, RecursionError, json.JSONDecodeError) as exc:
        raise ValueError(f"{marker}: not the marker of step {step}: {exc}") from None
    if not isinstance(document, dict) or document.get("step") != step:
        raise ValueError(f"{marker}: not the marker of step {step}")
    files = document.get("files", {})
    if not isinstance(files, dict):
        raise ValueError(f"{marker}: its files are not a mapping of names to sizes")
    for name in files:
        check_file_name(name, marker)
    return document


def remove_step(tier: Tier | str, step: int, *, spare: str | None = None) -> None:
    """Deletes a step: its marker first (durably), then its files. With ``spare`` (a local
    tier), its state file may be kept as that spare file for the next save to write over
    (:func:`fastckpt.io.spare_files.retire`)."""
    tier = _tier(tier)
    directory = step_dir(tier, step)
    if tier.is_url:
        fs, path = tier.fs()
        base = f"{path}/{os.path.basename(directory)}"
        with contextlib.suppress(FileNotFoundError), url_errors(directory, "delete"):
            fs.rm(f"{base}/{MARKER}")
        with contextlib.suppress(FileNotFoundError), url_errors(directory, "delete"):
            fs.rm(base, recursive=True)
        fs.invalidate_cache(path)
        return
    if os.path.lexists(directory) and not _real_directory(directory):
        # another tool's link or file where the step goes: moved out of the way as it is
        # (a link renamed is never followed), never removed, and the run goes on
        moved = _rename_aside(tier, directory, "foreign")
        _log.warning(
            "%s in tier %s is not a step directory fastckpt made (a symbolic link or a file): "
            "not followed, not removed; moved aside as %s",
            directory,
            tier,
            moved,
        )
        return
    try:
        os.unlink(os.path.join(directory, MARKER))
        fsync_directory(directory)
    except FileNotFoundError:
        pass
    except IsADirectoryError:  # a directory named like a marker is no marker of ours
        pass
    if spare is not None:  # the step no longer exists: its file's storage may be reused
        with contextlib.suppress(OSError):
            spare_files.retire(os.path.join(directory, STATE_FILE), spare)
    shutil.rmtree(directory, ignore_errors=True)


def quarantine_step(tier: Tier | str, step: int) -> str:
    """Moves a damaged step out of the series, so that its step number can be saved again:
    its marker is removed first (durably; the step no longer exists from then on), then its
    directory is renamed ``step-<12 digits>.damaged-<UTC time>`` beside the steps (at a URL
    its objects are moved, copied then deleted, under that prefix). Returns the new location.
    A name that is not ``step-<12 digits>`` is no step: listings never show it, and nothing
    here deletes it (a person may look at it, then remove it). A crash after the marker went
    leaves an uncommitted step, which the next manager removes.

    Example:
        >>> import tempfile, os
        >>> tier = tempfile.mkdtemp()
        >>> os.makedirs(step_dir(tier, 4)); commit(tier, 4, None)
        >>> moved = quarantine_step(tier, 4)
        >>> committed_steps(tier), os.path.basename(moved).startswith("step-000000000004.damaged-")
        ([], True)
    """
    tier = _tier(tier)
    directory = step_dir(tier, step)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if tier.is_url:
        fs, path = tier.fs()
        base = f"{path}/{os.path.basename(directory)}"
        target = f"{base}.damaged-{stamp}"
        with contextlib.suppress(FileNotFoundError), url_errors(directory, "delete"):
            fs.rm(f"{base}/{MARKER}")
        fs.invalidate_cache(path)
        with url_errors(directory, "quarantine"):
            for name in sorted(fs.find(base)):
                fs.mv(name, target + name[len(base) :])
        fs.invalidate_cache(path)
        return join(tier.location, os.path.basename(target))
    os.unlink(os.path.join(directory, MARKER))
    fsync_directory(directory)
    target, attempt = f"{directory}.damaged-{stamp}", 1
    while os.path.exists(target):  # quarantined twice within a second
        attempt += 1
        target = f"{directory}.damaged-{stamp}-{attempt}"
    os.rename(directory, target)
    fsync_directory(tier.location)
    return target


#: Why a step was set aside: the suffix its directory takes (``step-<12 digits>.<why>-<time>``).
SET_ASIDE = ("unreadable", "damaged", "abandoned", "foreign")
_SET_ASIDE = re.compile(
    r"step-([0-9]{12})\.(unreadable|damaged|abandoned|foreign)-([0-9A-Za-z-]+)", re.ASCII
)


def set_aside(tier: Tier | str, step: int, why: str = "unreadable") -> str:
    """Moves a step out of the series, marker and all, without deleting anything: a local
    step's directory is renamed ``step-<12 digits>.<why>-<UTC time>`` (one atomic rename);
    at a URL the marker object is moved first (copied, then deleted: the step leaves the
    series at once), then the step's other objects, each within the tier. ``why`` is
    ``"unreadable"`` (its marker cannot be read) or ``"damaged"`` (its files are missing or
    fail verification). Such a step, planted or damaged, would otherwise count as the newest
    step (refusing every save) and keep every older step through retention; a person can
    look at it, or move it back. Returns the new location.

    Example:
        >>> import tempfile, os
        >>> tier = tempfile.mkdtemp()
        >>> os.makedirs(step_dir(tier, 8))
        >>> with open(os.path.join(step_dir(tier, 8), MARKER), "w") as f:
        ...     _ = f.write("{not json")
        >>> moved = set_aside(tier, 8)
        >>> committed_steps(tier), sorted(os.listdir(moved))
        ([], ['COMMITTED'])
        >>> url = Tier("memory://doc-set-aside/run")
        >>> storage.write_whole(join(step_dir(url, 9), MARKER), b"{}")
        >>> moved = set_aside(url, 9, "damaged")
        >>> committed_steps(url), [s for s, _, _ in set_aside_dirs(url)]
        ([], [9])
    """
    if why not in SET_ASIDE[:2]:
        raise ValueError(f"why must be 'unreadable' or 'damaged', got {why!r}")
    tier = _tier(tier)
    directory = step_dir(tier, step)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if tier.is_url:
        return _set_aside_url(tier, directory, f"{why}-{stamp}")
    return _rename_aside(tier, directory, why)


def _rename_aside(tier: Tier, directory: str, why: str) -> str:
    """Renames a local step's ``directory`` (or whatever stands at its name: a link is
    renamed itself) to ``<name>.<why>-<UTC time>``, durably; the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, attempt = f"{directory}.{why}-{stamp}", 1
    while os.path.lexists(target):  # set aside twice within a second
        attempt += 1
        target = f"{directory}.{why}-{stamp}-{attempt}"
    os.rename(directory, target)
    fsync_directory(tier.location)
    return target


def _set_aside_url(tier: Tier, directory: str, suffix: str) -> str:
    """:func:`set_aside` at a URL: the marker object moved first, then the rest."""
    fs, path = tier.fs()
    base = f"{path}/{os.path.basename(directory)}"
    target, attempt = f"{base}.{suffix}", 1
    with url_errors(directory, "setting aside"):
        while fs.exists(f"{target}/{MARKER}"):  # set aside twice within a second
            attempt += 1
            target = f"{base}.{suffix}-{attempt}"
        fs.mv(f"{base}/{MARKER}", f"{target}/{MARKER}")
        fs.invalidate_cache(path)
        for name in sorted(fs.find(base)):
            fs.mv(name, target + name[len(base) :])
    fs.invalidate_cache(path)
    return join(tier.location, os.path.basename(target))


def set_aside_dirs(tier: Tier | str) -> list[tuple[int, str, str]]:
    """The steps set aside in ``tier`` (:func:`set_aside`, :func:`quarantine_step`, and
    those a restore of replicated steps abandoned), as ``(step, why, location)`` sorted:
    no longer steps of the series, but kept for a person to look at.

    Example:
        >>> import tempfile, os
        >>> tier = tempfile.mkdtemp()
        >>> os.makedirs(step_dir(tier, 2) + ".damaged-20260101T000000Z")
        >>> [(s, why) for s, why, _ in set_aside_dirs(tier)]
        [(2, 'damaged')]
    """
    tier = _tier(tier)
    names: set[str] = set()
    if tier.is_url:
        fs, path = tier.fs()
        with url_errors(tier.location, "listing"):
            try:
                found = fs.find(path)
            except FileNotFoundError:
                found = []
        names = {n.rstrip("/")[len(path) :].strip("/").split("/")[0] for n in found}
    else:
        try:
            listed = os.listdir(tier.location)
        except FileNotFoundError:
            listed = []
        names = {n for n in listed if _real_directory(os.path.join(tier.location, n))}
    aside = []
    for name in names:
        match = _SET_ASIDE.fullmatch(name)
        if match is not None:
            aside.append((int(match.group(1)), match.group(2), join(tier.location, name)))
    return sorted(aside)


def files_problem(tier: Tier | str, step: int, marker: Mapping[str, Any]) -> str | None:
    """What is wrong with the files of committed ``step`` against its ``marker``'s record
    (a file missing, or of another size), or None when each is there at its size. A marker
    planted beside no files (or another run's) is caught here without reading any data.

    Example:
        >>> import tempfile, os
        >>> tier = tempfile.mkdtemp()
        >>> os.makedirs(step_dir(tier, 3))
        >>> files_problem(tier, 3, {"files": {"state.safetensors": 10}})
        'state.safetensors is missing'
        >>> files_problem(tier, 3, {"step": 3})
        'its marker records no files'
    """
    recorded = dict(marker.get("files", {}))
    if not recorded:  # every commit records its files: a step of nothing restores nothing
        return "its marker records no files"
    present = step_files(tier, step)
    for name, size in sorted(recorded.items()):
        if name not in present:
            return f"{name} is missing"
        if present[name] != size:
            return f"{name} holds {present[name]} bytes, its marker says {size}"
    return None


def abort_unfinished_uploads(tier: Tier | str) -> int:
    """Aborts the S3 multipart uploads under the step prefixes of ``tier`` that a killed
    writer left (invisible, but billed until aborted); returns how many. Other tiers have
    none. Call it only while no save to the tier runs (the manager holds the tier's lease).
    """
    tier = _tier(tier)
    if not tier.is_url:
        return 0
    fs, path = tier.fs()
    if not hasattr(fs, "call_s3"):
        return 0
    bucket, prefix, _ = fs.split_path(path)
    prefix = f"{prefix}/step-" if prefix else "step-"
    with url_errors(tier.location, "listing unfinished uploads"):
        listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    aborted = 0
    for upload in listed.get("Uploads", []):
        with url_errors(tier.location, "aborting an unfinished upload"):
            fs.call_s3(
                "abort_multipart_upload",
                Bucket=bucket,
                Key=upload["Key"],
                UploadId=upload["UploadId"],
            )
        aborted += 1
    return aborted
