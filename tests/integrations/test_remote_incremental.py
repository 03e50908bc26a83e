"""Incremental checkpoints at URLs (a real S3 server, moto, on loopback): only the changed
tensors are uploaded, references are relative to the new object's URL and resolved through
the URL storage, broken bases fail loudly; and every option a URL save cannot honour is
refused, naming the option and the URL."""

from __future__ import annotations

import json
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fsspec")

import fastckpt  # noqa: E402
from fastckpt import format  # noqa: E402
from fastckpt.checkpoint import tensor_records  # noqa: E402
from fastckpt.checkpoint.incremental import dependencies  # noqa: E402
from fastckpt.errors import ChecksumError, HeaderError, MissingBaseError  # noqa: E402
from fastckpt.integrations import remote  # noqa: E402
from fastckpt.storage.url import UrlStorage  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:botocore"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:moto"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "base.weight": torch.randn(512, 256, generator=g),  # 512 KiB, never changes
        "opt.scale": torch.randn(1024, generator=g),  # changes at step 1 only
        "lora.A": torch.randn(16, 256, generator=g),  # changes at every step
        "step": torch.tensor(0),
    }


def _train(state: dict[str, torch.Tensor], step: int) -> None:
    state["lora.A"].add_(0.5)
    state["step"].fill_(step)
    if step == 1:
        state["opt.scale"].mul_(2)


def _stored(fs, url: str) -> tuple[list[str], int]:
    """The tensors an object holds itself and the bytes of its data section."""
    data = fs.cat_file(url)
    header = format.read_header_from(lambda o, n: data[o : o + n], len(data))
    return sorted(header.entries), len(data) - header.data_offset


def _nbytes(state: dict[str, torch.Tensor], names: list[str]) -> int:
    return sum(state[n].numel() * state[n].element_size() for n in names)


