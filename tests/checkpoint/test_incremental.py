"""Incremental checkpoints: save(base=) writes only changed tensors and refers to the rest;
every reader path resolves the references, checked against the base's recorded XXH3-128;
hostile references, missing or changed bases and a killed save fail loudly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import torch
import xxhash

import fastckpt
from fastckpt import format
from fastckpt.checkpoint import tensor_records
from fastckpt.checkpoint.incremental import dependencies
from fastckpt.cli import main as cli_main
from fastckpt.errors import ChecksumError, HeaderError, MissingBaseError
from tests._false_hashes import record_false_xxh3
from tests.python_processes import run


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "base.weight": torch.randn(256, 64, generator=g),
        "base.bias": torch.randn(64, generator=g),
        "lora.A": torch.randn(8, 64, generator=g),
        "lora.B": torch.zeros(64, 8),
        "step": torch.tensor(0),
    }


def _train(state: dict[str, torch.Tensor]) -> None:
    state["lora.A"].add_(0.5)
    state["lora.B"].add_(1.0)
    state["step"].add_(1)


def _xxh3(t: torch.Tensor) -> str:
    return xxhash.xxh3_128(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- what is written and what every reader sees ---------------------------------------------


def test_only_changed_tensors_are_written_and_every_reader_resolves_the_rest(tmp_path):
    state = _state()
    p0, p1 = tmp_path / "0.safetensors", tmp_path / "1.safetensors"
    fastckpt.save(state, p0, metadata={"step": "0"})
    _train(state)
    fastckpt.save(state, p1, base=p0, metadata={"step": "1"})

    plain = safetensors.torch.load_file(str(p1))  # plain safetensors: the written tensors
    assert sorted(plain) == ["lora.A", "lora.B", "step"]
    assert os.path.getsize(p1) < os.path.getsize(p0) // 4

    _assert_same(fastckpt.load(p1), state)
    _assert_same(fastckpt.load(p1, mmap=True), state)
    _assert_same(fastckpt.load(p1, verify=True), state)
    assert torch.equal(fastckpt.load(p1, keys=["base.bias"])["base.bias"], state["base.bias"])
    with fastckpt.open(p1) as r:
        assert sorted(r.keys()) == sorted(state)
        assert r.metadata() == {"format": "pt", "step": "1"}
        assert r.info("base.weight").shape == (256, 64)
        assert torch.equal(r.get_tensor("base.weight"), state["base.weight"])
        assert torch.equal(r.get_slice("base.weight")[3:5], state["base.weight"][3:5])
        assert torch.equal(r.get_slice("lora.A", verify=True)[1:2], state["lora.A"][1:2])
        r.prefetch(["base.bias", "lora.B"])
        assert torch.equal(r.get_tensor("base.bias"), state["base.bias"])
        assert r.verify() == []
        assert sorted(r.stored_names()) == ["lora.A", "lora.B", "step"]
    model = {name: torch.empty_like(t) for name, t in state.items()}
    fastckpt.load_into(model, p1)
    _assert_same(model, state)
    assert dependencies(p1) == [str(p0)]
    assert dependencies(p0) == []


def test_every_save_records_the_xxh3_128_of_every_tensor(tmp_path):
    state = {"a": torch.randn(1000), "b": torch.randn(30, 40).t(), "e": torch.zeros(0)}
    expected = {name: _xxh3(t) for name, t in state.items()}
    for direct_io in (True, False):  # staging buffers, and from the tensors' memory
        path = tmp_path / f"h{direct_io}.safetensors"
        fastckpt.save(state, path, direct_io=direct_io)
        assert fastckpt.open(path).meta.hashes == expected
    fastckpt.async_save(state, tmp_path / "async.safetensors").result()
    assert fastckpt.open(tmp_path / "async.safetensors").meta.hashes == expected
    with open(tmp_path / "stream.safetensors", "wb") as f:
        fastckpt.save(state, f)
    assert fastckpt.open(tmp_path / "stream.safetensors").meta.hashes == expected
    fastckpt.save(state, tmp_path / "none.safetensors", checksum=False)
    assert fastckpt.open(tmp_path / "none.safetensors").meta.hashes is None


def test_chains_of_incremental_saves_refer_to_the_file_holding_the_bytes(tmp_path):
    state = _state()
    paths = [tmp_path / f"step-{i}" / "state.safetensors" for i in range(4)]
    for p in paths:
        p.parent.mkdir()
    fastckpt.save(state, paths[0])
    for i in range(1, 4):
        _train(state)
        fastckpt.save(state, paths[i], base=paths[i - 1])
    # the frozen tensors are referred to in step 0 directly, not through steps 1 and 2
    header = fastckpt.open(paths[3]).meta.references
    assert header.files == ("../step-0/state.safetensors",)
    assert dependencies(paths[3]) == [str(paths[0])]
    os.unlink(paths[1])
    os.unlink(paths[2])
    _assert_same(fastckpt.load(paths[3]), state)


def test_a_base_out_of_reach_is_referred_to_through_a_chain(tmp_path):
    """A reference climbs at most one directory: step C (two levels below A's sibling)
    refers to B, and B to A; loading C follows both."""
    state = _state()
    a = tmp_path / "one" / "a.safetensors"
    b = tmp_path / "two" / "b.safetensors"
    c = tmp_path / "two" / "deeper" / "c.safetensors"
    for p in (a, b, c):
        p.parent.mkdir(exist_ok=True)
    fastckpt.save(state, a)
    _train(state)
    fastckpt.save(state, b, base=a)
    _train(state)
    fastckpt.save(state, c, base=b)
    assert fastckpt.open(c).meta.references.files == ("../b.safetensors",)
    _assert_same(fastckpt.load(c), state)
    _assert_same(fastckpt.load(c, mmap=True), state)
    assert dependencies(c) == sorted([str(a), str(b)])
    out = fastckpt.open(c)
    assert out.locate("base.weight").file == str(a)


def test_tied_weights_unchanged_are_referred_to_and_shared_again(tmp_path):
    emb = torch.randn(32, 8)
    state = {"embed.weight": emb, "head.weight": emb, "lora": torch.zeros(4)}
    fastckpt.save(state, tmp_path / "0.safetensors")
    state["lora"].add_(1)
    fastckpt.save(state, tmp_path / "1.safetensors", base=tmp_path / "0.safetensors")
    assert list(safetensors.torch.load_file(str(tmp_path / "1.safetensors"))) == ["lora"]
    back = fastckpt.load(tmp_path / "1.safetensors")
    assert back["head.weight"] is back["embed.weight"]
    assert torch.equal(back["embed.weight"], emb)


def test_a_nested_object_round_trips_incrementally(tmp_path):
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    obj = {"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 1}
    fastckpt.save(obj, tmp_path / "0.safetensors")
    obj["epoch"] = 2
    fastckpt.save(obj, tmp_path / "1.safetensors", base=tmp_path / "0.safetensors")
    assert safetensors.torch.load_file(str(tmp_path / "1.safetensors")) == {}
    back = fastckpt.load(tmp_path / "1.safetensors")
    assert back["epoch"] == 2
    assert torch.equal(back["opt"]["state"][0]["exp_avg"], obj["opt"]["state"][0]["exp_avg"])


# -- what decides "unchanged" ---------------------------------------------------------------


def test_frozen_names_and_predicates_are_referred_to_without_hashing(tmp_path):
    state = _state()
    p0 = tmp_path / "0.safetensors"
    fastckpt.save(state, p0)
    with torch.no_grad():
        state["base.bias"].numpy()[0] = 123.0  # the caller's promise is broken on purpose
    fastckpt.save(state, tmp_path / "1.safetensors", base=p0, frozen={"base.bias"})
    fastckpt.save(
        state, tmp_path / "2.safetensors", base=p0, frozen=lambda n: n.startswith("base.")
    )
    for name in ("1", "2"):
        # taken from the base unread: frozen= is the caller's promise, not checked
        back = fastckpt.load(tmp_path / f"{name}.safetensors")
        assert back["base.bias"][0] != 123.0
    with pytest.raises(TypeError, match="frozen"):
        fastckpt.save(state, tmp_path / "3.safetensors", base=p0, frozen="base.bias")
    with pytest.raises(ValueError, match="frozen= needs base="):
        fastckpt.save(state, tmp_path / "3.safetensors", frozen={"base.bias"})


def test_frozen_names_missing_from_the_base_are_written(tmp_path):
    fastckpt.save({"a": torch.ones(3)}, tmp_path / "0.safetensors")
    state = {"a": torch.ones(3), "new": torch.arange(4)}
    fastckpt.save(
        state, tmp_path / "1.safetensors", base=tmp_path / "0.safetensors", frozen={"new"}
    )
    assert list(safetensors.torch.load_file(str(tmp_path / "1.safetensors"))) == ["new"]
    _assert_same(fastckpt.load(tmp_path / "1.safetensors"), state)


def test_a_change_that_moves_no_version_counter_is_found_by_content(tmp_path):
    """A tensor this process saved to the base, with the same storage, version and pointer,
    is still hashed and compared: a write that bumps no version counter (through a NumPy
    view, like writes through .data) is written, never referred to as unchanged."""
    state = _state()
    p0 = tmp_path / "0.safetensors"
    fastckpt.save(state, p0)
    state["base.bias"].numpy()[0] = 7.0  # no version bump
    state["lora.A"].add_(1)  # a version bump: written without being compared
    fastckpt.save(state, tmp_path / "1.safetensors", base=p0)
    written = safetensors.torch.load_file(str(tmp_path / "1.safetensors"))
    assert sorted(written) == ["base.bias", "lora.A"]
    assert fastckpt.load(tmp_path / "1.safetensors", verify=True)["base.bias"][0] == 7.0
    _assert_same(fastckpt.load(tmp_path / "1.safetensors"), state)

    # a new tensor object with equal bytes (as after load_state_dict into new memory): hashed,
    # found equal, referred to
    fresh = {name: t.clone() for name, t in state.items()}
    fastckpt.save(fresh, tmp_path / "2.safetensors", base=tmp_path / "1.safetensors")
    assert safetensors.torch.load_file(str(tmp_path / "2.safetensors")) == {}
    _assert_same(fastckpt.load(tmp_path / "2.safetensors"), fresh)


def test_a_tensor_written_in_place_since_the_last_save_is_written_without_hashing_first(
    tmp_path, monkeypatch
):
    """Its version moved on the same memory: its bytes most likely changed, so the save
    writes it (hashing it as it writes) instead of hashing it twice. Only tensors this
    process knows nothing of are hashed to be compared with the base."""
    from fastckpt.checkpoint import incremental

    compared: list[str] = []
    real = incremental.hash_tensors

    def observed(tensors, workers):
        compared.extend(tensors)
        return real(tensors, workers)

    monkeypatch.setattr(incremental, "hash_tensors", observed)
    state = _state()
    p0 = tmp_path / "0.safetensors"
    fastckpt.save(state, p0)
    state["lora.A"].add_(1)
    state["base.bias"].add_(0)  # in place, bytes unchanged: written again, never wrong
    fastckpt.save(state, tmp_path / "1.safetensors", base=p0)
    # the two moved are written unhashed; every other tensor is compared by content
    assert sorted(compared) == sorted(set(state) - {"lora.A", "base.bias"})
    assert sorted(safetensors.torch.load_file(str(tmp_path / "1.safetensors"))) == [
        "base.bias",
        "lora.A",
    ]
    _assert_same(fastckpt.load(tmp_path / "1.safetensors", verify=True), state)
    fresh = {name: t.clone() for name, t in state.items()}  # unknown memory: compared
    compared.clear()
    fastckpt.save(fresh, tmp_path / "2.safetensors", base=tmp_path / "1.safetensors")
    assert sorted(compared) == sorted(state)
    assert safetensors.torch.load_file(str(tmp_path / "2.safetensors")) == {}


def test_records_forget_freed_storages(tmp_path):
    t = torch.ones(8)
    record = tensor_records.SaveRecord(str(tmp_path / "r.safetensors"), {"t": t})
    record.hashed({"t": "0" * 32})
    state = tensor_records.previous(str(tmp_path / "r.safetensors"))["t"]
    t.add_(1)
    assert state.written_in_place(t)
    del t
    # the storage is gone: a new tensor is never taken for it
    assert not state.written_in_place(torch.ones(8).add_(1))


def test_async_save_with_a_pending_base(tmp_path):
    state = _state()
    p0, p1 = tmp_path / "0.safetensors", tmp_path / "1.safetensors"
    first = fastckpt.async_save(state, p0)
    _train(state)
    second = fastckpt.async_save(state, p1, base=p0)  # waits for p0 to commit
    first.result()
    second.result()
    assert sorted(safetensors.torch.load_file(str(p1))) == ["lora.A", "lora.B", "step"]
    _assert_same(fastckpt.load(p1), state)
    third = fastckpt.async_save(state, tmp_path / "2.safetensors", base=p1, lazy=True)
    third.result()
    assert safetensors.torch.load_file(str(tmp_path / "2.safetensors")) == {}


def test_misuse_is_refused_before_writing(tmp_path):
    state = _state()
    p0 = tmp_path / "0.safetensors"
    fastckpt.save(state, p0)
    with pytest.raises(ValueError, match="replace a file it refers to"):
        fastckpt.save(state, p0, base=p0)
    _train(state)
    fastckpt.save(state, tmp_path / "1.safetensors", base=p0)
    with pytest.raises(ValueError, match="replace a file it refers to"):
        fastckpt.save(state, p0, base=tmp_path / "1.safetensors")
    with pytest.raises(ValueError, match="checksum=True"):
        fastckpt.save(state, tmp_path / "2.safetensors", base=p0, checksum=False)
    with pytest.raises(FileNotFoundError, match="nothere"):
        fastckpt.save(state, tmp_path / "2.safetensors", base=tmp_path / "nothere.safetensors")
    far = tmp_path / "a" / "b" / "c.safetensors"
    far.parent.mkdir(parents=True)
    with pytest.raises(ValueError, match="climb at most"):
        fastckpt.save(state, far, base=p0)
    assert not os.path.exists(far) and not os.path.exists(tmp_path / "2.safetensors")


# -- hostile headers, missing and changed bases ---------------------------------------------


def _rewrite_references(path, change) -> None:
    """Rewrites ``path``'s header with its references changed by ``change(dict)``."""
    with open(path, "rb") as f:
        data = f.read()
    header = format.read_header_from(lambda o, n: data[o : o + n], len(data))
    meta = dict(header.metadata)
    meta.pop(format.KEY_HEADER_CRC)
    refs = json.loads(meta[format.KEY_REFERENCES])
    change(refs)
    meta[format.KEY_REFERENCES] = json.dumps(refs)
    encoded = format.encode_header(list(header.entries.values()), meta)
    with open(path, "wb") as f:
        f.write(encoded + data[header.data_offset :])


@pytest.fixture
def pair(tmp_path):
    state = _state()
    (tmp_path / "s0").mkdir()
    (tmp_path / "s1").mkdir()
    p0, p1 = tmp_path / "s0" / "state.safetensors", tmp_path / "s1" / "state.safetensors"
    fastckpt.save(state, p0)
    _train(state)
    fastckpt.save(state, p1, base=p0)
    return p0, p1


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r["tensors"]["base.bias"].update(tensor="nope"), "'nope'.*does not hold"),
        (lambda r: r.update(files=["/etc/passwd"]), "absolute"),
        (lambda r: r.update(files=["../../s0/state.safetensors"]), "climbs 2 directories"),
        (lambda r: r.update(files=["../s0/../s0/state.safetensors"]), "not a normalized"),
        (lambda r: r["tensors"]["base.bias"].update(shape=[3]), "as F32\\[3\\]"),
        (lambda r: r["tensors"]["base.bias"].update(file=5), "not an index"),
        (lambda r: r["tensors"].update({"lora.A": r["tensors"]["base.bias"]}), "both stored"),
        (lambda r: r["tensors"]["base.bias"].update(xxh3_128="x"), "32 lowercase hex"),
        (lambda r: r["tensors"]["base.bias"].update(dtype=["F32"]), "unknown dtype"),
    ],
)
def test_hostile_references_are_refused_naming_them(pair, change, message):
    _, p1 = pair
    _rewrite_references(p1, change)
    with pytest.raises(HeaderError, match=message):
        fastckpt.load(p1)
    with pytest.raises(HeaderError, match=message):
        fastckpt.open(p1)


