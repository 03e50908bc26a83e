"""Hostile trees for a checkpoint series (``torture.py --only hostile-trees``).

Each case builds a root and a fast tier that someone else has written into: markers naming
``../`` or absolute paths, symbolic links as step directories, hard links to step files,
step names in other scripts' digits, markers that do not parse, a ``COMMITTED`` that is a
directory, and, last, a planter racing a live manager. A directory beside the tiers holds
files that must never change (bytes, inode, link count, mode); the steps a manager
committed must still be there and restore unless retention removed them.

Counted as bad: a file outside the tiers changed, created or removed (``escapes``); a
committed step lost other than by retention, or restoring other values (``losses``); a
manager call failing with anything but a clean refusal (``errors``).

Example::

    python benchmarks/torture.py --only hostile-trees --tree-rounds 3
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fastckpt
from fastckpt.series import steps as layout

# Refusals a manager may answer a hostile tree with: a clean error naming what it refused.
_CLEAN_REFUSALS = (ValueError, OSError)


def _snapshot(folder: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``folder`` (links not followed): what a change would show."""
    found: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            data = b""
            if os.path.isfile(path) and not os.path.islink(path):
                data = Path(path).read_bytes()
            found[os.path.relpath(path, folder)] = (st.st_ino, st.st_mode, st.st_nlink, data)
    return found


def _outside(folder: Path) -> Path:
    """A directory beside the tiers that holds what an escape would change: a victim file, a
    fake committed step (for links to point at) and a planted payload target."""
    folder.mkdir(parents=True)
    (folder / "victim.txt").write_bytes(b"precious " * 500)
    fake = folder / "step-000000000001"
    fake.mkdir()
    (fake / layout.STATE_FILE).write_bytes(b"not yours " * 400)
    (fake / layout.MARKER).write_text(
        json.dumps({"step": 1, "layout": "file", "files": {layout.STATE_FILE: 4000}})
    )
    return folder


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(step))}


def _plant_marker(tier: Path, step: int, names: list[str]) -> None:
    """A committed-looking step whose marker names ``names`` (never through a link planted
    earlier: writing into its target would be the planter's own escape)."""
    directory = Path(layout.step_dir(str(tier), step))
    if directory.is_symlink():
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir()  # never into a step that exists: that would be the planter's loss
    (directory / layout.STATE_FILE).write_bytes(b"x" * 4096)
    files = {name: 4096 for name in names}
    (directory / layout.MARKER).write_text(
        json.dumps({"step": step, "layout": "file", "files": files})
    )


# -- the cases: each plants into (root, fast, outside) before or while a manager runs -------


def _escape_relative(root: Path, fast: Path, outside: Path) -> None:
    rel = os.path.relpath(outside / "victim.txt", layout.step_dir(str(fast), 0))
    _plant_marker(fast, 2, [rel, layout.STATE_FILE])


def _escape_absolute(root: Path, fast: Path, outside: Path) -> None:
    _plant_marker(fast, 2, [str(outside / "victim.txt")])


def _escape_root_marker(root: Path, fast: Path, outside: Path) -> None:
    rel = os.path.relpath(outside / "victim.txt", layout.step_dir(str(root), 0))
    _plant_marker(root, 2, [rel])


def _symlinked_steps(root: Path, fast: Path, outside: Path) -> None:
    for tier in (root, fast):
        tier.mkdir(parents=True, exist_ok=True)
        os.symlink(outside / "step-000000000001", layout.step_dir(str(tier), 2))


def _symlinked_marker(root: Path, fast: Path, outside: Path) -> None:
    directory = Path(layout.step_dir(str(root), 2))
    directory.mkdir(parents=True)
    os.symlink(outside / "victim.txt", directory / layout.MARKER)
    os.symlink(outside / "victim.txt", directory / layout.STATE_FILE)


def _other_digits(root: Path, fast: Path, outside: Path) -> None:
    for tier in (root, fast):
        # Devanagari and fullwidth digits: int() reads both as 1, the real step 1; one
        # without a marker looks like a save cut short of that step
        for digits in ("\u0966" * 11 + "\u0967", "\uff10" * 11 + "\uff11"):
            (tier / f"step-{digits}").mkdir(parents=True)
        committed = tier / ("step-" + "\u0966" * 11 + "\u0968")  # and one aliasing step 2
        committed.mkdir()
        (committed / layout.MARKER).write_text("{}")


def _unparseable_markers(root: Path, fast: Path, outside: Path) -> None:
    for step, text in ((2, "{garbage"), (3, "[]"), (4, '{"step": 4, "files": [1]}')):
        directory = Path(layout.step_dir(str(root), step))
        directory.mkdir(parents=True)
        (directory / layout.STATE_FILE).write_bytes(b"y" * 100)
        (directory / layout.MARKER).write_text(text)


def _marker_is_a_directory(root: Path, fast: Path, outside: Path) -> None:
    for tier in (root, fast):
        (Path(layout.step_dir(str(tier), 2)) / layout.MARKER).mkdir(parents=True)