def _assert_same(back: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert sorted(back) == sorted(state)
    for name, t in state.items():
        assert torch.equal(back[name], t), name


@pytest.fixture
def reads(monkeypatch):
    """Every read of a URL's bytes: (url, 'header' or 'data', bytes) -- the real reads,
    recorded on their way."""
    seen: list[tuple[str, str, int]] = []
    read_bytes, read_spans = UrlStorage.read_bytes, UrlStorage.read_spans

    def header(self, offset, nbytes):
        seen.append((self.location, "header", nbytes))
        return read_bytes(self, offset, nbytes)

    def data(self, spans, **kw):
        spans = list(spans)
        seen.append((self.location, "data", sum(s.nbytes for s in spans)))
        seen.append((self.location, "spans", len(spans)))
        seen.append((self.location, "thread", threading.get_ident()))
        return read_spans(self, spans, **kw)

    monkeypatch.setattr(UrlStorage, "read_bytes", header)
    monkeypatch.setattr(UrlStorage, "read_spans", data)
    return seen


def test_s3_chain_of_three_uploads_only_changed_tensors_and_every_reader_resolves(s3, reads):
    bucket, opts, fs = s3
    urls = [f"{bucket}/run/step-{i}/state.safetensors" for i in range(3)]
    state = _state()
    fastckpt.save(state, urls[0], storage_options=opts)
    full = fs.size(urls[0])
    for step in (1, 2):
        _train(state, step)
        reads.clear()
        fastckpt.save(state, urls[step], base=urls[step - 1], storage_options=opts)
        # the bases' headers were read, never their data
        assert [kind for _, kind, _ in reads] and {kind for _, kind, _ in reads} == {"header"}
    changed = {1: ["lora.A", "opt.scale", "step"], 2: ["lora.A", "step"]}
    for step, names in changed.items():
        held, data_bytes = _stored(fs, urls[step])
        assert held == names and data_bytes == _nbytes(state, names)
        assert fs.size(urls[step]) < full // 10
    assert tensor_records.previous(urls[2])  # the next save skips hashing unmoved tensors
    assert dependencies(urls[2], opts) == urls[:2]

    _assert_same(fastckpt.load(urls[2], storage_options=opts), state)
    with fastckpt.open(urls[2], storage_options=opts) as r:
        # the unchanged weight is referred to in the file holding it, not through step-1
        assert r.top.meta.references.files == (
            "../step-0/state.safetensors",
            "../step-1/state.safetensors",
        )
        assert torch.equal(r.get_slice("base.weight")[10:20], state["base.weight"][10:20])
        assert torch.equal(r.get_tensor("opt.scale"), state["opt.scale"])
        part = r.read_range("base.weight", 4096, 8192, verify=True)
        assert torch.equal(part, state["base.weight"].reshape(-1).view(torch.uint8)[4096:8192])
        assert r.verify() == []
    assert fastckpt.load(urls[2], storage_options=opts, keys=["base.weight"])["base.weight"].equal(
        state["base.weight"]
    )


def test_s3_restore_reads_a_base_with_interleaved_changes_in_few_requests(s3, reads):
    """The unchanged tensors of a base lie between the ones that changed since; reading them
    one run at a time would cost a request per run."""
    bucket, opts, fs = s3
    state = {f"t{i:02d}.{kind}": torch.randn(4096) for i in range(40) for kind in "ab"}
    u0, u1 = f"{bucket}/r/0/state.safetensors", f"{bucket}/r/1/state.safetensors"
    fastckpt.save(state, u0, storage_options=opts)
    for i in range(40):
        state[f"t{i:02d}.b"].add_(1)
    fastckpt.save(state, u1, base=u0, storage_options=opts)
    reads.clear()
    # the new object and its base are read at once, each on its own thread: each read
    # waits for the other to start (a sequential reader would break the barrier)
    both = threading.Barrier(2, timeout=60)
    recorded = UrlStorage.read_spans

    def read_spans(self, spans, **kw):
        both.wait()
        return recorded(self, spans, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(UrlStorage, "read_spans", read_spans)
        _assert_same(fastckpt.load(u1, storage_options=opts), state)
    spans = {url: n for url, kind, n in reads if kind == "spans"}
    assert spans[u0] <= 2, spans
    assert len({n for _, kind, n in reads if kind == "thread"}) == 2


def test_s3_async_incremental_saves_wait_for_a_pending_base_and_commit_in_order(s3):
    bucket, opts, fs = s3
    u0, u1 = f"{bucket}/a/state.safetensors", f"{bucket}/b/state.safetensors"
    state = _state()
    first = fastckpt.async_save(state, u0, storage_options=opts)
    _train(state, 1)
    second = fastckpt.async_save(state, u1, base=u0, storage_options=opts)  # waits for u0
    first.result()
    second.result()
    assert _stored(fs, u1)[0] == ["lora.A", "opt.scale", "step"]
    _assert_same(fastckpt.load(u1, storage_options=opts), state)
    # saves to one URL commit in call order, and a save waits for a pending one
    futures = [
        fastckpt.async_save({"x": torch.full((4,), float(i))}, u0, storage_options=opts)
        for i in range(3)
    ]
    fastckpt.save({"x": torch.full((4,), 9.0)}, u0, storage_options=opts)
    for f in futures:
        f.result()
    assert fastckpt.load(u0, storage_options=opts)["x"].tolist() == [9.0] * 4


def test_s3_frozen_tensors_are_referred_to_without_reading_them(s3):
    bucket, opts, fs = s3
    u0, u1 = f"{bucket}/run/0/state.safetensors", f"{bucket}/run/1/state.safetensors"
    state = _state()
    fastckpt.save(state, u0, storage_options=opts)
    _train(state, 1)
    fastckpt.save(state, u1, base=u0, frozen=["opt.scale"], storage_options=opts)
    assert _stored(fs, u1)[0] == ["lora.A", "step"]  # the caller's promise is taken


def test_s3_missing_base_is_named_at_save_and_at_load(s3):
    bucket, opts, fs = s3
    u0, u1 = f"{bucket}/run/0/state.safetensors", f"{bucket}/run/1/state.safetensors"
    state = _state()
    with pytest.raises(MissingBaseError, match="run/0/state.safetensors") as e:
        fastckpt.save(state, u1, base=u0, storage_options=opts)
    assert e.value.filename == u0 and not fs.exists(u1)
    fastckpt.save(state, u0, storage_options=opts)
    _train(state, 1)
    fastckpt.save(state, u1, base=u0, storage_options=opts)
    fs.rm(u0)
    with pytest.raises(MissingBaseError, match=r"base\.weight.*run/0/state\.safetensors") as e:
        fastckpt.load(u1, storage_options=opts)
    assert e.value.filename == u0
    with pytest.raises(MissingBaseError):
        fastckpt.open(u1, storage_options=opts)


def test_s3_damaged_or_replaced_base_fails_with_a_checksum_error(s3):
    bucket, opts, fs = s3
    u0, u1 = f"{bucket}/run/0/state.safetensors", f"{bucket}/run/1/state.safetensors"
    state = _state()
    fastckpt.save(state, u0, storage_options=opts)
    _train(state, 1)
    fastckpt.save(state, u1, base=u0, storage_options=opts)
    good = fs.cat_file(u0)
    with fastckpt.open(u0, storage_options=opts) as r:
        at = r.info("base.weight").offset + 100
    fs.pipe_file(u0, good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1 :])  # a flipped bit
    with pytest.raises(ChecksumError, match="base.weight"):
        fastckpt.load(u1, storage_options=opts)
    replaced = dict(state)
    replaced["base.weight"] = state["base.weight"] + 1
    fastckpt.save(replaced, u0, storage_options=opts)  # the base replaced by other bytes
    with pytest.raises(ChecksumError, match=r"run/0/state\.safetensors.*'base\.weight' changed"):
        fastckpt.open(u1, storage_options=opts)


def _rewrite_references(fs, url: str, change) -> None:
    data = fs.cat_file(url)
    header = format.read_header_from(lambda o, n: data[o : o + n], len(data))
    meta = dict(header.metadata)
    meta.pop(format.KEY_HEADER_CRC)
    refs = json.loads(meta[format.KEY_REFERENCES])
    change(refs)
    meta[format.KEY_REFERENCES] = json.dumps(refs)
    fs.pipe_file(
        url, format.encode_header(list(header.entries.values()), meta) + data[header.data_offset :]
    )


def test_s3_references_never_leave_the_bucket(s3, new_bucket):
    bucket, opts, fs = s3
    other, _ = new_bucket()
    state = _state()
    fastckpt.save(state, f"{bucket}/0.safetensors", storage_options=opts)
    fastckpt.save(state, f"{other}/0.safetensors", storage_options=opts)
    _train(state, 1)
    top = f"{bucket}/1.safetensors"
    fastckpt.save(state, top, base=f"{bucket}/0.safetensors", storage_options=opts)
    assert fastckpt.open(top, storage_options=opts).top.meta.references.files == ("0.safetensors",)
    # a hostile header points at the same file in another bucket: refused, not followed
    name = other.removeprefix("s3://")
    _rewrite_references(fs, top, lambda r: r.update(files=[f"../{name}/0.safetensors"]))
    with pytest.raises(HeaderError, match="leaves the bucket"):
        fastckpt.load(top, storage_options=opts)
    _rewrite_references(fs, top, lambda r: r.update(files=["../../x/0.safetensors"]))
    with pytest.raises(HeaderError, match="climbs 2 directories"):
        fastckpt.open(top, storage_options=opts)
    # and a save never writes such a reference
    with pytest.raises(ValueError, match="out of its bucket"):
        fastckpt.save(
            state, f"{bucket}/2.safetensors", base=f"{other}/0.safetensors", storage_options=opts
        )
    assert not fs.exists(f"{bucket}/2.safetensors")


def test_a_local_base_for_a_url_and_the_reverse_are_refused(tmp_path):
    state = _state()
    local = tmp_path / "0.safetensors"
    fastckpt.save(state, local)
    fastckpt.save(state, "memory://urlincr/0.safetensors")
    with pytest.raises(ValueError, match="both be local files or both at URLs"):
        fastckpt.save(state, "memory://urlincr/1.safetensors", base=local)
    with pytest.raises(ValueError, match="both be local files or both at URLs"):
        fastckpt.async_save(state, "memory://urlincr/1.safetensors", base=str(local)).result()
    with pytest.raises(ValueError, match="both be local files or both at URLs"):
        fastckpt.save(state, tmp_path / "1.safetensors", base="memory://urlincr/0.safetensors")
    assert not remote.storage.exists("memory://urlincr/1.safetensors")
    assert not (tmp_path / "1.safetensors").exists()


def test_sharded_saves_refuse_base_at_urls_and_locally(tmp_path):
    state = {"a": torch.zeros(1000), "b": torch.ones(1000)}
    fastckpt.save(state, "memory://urlincr/shards-base.safetensors")
    for target in ("memory://urlincr/shards/", str(tmp_path / "shards")):
        with pytest.raises(TypeError, match="base= is not supported for a sharded save"):
            fastckpt.save(
                state, target, max_shard_size="4KB", base="memory://urlincr/shards-base.safetensors"
            )
    assert not remote.storage.exists("memory://urlincr/shards/model.safetensors.index.json")


# -- options a URL save cannot honour, and those it does ------------------------------------


@pytest.mark.parametrize("save", [remote.save, remote.async_save])
def test_unknown_options_are_refused_naming_them_and_the_url(save):
    url = "memory://urlincr/opts/x.safetensors"
    with pytest.raises(TypeError, match=r"'snapshots'.*memory://urlincr/opts/x\.safetensors"):
        save({"w": torch.ones(2)}, url, snapshots=False)
    assert not remote.storage.exists(url)


@pytest.mark.parametrize(
    "option, value",
    [
        ("lazy", True),
        ("fence", torch.optim.SGD([torch.zeros(1, requires_grad=True)])),
        ("fence_bytes", 1 << 20),
    ],
)
def test_lazy_saves_to_urls_are_refused_naming_the_option_and_the_url(option, value):
    url = "memory://urlincr/lazy/x.safetensors"
    with pytest.raises(ValueError, match=rf"{option}=.*memory://urlincr/lazy/x\.safetensors"):
        fastckpt.async_save({"w": torch.ones(2)}, url, **{option: value})
    with pytest.raises(ValueError, match=rf"{option}="):
        remote.async_save({"w": torch.ones(2)}, url, **{option: value})
    assert not remote.storage.exists(url)


@pytest.mark.parametrize("save", [remote.save, remote.async_save])
@pytest.mark.parametrize("option", remote.IGNORED_AT_URLS)
def test_io_tuning_options_are_ignored_at_urls(save, option):
    url = f"memory://urlincr/io/{save.__name__}-{option}.safetensors"
    value = {"engine": "threads", "direct_io": True, "progress": False}.get(option, 4096)
    if option == "overwrite_readonly":
        value = True
    result = save({"w": torch.arange(5)}, url, **{option: value})
    if result is not None:
        result.result()
    assert fastckpt.load(url)["w"].tolist() == [0, 1, 2, 3, 4]


def test_max_pending_is_honoured_at_urls():
    url = "memory://urlincr/pending/x.safetensors"
    futures = [fastckpt.async_save({"w": torch.ones(2) * i}, url, max_pending=1) for i in range(3)]
    assert all(f.done() for f in futures[:-1])  # each call waited for the one before
    futures[-1].result()
    assert fastckpt.load(url)["w"].tolist() == [2.0, 2.0]


def test_piece_size_is_honoured_at_urls():
    url = "memory://urlincr/pieces/x.safetensors"
    fastckpt.save({"w": torch.zeros(8192)}, url, piece_size=8192)
    with fastckpt.open(url) as r:
        assert r.meta.pieces.piece_size == 8192 and len(r.meta.pieces.crcs("w")) == 4
    remote.async_save({"w": torch.zeros(8192)}, url, piece_size=0).result()
    with fastckpt.open(url) as r:
        assert r.meta.pieces is None


def test_s3_compressed_round_trip(s3):
    pytest.importorskip("zstandard")
    bucket, opts, fs = s3
    state = {"zeros": torch.zeros(256, 1024), "w": torch.randn(64, 64), "n": torch.arange(1000)}
    plain, packed = f"{bucket}/plain.safetensors", f"{bucket}/packed.safetensors"
    fastckpt.save(state, plain, storage_options=opts)
    fastckpt.save(state, packed, compress=True, storage_options=opts)
    assert fs.size(packed) < fs.size(plain) // 2
    _assert_same(fastckpt.load(packed, storage_options=opts), state)
    fastckpt.async_save(state, packed, compress="zstd", storage_options=opts).result()
    _assert_same(fastckpt.load(packed, storage_options=opts), state)
    # compression and an incremental save together: the changed tensor is compressed
    state["zeros"][0, 0] = 1
    step = f"{bucket}/step.safetensors"
    fastckpt.save(state, step, base=plain, compress=True, storage_options=opts)
    assert _stored(fs, step)[0] == ["zeros"] and fs.size(step) < 64 << 10
    _assert_same(fastckpt.load(step, storage_options=opts), state)


def test_file_urls_keep_every_local_option(tmp_path):
    state = _state()
    first, second = tmp_path / "0.safetensors", tmp_path / "1.safetensors"
    remote.save(state, first.as_uri(), engine="threads", piece_size=8192)
    _train(state, 1)
    remote.async_save(state, second.as_uri(), base=first.as_uri(), lazy=True).result()
    with fastckpt.open(second) as r:
        assert r.stored_names() == ["lora.A", "opt.scale", "step"]
    _assert_same(fastckpt.load(second), state)
    with pytest.raises(TypeError, match="snapshots"):
        remote.save(state, (tmp_path / "2.safetensors").as_uri(), snapshots=False)