def test_a_referenced_tied_copy_that_differs_from_its_target_is_refused(tmp_path):
    emb = torch.randn(16, 4)
    state = {"embed.weight": emb, "head.weight": emb, "lora": torch.zeros(2)}
    fastckpt.save(state, tmp_path / "0.safetensors")
    state["lora"].add_(1)
    fastckpt.save(state, tmp_path / "1.safetensors", base=tmp_path / "0.safetensors")
    _rewrite_references(
        tmp_path / "1.safetensors",
        lambda r: r["tensors"]["head.weight"].update(xxh3_128="0" * 32),
    )
    with pytest.raises(HeaderError, match="tied tensor 'head.weight'"):
        fastckpt.load(tmp_path / "1.safetensors")


def test_a_reference_cycle_is_refused(pair):
    p0, p1 = pair
    _rewrite_references(p1, lambda r: r.update(files=["state.safetensors"]))  # itself
    with pytest.raises(HeaderError, match="reference cycle"):
        fastckpt.load(p1)


def test_a_two_file_cycle_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, pb = tmp_path / "a" / "x.safetensors", tmp_path / "b" / "x.safetensors"
    fastckpt.save({"w": torch.ones(2), "v": torch.ones(1)}, pa)
    fastckpt.save({"w": torch.ones(2), "v": torch.zeros(1)}, pb, base=pa)
    fastckpt.save(
        {"w": torch.ones(2), "v": torch.ones(1) * 2}, pa.with_name("y.safetensors"), base=pb
    )
    os.replace(pa.with_name("y.safetensors"), pa)  # a now refers to b, which refers to a
    with pytest.raises(HeaderError, match="reference cycle"):
        fastckpt.load(pb)