CASES: dict[str, Callable[[Path, Path, Path], None]] = {
    "marker naming ../": _escape_relative,
    "marker naming an absolute path": _escape_absolute,
    "root marker naming ../": _escape_root_marker,
    "symlinked step directories": _symlinked_steps,
    "symlinked marker and state file": _symlinked_marker,
    "step names in other digits": _other_digits,
    "unparseable markers": _unparseable_markers,
    "COMMITTED is a directory": _marker_is_a_directory,
}


def _planted_bytes(root: Path, fast: Path) -> dict[str, bytes]:
    """The planted markers (by path): a marker that cannot be read must stay somewhere."""
    found = {}
    for tier in (root, fast):
        for marker in tier.glob(f"*/{layout.MARKER}"):
            # a linked step directory is not the tier's: its marker lies outside
            if marker.is_file() and not marker.is_symlink() and not marker.parent.is_symlink():
                found[str(marker)] = marker.read_bytes()
    return found


def _markers_kept(root: Path, fast: Path, planted: dict[str, bytes]) -> int:
    """How many planted markers vanished from both tiers (quarantine keeps them)."""
    everywhere = set()
    for tier in (root, fast):
        for dirpath, _, filenames in os.walk(tier):
            for name in filenames:
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):
                    with contextlib.suppress(OSError):
                        everywhere.add(Path(path).read_bytes())
    return sum(1 for data in planted.values() if data not in everywhere)


def _run_manager(
    root: Path, fast: Path, first: int, count: int, keep_last: int, saved: list[int]
) -> dict[str, int]:
    """A manager (fast tier and root) saving ``count`` steps: the outcomes it met; the steps
    it saved are appended to ``saved``. A save refused (a failed drain of a planted step
    surfaces at the next save) is counted, not a loss: that step was never committed. A
    manager that cannot start, or a call failing otherwise, is an error."""
    outcomes: collections.Counter[str] = collections.Counter()
    try:
        manager = fastckpt.CheckpointManager(
            root, fast=fast, keep_last=keep_last, keep_fast=1, best=("loss", "min", 1)
        )
    except Exception as exc:  # noqa: BLE001 - a planted tree must not stop a manager
        return {f"error: start failed ({type(exc).__name__})": 1}
    try:
        for step in range(first, first + count):
            try:
                manager.save(step, _state(step), {"loss": float(step)}).result()
                outcomes["saved"] += 1
                saved.append(step)
            except _CLEAN_REFUSALS as exc:
                outcomes[f"save refused ({type(exc).__name__})"] += 1
            except Exception as exc:  # noqa: BLE001 - counted
                outcomes[f"error: save ({type(exc).__name__})"] += 1
    finally:
        try:
            manager.close()
        except _CLEAN_REFUSALS as exc:  # a drain of a planted step: reported, not hidden
            outcomes[f"close raised ({type(exc).__name__})"] += 1
        except Exception as exc:  # noqa: BLE001 - counted
            outcomes[f"error: close ({type(exc).__name__})"] += 1
    return dict(outcomes)


def _errors(outcomes: dict[str, int]) -> int:
    return sum(n for key, n in outcomes.items() if key.startswith("error"))


def _lost_steps(root: Path, kept: list[int]) -> int:
    """How many of ``kept`` (the steps retention keeps: the best and the newest saved) root
    lacks or restores with other values."""
    lost = 0
    try:
        reader = fastckpt.CheckpointManager(root, keep_last=None)
    except Exception:  # noqa: BLE001 - a series that cannot be opened lost every step
        return len(kept)
    with reader:
        present = set(reader.steps())
        for step in kept:
            if step not in present:
                lost += 1
                continue
            try:
                _, state = reader.restore(step=step)
                lost += not torch.equal(state["w"], _state(step)["w"])
            except Exception:  # noqa: BLE001 - a step that does not restore is lost
                lost += 1
    return lost


def _best_step(root: Path, fast: Path) -> None:
    """Step 1, the best loss of the run: retention (best-k) keeps it, so it must survive."""
    with fastckpt.CheckpointManager(root, fast=fast, keep_last=None) as manager:
        manager.save(1, _state(1), {"loss": 0.0}).result()


def one_case(work: Path, name: str, plant: Callable[[Path, Path, Path], None]) -> dict[str, Any]:
    """Saves step 1, plants ``name`` into the tiers, runs a manager over them (best-k keeps
    step 1) and ``fastckpt clean``; what escaped and what was lost."""
    base = work / name.replace(" ", "-").replace("/", "_")
    root, fast, outside = base / "root", base / "fast", _outside(base / "outside")
    _best_step(root, fast)
    own = _planted_bytes(root, fast)  # the manager's markers: retention may remove them
    plant(root, fast, outside)
    before = _snapshot(outside)
    planted = {p: d for p, d in _planted_bytes(root, fast).items() if p not in own}
    saved: list[int] = []
    outcomes = _run_manager(root, fast, 10, 5, 3, saved)
    from fastckpt.cli import main as cli

    with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
        with contextlib.suppress(Exception):  # what it removed is what counts
            cli(["clean", str(root), "--fast", str(fast)])
    return {
        "outcomes": outcomes,
        "escapes": int(_snapshot(outside) != before),
        "errors": _errors(outcomes),
        "losses": _lost_steps(root, [1, *saved[-3:]]),
        "unreadable markers gone": _markers_kept(root, fast, planted),
        "saves": len(saved),
    }


