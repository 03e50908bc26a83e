"""The command line against hostile input: markers of unexpected shapes, files that lie about
their contents, steps removed while they are checked, and a sweep of malformed files, markers
and trees through every verb that reads them. Each is answered with one line and exit 1 or 2,
never a traceback; ``--json`` stays JSON; ``verify`` never says OK for what load refuses."""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.cli import main
from fastckpt.series import steps

# ----------------------------------------------------------------------------- helpers


def run_main(capsys, *args) -> tuple[int, str, str]:
    """Runs the CLI in this process; (exit status, stdout, stderr)."""
    status = main([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


def _series(root, count: int = 3) -> None:
    """A series of ``count`` committed steps (1, 2, ...) with a loss each."""
    from fastckpt.series.manager import CheckpointManager

    with CheckpointManager(root, keep_last=None) as manager:
        for step in range(1, count + 1):
            manager.save(step, {"w": torch.full((4,), float(step))}, metrics={"loss": 1.0 / step})


def _write_marker(root, step: int, content: bytes | str) -> None:
    """Writes ``content`` as ``step``'s commit marker (creating the step directory)."""
    directory = steps.step_dir(str(root), step)
    os.makedirs(directory, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    with open(os.path.join(directory, steps.MARKER), "wb") as f:
        f.write(data)


def _marker(step: int, **fields) -> str:
    document = {"step": step, "layout": "file", "files": {"state.safetensors": 16}}
    document.update(fields)
    return json.dumps(document)


def _tree_listing(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(folder, name), root)
        for folder, dirs, names in os.walk(root)
        for name in dirs + names
    )


# ----------------------------------------------------------------- markers of odd shapes

#: Well-formed JSON (or not) that no manager writes: each must be reported, naming the step.
ODD_MARKERS = {
    "files as a list": _marker(9, files=["state.safetensors"]),
    "a file outside the step": _marker(9, files={"../../elsewhere/payload.txt": 16}),
    "an absolute file": _marker(9, files={"/etc/passwd": 16}),
    "size a string": _marker(9, files={"state.safetensors": "16"}),
    "size a float": _marker(9, files={"state.safetensors": 16.5}),
    "size negative": _marker(9, files={"state.safetensors": -1}),
    "size beyond u64": _marker(9, files={"state.safetensors": 10**30}),
    "metrics a list": _marker(9, metrics=[0.5]),
    "metric a string": _marker(9, metrics={"loss": "low"}),
    "metric a bool": _marker(9, metrics={"loss": True}),
    "metric beyond float": _marker(9, metrics={"loss": 10**400}),
    "layout unknown": _marker(9, layout="../../elsewhere"),
    "depends_on a string": _marker(9, depends_on="1"),
    "time a number": _marker(9, time=5),
    "deep nesting": '{"step": 9, "metrics": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "deep nesting in files": _marker(9, files={"a": json.loads("[" * 50 + "]" * 50)}),
    "a list": "[9]",
    "not json": "{step: 9",
    "empty": "",
    "not utf-8": b"\xff\xfe{\x00",
    "another step's marker": _marker(8),
}


@pytest.mark.parametrize("case", sorted(ODD_MARKERS))
def test_odd_markers_are_named_in_one_line_and_nothing_is_removed(tmp_path, capsys, case):
    root = tmp_path / "run"
    _series(root)
    _write_marker(root, 9, ODD_MARKERS[case])
    before = _tree_listing(root)
    for args in (
        ["ls", root],
        ["ls", root, "--json"],
        ["ls", root, "--verify"],
        ["clean", root],
        ["prune", root, "--keep-last", "1"],
        ["prune", root, "--keep-last", "1", "--best", "loss:min:1"],
    ):
        status, out, err = run_main(capsys, *args)
        assert status == 1, (args, out, err)
        assert "Traceback" not in out + err
        lines = [line for line in err.splitlines() if "step 9" in line]
        assert len(lines) == 1 and "bad commit marker" in lines[0], (args, err)
        assert "\n" not in lines[0] and len(lines[0]) < 400
        if "--json" in args:
            json.loads(out)
    assert _tree_listing(root) == before  # clean and prune removed nothing


def test_odd_markers_in_the_fast_tier_are_named_with_their_tier(tmp_path, capsys):
    root, fast = tmp_path / "run", tmp_path / "fast"
    _series(root, 1)
    fast.mkdir()
    _write_marker(fast, 9, ODD_MARKERS["files as a list"])
    for verb in ("ls", "clean"):
        status, _, err = run_main(capsys, verb, root, "--fast", fast)
        assert status == 1 and "step 9 in fast: bad commit marker" in err, (verb, err)
    assert os.path.exists(os.path.join(steps.step_dir(str(fast), 9), steps.MARKER))


def test_clean_never_reports_a_linked_step_removed_while_it_is_there(tmp_path, capsys):
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    _series(root, 1)
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the series' file")
    os.symlink(elsewhere, steps.step_dir(str(root), 5))  # an uncommitted "step", linked
    status, out, err = run_main(capsys, "clean", root)
    assert (elsewhere / "keep.txt").read_text() == "not the series' file"
    link = steps.step_dir(str(root), 5)
    # a link is no step of the series: left in place, never followed, never said removed
    assert os.path.islink(link)
    assert f"removed {link}" not in out and status in (0, 1), out + err


def test_ls_json_writes_nan_metrics_as_strings(tmp_path, capsys):
    root = tmp_path / "run"
    from fastckpt.series.manager import CheckpointManager

    with CheckpointManager(root, keep_last=None) as manager:
        for step, loss in ((1, float("nan")), (2, float("inf")), (3, 0.25)):
            manager.save(step, {"w": torch.ones(2)}, metrics={"loss": loss})
    status, out, _ = run_main(capsys, "ls", root, "--json")

    def no_constants(token):
        raise AssertionError(f"{token} is not JSON")

    listing = json.loads(out, parse_constant=no_constants)
    assert status == 0
    assert [s["metrics"]["loss"] for s in listing] == ["nan", "inf", 0.25]
    status, out, _ = run_main(capsys, "ls", root)
    assert status == 0 and "loss=nan" in out and "loss=inf" in out


# ------------------------------------------------------- ls --verify beside retention


def test_a_step_removed_while_ls_verifies_it_is_not_damage(tmp_path):
    from fastckpt.cli.ls import REMOVED, verify_copies
    from fastckpt.cli.series_tiers import tier_copies

    root = str(tmp_path / "run")
    _series(root, 2)
    listed = [c for c in tier_copies(root, "root") if c.committed]
    steps.remove_step(root, 1)  # retention, between the listing and the check
    assert verify_copies([listed[0]], {"root": root}) == (REMOVED, [])
    assert verify_copies([listed[1]], {"root": root}) == ("yes", [])


def test_a_step_deleted_after_the_listing_is_no_bad_marker(tmp_path):
    from fastckpt.cli.series_tiers import MarkerError, marker_fields

    root = str(tmp_path / "run")
    _series(root, 1)
    steps.remove_step(root, 1)
    with pytest.raises(MarkerError) as caught:
        marker_fields(root, 1)
    assert caught.value.gone


def test_a_damaged_step_still_there_is_damage(tmp_path):
    from fastckpt.cli.ls import DAMAGED, verify_copies
    from fastckpt.cli.series_tiers import tier_copies

    root = str(tmp_path / "run")
    _series(root, 1)
    state = os.path.join(steps.step_dir(root, 1), steps.STATE_FILE)
    with open(state, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    verdict, why = verify_copies(tier_copies(root, "root"), {"root": root})
    assert verdict == DAMAGED and "root:" in why[0]


@pytest.mark.parametrize("with_fast_tier", [False, True])
def test_ls_verify_beside_a_manager_whose_retention_removes_steps(tmp_path, with_fast_tier):
    """A live manager keeps three steps while ``ls --verify`` runs again and again: a step
    removed under the check (in the fast tier, its file then written over by the next
    save) is never reported as damaged."""
    from fastckpt.cli.ls import list_steps
    from fastckpt.series.manager import CheckpointManager

    root = str(tmp_path / "run")
    fast = str(tmp_path / "fast") if with_fast_tier else None
    stop = threading.Event()
    failures: list[BaseException] = []

    def train() -> None:
        try:
            with CheckpointManager(root, fast=fast, keep_last=3) as manager:
                step = 0
                while not stop.is_set():
                    step += 1
                    manager.save(step, {"w": torch.full((1 << 18,), float(step))}).result()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        verdicts = set()
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and "DAMAGED" not in verdicts:
            for verify in (True, False):
                for entry in list_steps(root, fast, verify=verify):
                    verdicts.add(entry["verified"])
                    assert "problems" not in entry, entry  # a deleted step is no bad marker
    finally:
        stop.set()
        trainer.join()
    assert not failures
    assert "DAMAGED" not in verdicts and "yes" in verdicts, verdicts


# --------------------------------------------------------- verify: every byte read


def _corrupt_frame_and_reseal(path, name: str, at: int) -> None:
    """Damages byte ``at`` of ``name``'s stored frame, then records the damaged bytes'
    CRC32C (and the header's checksum) as if they had been written so: the stored CRC32C
    matches, but the frame does not decode."""
    from fastckpt import _C
    from fastckpt.format import KEY_HEADER_CRC, METADATA_KEY
    from fastckpt.format.schema import canonical_crc

    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    document = json.loads(data[8 : 8 + n])
    begin, end = document[name]["data_offsets"]
    start = 8 + n + begin
    data[start + at] ^= 0xFF
    stored = ctypes.create_string_buffer(bytes(data[start : 8 + n + end]), end - begin)
    meta = document[METADATA_KEY]
    crcs = json.loads(meta["fastckpt.crc32c"])
    crcs[name] = f"{_C.crc32c(ctypes.addressof(stored), end - begin):08x}"
    meta["fastckpt.crc32c"] = json.dumps(crcs, separators=(",", ":"))
    meta.pop(KEY_HEADER_CRC)
    meta[KEY_HEADER_CRC] = canonical_crc(document)
    text = json.dumps(document, separators=(",", ":")).encode()
    data[8 : 8 + n] = text.ljust(n, b" ")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("at", [40, 5000, -3])
def test_verify_decodes_compressed_frames(tmp_path, capsys, at):
    torch.manual_seed(0)
    path = tmp_path / "packed.safetensors"
    fastckpt.save(
        {"w": torch.randn(256, 256).to(torch.bfloat16), "b": torch.ones(3)}, path, compress=True
    )
    with fastckpt.open(path) as reader:
        size = reader.header.entries["w"].nbytes
    _corrupt_frame_and_reseal(path, "w", at % size)
    with pytest.raises((fastckpt.HeaderError, fastckpt.ChecksumError)):
        fastckpt.load(path)
    with fastckpt.open(path) as reader:
        assert reader.verify() == ["w"]
    status, out, err = run_main(capsys, "verify", path)
    assert status == 1 and out.startswith("DAMAGED") and "w" in out, out + err


def test_verify_of_an_intact_compressed_file_is_ok(tmp_path, capsys):
    path = tmp_path / "packed.safetensors"
    fastckpt.save({"w": torch.randn(512, 64).to(torch.bfloat16)}, path, compress=True)
    status, out, _ = run_main(capsys, "verify", path)
    assert status == 0 and out.startswith("OK")


def test_verify_reports_an_incremental_file_whose_base_changed_and_goes_on(tmp_path, capsys):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    base, top = folder / "a_base.safetensors", folder / "b_top.safetensors"
    fastckpt.save({"a": torch.ones(100), "b": torch.zeros(100)}, base)
    fastckpt.save({"a": torch.ones(100), "b": torch.ones(100)}, top, base=base)
    fastckpt.save({"a": torch.full((100,), 2.0), "b": torch.zeros(100)}, base)  # replaced
    fastckpt.save({"w": torch.ones(3)}, folder / "c_other.safetensors")
    status, out, err = run_main(capsys, "verify", folder)
    assert status == 1 and "Traceback" not in out + err
    lines = out.splitlines()
    assert lines[0].startswith("OK") and "a_base" in lines[0]
    assert lines[1].startswith("DAMAGED") and "b_top" in lines[1] and "'a'" in lines[1]
    assert lines[2].startswith("OK") and "c_other" in lines[2]


# ------------------------------------------------------ the CLI imports what it needs


def _imported(*args: str, cwd) -> set[str]:
    """The modules ``python -m fastckpt ARGS`` imported (from ``-X importtime``)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fastckpt", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"),
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    return {
        line.split("|")[-1].strip()
        for line in out.stderr.splitlines()
        if line.startswith("import time:")
    }


def test_commands_on_plain_files_import_no_distributed_checkpoint(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    fastckpt.save({"w": torch.ones(4)}, folder / "a.safetensors")
    root = tmp_path / "run"
    _series(root, 1)
    for args in (
        ["verify", str(folder / "a.safetensors")],
        ["verify", str(folder)],
        ["inspect", str(folder / "a.safetensors")],
        ["ls", str(root), "--verify"],
    ):
        modules = _imported(*args, cwd=tmp_path)
        assert f"fastckpt.cli.{args[0]}" in modules
        heavy = sorted(m for m in modules if m.startswith("torch.distributed.checkpoint"))
        assert not heavy, (args, heavy[:5])
        assert "fastckpt.integrations.dcp" not in modules, args


def test_the_cli_names_the_dcp_metadata_file_as_the_integration_does():
    from fastckpt.cli.file_kinds import DCP_METADATA
    from fastckpt.integrations.dcp import METADATA_FILE

    assert DCP_METADATA == METADATA_FILE


# --------------------------------------------------------------------- the sweep


def _raw(path, header: bytes | str, data: bytes = b"", length: int | None = None) -> None:
    body = header.encode() if isinstance(header, str) else header
    size = len(body) if length is None else length
    path.write_bytes(struct.pack("<Q", size) + body + data)


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _hostile_files(folder) -> dict[str, str]:
    """Malformed checkpoint files, by what is wrong with them."""
    made = {}

    def file(name: str, header: bytes | str = b"", data: bytes = b"", length=None, raw=None):
        path = folder / f"{name.replace(' ', '_')}.safetensors"
        if raw is not None:
            path.write_bytes(raw)
        else:
            _raw(path, header, data, length)
        made[name] = str(path)

    file("empty", raw=b"")
    file("seven bytes", raw=b"\x01" * 7)
    file("length beyond the file", "{}", length=1 << 40)
    file("length zero", b"", length=0)
    file("header not json", "{not json}")
    file("header a list", "[1, 2]")
    file("header not utf-8", b"\xff\xfe\xfd")
    file("offsets backwards", json.dumps({"w": _entry(offsets=(8, 0))}), b"\0" * 8)
    file("offsets beyond data", json.dumps({"w": _entry(offsets=(0, 800))}), b"\0" * 8)
    file(
        "overlapping tensors",
        json.dumps({"a": _entry(), "b": _entry(offsets=(4, 12))}),
        b"\0" * 12,
    )
    file("unknown dtype", json.dumps({"w": _entry(dtype="F33")}), b"\0" * 8)
    file("shape and size disagree", json.dumps({"w": _entry(shape=(3,))}), b"\0" * 8)
    file("huge shape", json.dumps({"w": _entry(shape=(2**62, 2**62, 0), offsets=(0, 0))}))
    file("negative dims", json.dumps({"w": _entry(shape=(-2,))}), b"\0" * 8)
    file("metadata not strings", json.dumps({"__metadata__": {"a": 1}}))
    file("deep nesting", "[" * 100_000 + "]" * 100_000)
    file("nan offsets", '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [NaN, 8]}}')
    file(
        "bad fastckpt metadata",
        json.dumps({"__metadata__": {"fastckpt.version": "2", "fastckpt.crc32c": "[1"}}),
    )
    file("a torch.save file", raw=b"PK\x03\x04" + b"\0" * 60)
    fifo = folder / "pipe.safetensors"
    os.mkfifo(fifo)
    made["a named pipe"] = str(fifo)
    loop = folder / "loop.safetensors"
    os.symlink(loop, loop)
    made["a link to itself"] = str(loop)
    text_only = folder / "text_only"
    text_only.mkdir()
    (text_only / "notes.txt").write_text("hello\n")
    made["a folder of notes"] = str(text_only)
    empty = folder / "empty_dir"
    empty.mkdir()
    made["an empty folder"] = str(empty)
    made["no such path"] = str(folder / "missing.safetensors")
    for name, metadata in (
        ("dcp metadata empty", b""),
        ("dcp metadata garbage", bytes(range(256)) * 4),
        ("dcp metadata unsafe pickle", pickle.dumps(os.system)),
    ):
        dcp = folder / name.replace(" ", "_")
        dcp.mkdir()
        (dcp / ".metadata").write_bytes(metadata)
        made[name] = str(dcp)
    return made


_FILE_CASES = [
    "empty",
    "seven bytes",
    "length beyond the file",
    "length zero",
    "header not json",
    "header a list",
    "header not utf-8",
    "offsets backwards",
    "offsets beyond data",
    "overlapping tensors",
    "unknown dtype",
    "shape and size disagree",
    "huge shape",
    "negative dims",
    "metadata not strings",
    "deep nesting",
    "nan offsets",
    "bad fastckpt metadata",
    "a torch.save file",
    "a named pipe",
    "a link to itself",
    "a folder of notes",
    "an empty folder",
    "no such path",
    "dcp metadata empty",
    "dcp metadata garbage",
    "dcp metadata unsafe pickle",
]


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory):
    return _hostile_files(tmp_path_factory.mktemp("hostile"))


def _assert_one_line_answer(status: int, out: str, err: str, what) -> None:
    assert status in (1, 2), (what, status, out, err)
    assert "Traceback" not in out + err, what
    assert err.strip() or out.strip(), what  # something says why


@pytest.mark.parametrize("verb", ["verify", "inspect", "convert"])
@pytest.mark.parametrize("case", _FILE_CASES)
def test_sweep_of_hostile_files(hostile_files, tmp_path, capsys, verb, case):
    out_file = [str(tmp_path / "out.safetensors")] if verb == "convert" else []
    status, out, err = run_main(capsys, verb, hostile_files[case], *out_file)
    _assert_one_line_answer(status, out, err, (verb, case))
    if verb == "inspect":
        status, out, err = run_main(capsys, verb, hostile_files[case], "--json")
        _assert_one_line_answer(status, out, err, (verb, case, "--json"))


def _hostile_tree(tmp_path, case: str) -> str:
    """A series root (with one good step) made hostile as ``case`` says; returns ROOT."""
    root = tmp_path / "run"
    if case == "root is a file":
        root.write_text("not a directory")
        return str(root)
    if case == "no such root":
        return str(root)
    _series(root, 2)
    if case in ODD_MARKERS:
        _write_marker(root, 9, ODD_MARKERS[case])
    elif case == "marker is a directory":
        os.makedirs(os.path.join(steps.step_dir(str(root), 9), steps.MARKER))
        _write_marker(root, 8, "{]")  # and a committed step beside it that cannot be used
    elif case == "state file is a directory":
        _write_marker(root, 9, _marker(9))
        os.makedirs(os.path.join(steps.step_dir(str(root), 9), steps.STATE_FILE))
    elif case == "state file truncated":
        state = os.path.join(steps.step_dir(str(root), 2), steps.STATE_FILE)
        os.truncate(state, 100)
    return str(root)


#: Trees whose markers are intact but whose data is not: only ``ls --verify`` can tell.
_DAMAGED_DATA = ("state file is a directory", "state file truncated")

_TREE_CASES = [
    *sorted(ODD_MARKERS),
    "marker is a directory",
    "state file is a directory",
    "state file truncated",
    "root is a file",
    "no such root",
]


@pytest.mark.parametrize("case", _TREE_CASES)
def test_sweep_of_hostile_series_trees(tmp_path, capsys, case):
    root = _hostile_tree(tmp_path, case)
    verbs = [
        ["ls", root],
        ["ls", root, "--json"],
        ["ls", root, "--verify"],
        ["prune", root, "--keep-last", "1", "--dry-run"],
        ["clean", root, "--dry-run"],
    ]
    for args in verbs:
        status, out, err = run_main(capsys, *args)
        if case in _DAMAGED_DATA and args[-1] != "--verify":
            # markers intact: only a check of the data finds what is wrong
            assert status == 0 and "Traceback" not in out + err, (case, args, out, err)
            continue
        _assert_one_line_answer(status, out, err, (case, args))
        if "--json" in args and status == 1:
            json.loads(out)


# ------------------------------------------------------------- seeded mutation sweeps


def _random_json(rng, depth: int = 0):
    """A random JSON value: every type, nested a little, with awkward numbers."""
    kinds = ["int", "float", "str", "bool", "null", "list", "dict"]
    kind = rng.choice(kinds if depth < 3 else kinds[:5])
    if kind == "int":
        return rng.choice([0, -1, 1, 16, 2**63, 10**30, -(2**70)])
    if kind == "float":
        return rng.choice([0.5, -0.0, 1e308, float("nan"), float("inf"), -float("inf")])
    if kind == "str":
        return rng.choice(["", "x", "state.safetensors", "../up", "\x1b[2J", "é", "1"])
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "null":
        return None
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(["a", "loss", "", "state.safetensors"]): _random_json(rng, depth + 1)}


def test_seeded_sweep_of_random_marker_fields(tmp_path, capsys):
    """Every field of a marker replaced by random JSON: the series verbs answer 0 or 1 in
    one line, and the dry runs change nothing."""
    import random

    rng = random.Random(37)
    root = tmp_path / "run"
    _series(root, 2)
    fields = ["step", "layout", "files", "metrics", "time", "depends_on"]
    for _ in range(60):
        document = json.loads(_marker(9, metrics={"loss": 0.1}, time="t"))
        for field in rng.sample(fields, rng.randrange(1, 4)):
            document[field] = _random_json(rng)
        _write_marker(root, 9, json.dumps(document))
        before = _tree_listing(root)
        for args in (
            ["ls", root, "--json"],
            ["ls", root],
            ["prune", root, "--keep-last", "1", "--best", "loss:min:1", "--dry-run"],
            ["clean", root, "--dry-run"],
        ):
            status, out, err = run_main(capsys, *args)
            assert status in (0, 1) and "Traceback" not in out + err, (document, args, err)
            if args[-1] == "--json":
                json.loads(out, parse_constant=lambda token: pytest.fail(f"{token} in JSON"))
            if status == 1:
                assert "step 9" in err and len(err.strip().splitlines()) == 1, (document, err)
        assert _tree_listing(root) == before


def test_seeded_sweep_of_damaged_files_never_verifies_what_load_refuses(tmp_path, capsys):
    """Random flips, cuts and splices of a saved file's header and data: ``verify`` and
    ``inspect`` answer in one line, and ``verify`` says OK only of a file load accepts."""
    import random

    rng = random.Random(11)
    pristine = tmp_path / "pristine.safetensors"
    emb = torch.randn(32, 8)
    fastckpt.save(
        {"model": {"emb": emb, "head": emb, "b": torch.ones(5)}, "epoch": 3, "lr": [0.1]},
        pristine,
    )
    original = pristine.read_bytes()
    (n,) = struct.unpack("<Q", original[:8])
    path = tmp_path / "mutant.safetensors"
    for _ in range(120):
        data = bytearray(original)
        how = rng.choice(["flip header", "flip data", "cut", "splice"])
        if how == "flip header":
            at = rng.randrange(8 * (8 + n))
            data[at // 8] ^= 1 << (at % 8)
        elif how == "flip data":
            at = rng.randrange(8 * (8 + n), 8 * len(data))
            data[at // 8] ^= 1 << (at % 8)
        elif how == "cut":
            del data[rng.randrange(len(data)) :]
        else:
            at = rng.randrange(8, 8 + n)
            data[at : at + 4] = rng.choice([b"null", b'{"a"', b"9999", b"[[[["])
        path.write_bytes(bytes(data))
        status, out, err = run_main(capsys, "verify", path)
        assert status in (0, 1, 2) and "Traceback" not in out + err, how
        try:
            fastckpt.load(path)
        except (fastckpt.FastCkptError, OSError, ValueError):
            assert status != 0, (how, out)
        status, out, err = run_main(capsys, "inspect", path)
        assert status in (0, 1, 2) and "Traceback" not in out + err, how


# ----------------------------------------------------------------- other tools' files


def _other_tools_files(folder) -> dict[str, str]:
    """One file of each format a user may point the commands at by mistake -> its name."""
    import numpy as np

    with open(folder / "arrays.npz", "wb") as f:
        np.savez(f, x=np.ones(3))
    with open(folder / "array.npy", "wb") as f:
        np.save(f, np.ones(3))
    (folder / "model.gguf").write_bytes(b"GGUF\x03\0\0\0" + bytes(64))
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "state.pkl").write_bytes(pickle.dumps({"w": [1.0]}, protocol=4))
    return {
        "arrays.npz": "a NumPy .npz archive (a zip of .npy files)",
        "array.npy": "a NumPy .npy file",
        "model.gguf": "a GGUF file (llama.cpp)",
        "config.json": "a JSON document",
        "state.pkl": "a Python pickle (protocol 4, not torch.save)",
    }


def test_inspect_names_other_tools_files_it_skips(tmp_path, capsys):
    named = _other_tools_files(tmp_path)
    fastckpt.save({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    status, _, err = run_main(capsys, "inspect", str(tmp_path))
    assert status == 0
    for name, described in named.items():
        assert f"{name}: {described}" in err
    assert "a torch.save file" not in err


@pytest.mark.parametrize(
    "name", ["arrays.npz", "array.npy", "model.gguf", "config.json", "state.pkl"]
)
def test_convert_refuses_other_tools_files_naming_the_format(tmp_path, capsys, name):
    described = _other_tools_files(tmp_path)[name]
    status, _, err = run_main(
        capsys, "convert", str(tmp_path / name), str(tmp_path / "out.safetensors")
    )
    assert status == 2
    assert f"{name}: {described}, not a torch.save or safetensors file" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("spelling", ["outdir/", "outdir"])
def test_convert_into_a_directory_writes_model_safetensors(tmp_path, capsys, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.arange(3.0)}, "train.pt")
    if spelling == "outdir":
        os.mkdir("outdir")  # an existing directory, named without the slash
    status, out, err = run_main(capsys, "convert", "train.pt", spelling)
    assert status == 0, err
    assert "-> outdir/model.safetensors" in out
    assert fastckpt.load("outdir")["w"].tolist() == [0.0, 1.0, 2.0]
    status, _, err = run_main(capsys, "convert", "train.pt", spelling)
    assert status == 2 and "outdir/model.safetensors exists; pass --force" in err
    assert run_main(capsys, "convert", "train.pt", spelling, "--force")[0] == 0


def test_convert_into_a_directory_holding_another_tools_checkpoint_refuses(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2)}, "train.pt")
    os.mkdir("hf")
    (tmp_path / "hf" / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    status, _, err = run_main(capsys, "convert", "train.pt", "hf/")
    assert status == 1 and "holds a checkpoint that fastckpt did not write" in err
    assert sorted(os.listdir("hf")) == ["model.safetensors.index.json"]


def test_inspect_of_a_series_root_says_what_reads_it(tmp_path, capsys):
    with fastckpt.CheckpointManager(str(tmp_path / "run")) as manager:
        manager.save(5, {"w": torch.ones(2)})
    status, _, err = run_main(capsys, "inspect", str(tmp_path / "run"))
    assert status == 2
    assert "the root of a checkpoint series (1 committed step, the newest step-000000000005)" in err
    assert "CheckpointManager(" in err and ".restore()" in err