def test_a_missing_base_fails_naming_it_and_a_tensor(pair):
    p0, p1 = pair
    os.unlink(p0)
    with pytest.raises(MissingBaseError, match=r"base\.(weight|bias).*s0/state\.safetensors") as e:
        fastckpt.load(p1)
    assert isinstance(e.value, FileNotFoundError) and e.value.filename == str(p0)
    with pytest.raises(MissingBaseError):
        fastckpt.open(p1)
    with pytest.raises(MissingBaseError):
        dependencies(p1)


def test_a_base_whose_tensor_changed_fails_naming_it(pair):
    p0, p1 = pair
    changed = fastckpt.load(p0)
    changed["base.bias"] = changed["base.bias"] + 1
    fastckpt.save(changed, p0)  # the base replaced by a file with other bytes
    with pytest.raises(ChecksumError, match=r"s0/state\.safetensors.*'base\.bias' changed") as e:
        fastckpt.load(p1)
    assert e.value.tensor == "base.bias"


def test_damaged_base_bytes_are_caught_by_the_crc_on_load(pair):
    p0, p1 = pair
    with fastckpt.open(p0) as r:
        offset = r.info("base.weight").offset
    with open(p0, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match="base.weight"):
        fastckpt.load(p1)


def test_older_fastckpt_refuses_an_incremental_file(pair):
    """A file with references is format version 3, so a reader of versions 1-2 says 'newer'
    instead of loading a checkpoint without its referenced tensors."""
    _, p1 = pair
    assert fastckpt.open(p1).meta.version == format.references.INCREMENTAL_VERSION == "3"
    assert format.FORMAT_VERSION == "2"