def _race_planter(root: Path, fast: Path, outside: Path, stop: threading.Event, seed: int) -> int:
    """Plants hostile entries into both tiers while a manager runs: returns how many."""
    rng = random.Random(seed)
    planted = 0
    while not stop.is_set():
        tier = rng.choice((root, fast))
        step = rng.randrange(2, 60)  # step 1 is the run's best, 100+ its newest
        kind = rng.randrange(4)
        with contextlib.suppress(OSError):
            if kind == 0:
                os.symlink(outside / "step-000000000001", layout.step_dir(str(tier), step))
            elif kind == 1:
                _plant_marker(tier, step, [str(outside / "victim.txt")])
            elif kind == 2:  # a hard link kept to a committed step's file (the manager's: 100+)
                for state in sorted(fast.glob(f"step-0000000001*/{layout.STATE_FILE}")):
                    if (state.parent / layout.MARKER).exists():
                        os.link(state, outside / f"kept-{planted}")
                        break
            else:
                rel = os.path.relpath(outside / "victim.txt", layout.step_dir(str(tier), 0))
                _plant_marker(tier, step, [rel])
            planted += 1
        time.sleep(0.002)
    return planted


def race(work: Path, seed: int, steps: int = 40) -> dict[str, Any]:
    """A planter thread against a live manager saving ``steps`` steps (fast tier + root)."""
    base = work / "race"
    root, fast, outside = base / "root", base / "fast", _outside(base / "outside")
    _best_step(root, fast)
    stop = threading.Event()
    count: list[int] = []
    saved: list[int] = []
    # hard links to step files are expected under outside/: they are its own new files,
    # whose bytes must never change once made (a spare reused under them would)
    before = _snapshot(outside)
    planter = threading.Thread(
        target=lambda: count.append(_race_planter(root, fast, outside, stop, seed))
    )
    planter.start()
    try:
        outcomes = _run_manager(root, fast, 100, steps, 5, saved)
    finally:
        stop.set()
        planter.join()
    links = {p: p.read_bytes() for p in outside.glob("kept-*")}
    after = {k: v for k, v in _snapshot(outside).items() if not k.startswith("kept-")}
    values_ok = all(  # a kept link holds one whole step's file, as it was when linked
        fastckpt.load(p)["w"].unique().numel() == 1 for p in links if len(links[p]) > 0
    )
    return {
        "outcomes": outcomes,
        "entries planted": count[0] if count else 0,
        "errors": _errors(outcomes),
        "hard links kept to step files": len(links),
        "escapes": int(after != before) + int(not values_ok),
        "losses": _lost_steps(root, [1, *saved[-5:]]),
        "saves": len(saved),
    }


def hostile_trees(work: Path, rounds: int, seed: int) -> dict[str, Any]:
    """Every case ``rounds`` times, then the race: totals and per-case outcomes."""
    # the manager logs each marker it refuses at every retention pass (hundreds in the
    # race): what matters is counted here instead
    logging.disable(logging.ERROR)
    try:
        return _hostile_trees(work, rounds, seed)
    finally:
        logging.disable(logging.NOTSET)


def _hostile_trees(work: Path, rounds: int, seed: int) -> dict[str, Any]:
    report: dict[str, Any] = {"cases": {}}
    escapes = losses = markers = cases = errors = 0
    for r in range(rounds):
        for name, plant in CASES.items():
            result = one_case(work / f"round-{r}", name, plant)
            cases += 1
            escapes += result["escapes"]
            losses += result["losses"]
            markers += result["unreadable markers gone"]
            errors += result["errors"]
            _add(report["cases"].setdefault(name, {}), result)
        shutil.rmtree(work / f"round-{r}", ignore_errors=True)
        raced = race(work / f"race-{r}", seed + r)
        cases += 1
        escapes += raced["escapes"]
        losses += raced["losses"]
        errors += raced["errors"]
        _add(report.setdefault("race", {}), raced)
        shutil.rmtree(work / f"race-{r}", ignore_errors=True)
    report.update(
        {
            "hostile cases": cases,
            "escapes outside the tiers": escapes,
            "committed steps lost": losses,
            "unreadable markers deleted": markers,
            "manager errors": errors,
        }
    )
    return report


def _add(total: dict[str, Any], result: dict[str, Any]) -> None:
    """Adds ``result``'s counts (nested: outcomes) into ``total``, round after round."""
    for key, value in result.items():
        if isinstance(value, dict):
            _add(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value


def bad_outcomes(report: dict[str, Any]) -> int:
    """What counts against the series in ``report``."""
    return (
        report["escapes outside the tiers"]
        + report["committed steps lost"]
        + report["unreadable markers deleted"]
        + report["manager errors"]
    )