# -- crashes ------------------------------------------------------------------------------


def test_kill_9_during_an_incremental_save_leaves_base_and_previous_file_intact(tmp_path):
    state = _state()
    p0, p1 = tmp_path / "0.safetensors", tmp_path / "1.safetensors"
    fastckpt.save(state, p0)
    _train(state)
    fastckpt.save(state, p1, base=p0)
    before = {p: p.read_bytes() for p in (p0, p1)}
    script = textwrap.dedent(f"""
        import os, signal, torch, fastckpt
        state = fastckpt.load({str(p1)!r})
        state["lora.A"] = torch.randn(32 << 20 >> 2)  # a large changed tensor
        fastckpt.async_save(state, {str(p1)!r}, base={str(p0)!r}, staging_bytes=8 << 20)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = run([sys.executable, "-c", script], timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert {p: p.read_bytes() for p in (p0, p1)} == before
    _assert_same(fastckpt.load(p1), state)


def test_kill_9_in_a_loop_of_incremental_saves_never_tears_a_file(tmp_path):
    state = _state()
    p0 = tmp_path / "0.safetensors"
    fastckpt.save(state, p0)
    base_bytes = p0.read_bytes()
    target = tmp_path / "n.safetensors"
    script = textwrap.dedent(f"""
        import torch, fastckpt
        state = fastckpt.load({str(p0)!r})
        big = torch.zeros(8 << 20)
        for i in range(1000):
            state["lora.A"].fill_(i)
            big.fill_(i)
            state["big"] = big
            fastckpt.save(state, {str(target)!r}, base={str(p0)!r})
            print(i, flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    for _ in range(3):  # a few commits, then kill while the next save runs
        child.stdout.readline()
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    child.stdout.close()
    assert p0.read_bytes() == base_bytes
    back = fastckpt.load(target, verify=True)
    value = back["lora.A"].flatten()[0].item()
    assert torch.all(back["lora.A"] == value) and torch.all(back["big"] == value)
    assert torch.equal(back["base.weight"], state["base.weight"])


# -- command line ---------------------------------------------------------------------------


def test_verify_checks_the_chain_and_fails_on_a_missing_base(pair, capsys):
    p0, p1 = pair
    assert cli_main(["verify", str(p1)]) == 0
    assert "OK" in capsys.readouterr().out
    os.unlink(p0)
    assert cli_main(["verify", str(p1)]) == 1
    assert "s0/state.safetensors, which is missing" in capsys.readouterr().out


def test_inspect_shows_the_chain_and_fails_on_a_missing_base(pair, capsys):
    p0, p1 = pair
    assert cli_main(["inspect", str(p1)]) == 0
    out = capsys.readouterr().out
    assert "incremental: made of 2 files" in out
    assert "holds 3 tensors" in out and "refers to 2 tensors" in out
    assert cli_main(["inspect", "--json", str(p1)]) == 0
    chain = json.loads(capsys.readouterr().out)[0]["chain"]
    assert [link["path"] for link in chain] == [str(p1), str(p0)]
    assert chain[0]["referenced_bytes"] == (256 * 64 + 64) * 4
    os.unlink(p0)
    assert cli_main(["inspect", str(p1)]) == 1
    assert "ERROR missing" in capsys.readouterr().out


def test_convert_materialize_writes_a_self_contained_file(pair, capsys):
    p0, p1 = pair
    expected = fastckpt.load(p1)
    out = p1.with_name("full.safetensors")
    assert cli_main(["convert", str(p1), str(out)]) == 0
    assert cli_main(["convert", "--materialize", str(p1), str(p1)]) == 0
    assert "1.safetensors" not in capsys.readouterr().err
    os.unlink(p0)
    for path in (out, p1):
        assert fastckpt.open(path).meta.references is None
        _assert_same(fastckpt.load(path), expected)
        assert sorted(safetensors.torch.load_file(str(path))) == sorted(expected)
    assert dependencies(p1) == []


def _crafted_graph(folder, count: int) -> None:
    """``count`` files, each holding one tensor of its own and referring to tensor "a" in
    the next file and "b" in the one after: a graph every file of which is reached along
    many paths (as many as Fibonacci's numbers)."""
    import json as _json

    from fastckpt import _C, format
    from fastckpt.checkpoint.digests import hash_tensor
    from fastckpt.format.layout import encode_header, plan_layout

    a, b = torch.ones(4), torch.zeros(4)
    ha, hb = hash_tensor(a), hash_tensor(b)
    for k in reversed(range(count)):
        path = folder / f"{k}.safetensors"
        if k >= count - 2:  # the last two hold both tensors
            fastckpt.save({"a": a, "b": b, "own": torch.full((1,), float(k))}, path)
            continue
        own = torch.full((1,), float(k))
        refs = format.References(
            (f"{k + 1}.safetensors", f"{k + 2}.safetensors"),
            {
                "a": format.Reference(0, "a", "F32", (4,), ha),
                "b": format.Reference(1, "b", "F32", (4,), hb),
            },
        )
        data = own.numpy().tobytes()
        metadata = {
            "format": "pt",
            "fastckpt.version": "3",
            "fastckpt.crc32c": _json.dumps({"own": f"{_C.crc32c(own.data_ptr(), 4, 0):08x}"}),
            "fastckpt.xxh3_128": _json.dumps({"own": hash_tensor(own)}),
            "fastckpt.references": format.references.references_json(refs),
        }
        header = encode_header(plan_layout([("own", "F32", (1,))]), metadata)
        path.write_bytes(header + data)


def test_a_file_reached_along_many_paths_is_opened_once(tmp_path, monkeypatch):
    from fastckpt.checkpoint import read

    _crafted_graph(tmp_path, 24)  # along every path: 46,367 opens
    opened: list[str] = []
    real = read.CheckpointReader.__init__

    def counted(self, f, *args, **kwargs):
        opened.append(str(f))
        real(self, f, *args, **kwargs)

    monkeypatch.setattr(read.CheckpointReader, "__init__", counted)
    with fastckpt.open(tmp_path / "0.safetensors") as reader:
        assert reader.get_tensor("own").item() == 0.0
        assert torch.equal(reader.get_tensor("a"), torch.ones(4))
        assert reader.verify() == []
    assert len(opened) == 24 and len(set(opened)) == 24
    back = fastckpt.load(tmp_path / "0.safetensors", verify=True)
    assert torch.equal(back["b"], torch.zeros(4))


def test_a_base_recording_a_false_xxh3_is_not_referred_to(tmp_path, caplog):
    import logging

    state = _state()
    base = str(tmp_path / "0.safetensors")
    fastckpt.save(state, base)
    assert fastckpt.load(base, verify=True)  # well-formed
    stored = state["base.weight"].clone()
    state["base.weight"] = stored * 2  # in memory now: other values than the base's bytes
    # the base claims to hold the tensor now in memory, over its old bytes
    record_false_xxh3(base, "base.weight", xxhash.xxh3_128_hexdigest(state["base.weight"].numpy()))
    assert torch.equal(fastckpt.load(base, verify=True)["base.weight"], stored)  # still loads
    path = str(tmp_path / "1.safetensors")
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        fastckpt.save(state, path, base=base)
    assert "base.weight" in safetensors.torch.load_file(path)  # written in full
    back = fastckpt.load(path, verify=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert base in caplog.text and "'base.weight'" in caplog.text
    assert "base.bias" not in safetensors.torch.load_file(path)  # the honest ones referred to


def test_a_base_whose_referred_bytes_fail_their_crc_is_not_referred_to(tmp_path, caplog):
    import logging

    state = _state()
    base = str(tmp_path / "0.safetensors")
    fastckpt.save(state, base)
    with fastckpt.open(base) as reader:
        at = reader.header.data_offset + reader.header.entries["base.bias"].begin
    with open(base, "r+b") as f:  # one byte of the stored bias damaged
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    tensor_records.forget()
    from fastckpt.checkpoint import known_indexes

    known_indexes.forget()  # as in a new process: the base's header is parsed
    path = str(tmp_path / "1.safetensors")
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        fastckpt.save(state, path, base=base)
    assert "base.bias" in safetensors.torch.load_file(path)
    assert "CRC32C" in caplog.text and "'base.bias'" in caplog.text
    back = fastckpt.load(path, verify=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("saved_here", [True, False], ids=["saved-here", "saved-elsewhere"])
def test_a_parsed_base_has_its_referred_bytes_read_at_most_once(tmp_path, saved_here):
    from fastckpt.checkpoint import known_indexes

    state = _state()
    base = str(tmp_path / "0.safetensors")
    fastckpt.save(state, base)
    if not saved_here:
        tensor_records.forget()  # as in a new process
    for step in (1, 2):
        known_indexes.forget()  # parsed each time, as a base at a URL always is
        before = len(tensor_records._intact)
        fastckpt.save(state, str(tmp_path / f"{step}.safetensors"), base=base)
        read = len(tensor_records._intact) - before  # tensors read back and hashed
        assert read == (len(state) if step == 1 and not saved_here else 0)
        assert not safetensors.torch.load_file(str(tmp_path / f"{step}.safetensors"))
