"""Sharded checkpoints in the Hugging Face convention, and interop with transformers and
huggingface_hub both ways (tiny models built locally: no network)."""

from __future__ import annotations

import errno
import json
import os
import uuid

import pytest

torch = pytest.importorskip("torch")

import fastckpt  # noqa: E402
from fastckpt import format  # noqa: E402
from fastckpt.integrations import hf_shards, hf_shards_read  # noqa: E402

INDEX = "model.safetensors.index.json"


def _state(n: int = 6, numel: int = 1000) -> dict:
    torch.manual_seed(1)
    return {f"layers.{i}.weight": torch.randn(numel) for i in range(n)}


def _header(path) -> format.Header:
    with open(path, "rb") as f:
        first = f.read(8)
        size = os.fstat(f.fileno()).st_size
        n = format.parse_header_length(first, size)
        return format.parse_header(f.read(n), size)


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2KB", 2000),
        ("1.5GiB", 3 * 2**29),
        ("64MiB", 64 * 2**20),
        (12345, 12345),
    ],
)
def test_parse_shard_size(text, expected):
    assert hf_shards.parse_shard_size(text) == expected


@pytest.mark.parametrize("bad", ["5 parsecs", "", "GB", -1, 0, 1.5, True])
def test_parse_shard_size_rejects(bad):
    with pytest.raises((ValueError, TypeError)):
        hf_shards.parse_shard_size(bad)


def test_plan_shards_rules():
    w = torch.zeros(100)  # 400 bytes
    state = {
        "a": w,
        "b": torch.zeros(100),
        "huge": torch.zeros(1000),  # over the limit: a shard of its own
        "c": torch.zeros(50),
        "tied": w,  # shares a's storage: a's shard
        "view": w[:10],  # a view of a's storage: a's shard
    }
    # as huggingface_hub: an oversized tensor is closed off at once, before the running shard;
    # a, tied and view are stored as three copies, 840 bytes, over the limit together
    assert hf_shards.plan_shards(state, 800) == [["a", "tied", "view"], ["huge"], ["b", "c"]]
    del state["view"]
    assert hf_shards.plan_shards(state, 800) == [["a", "tied"], ["huge"], ["b", "c"]]


def test_tied_copies_count_toward_the_shard_size(tmp_path):
    """Each shard's tensor bytes stay within max_shard_size, its tied copies included."""
    state = {f"layers.{i}.weight": torch.randn(250_000) for i in range(4)}  # 1 MB each
    state["lm_head.weight"] = state["layers.0.weight"]  # tied: stored a second time
    fastckpt.save(state, tmp_path, max_shard_size="3MB")
    index = json.loads((tmp_path / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    for name in shards:
        header = _header(tmp_path / name)
        assert header.data_size <= 3 * 10**6, (name, header.data_size, sorted(header.entries))
    assert index["metadata"]["total_size"] == 5 * 10**6
    back = fastckpt.load(tmp_path)
    assert back["lm_head.weight"] is back["layers.0.weight"]


# --------------------------------------------------------------------------- local directories


def test_round_trip_local(tmp_path):
    state = _state()
    state["tied"] = state["layers.1.weight"]
    fastckpt.save(state, tmp_path, max_shard_size="10KB", metadata={"run": "7"})
    names = sorted(os.listdir(tmp_path))
    # layers.1 and its tied copy fill a shard of 8000 bytes: 4 shards, none over 10 KB
    assert names == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)] + [INDEX]
    index = json.loads((tmp_path / INDEX).read_text())
    # the tied name is stored as a copy (readers without aliases see every key): 7 tensors
    assert index["metadata"] == {"run": "7", "total_size": 7 * 4000}
    assert index["weight_map"]["tied"] == index["weight_map"]["layers.1.weight"]
    assert set(index["weight_map"].values()) == set(names[:-1])
    for name in names[:-1]:
        header = _header(tmp_path / name)
        assert header.data_offset % 4096 == 0  # each shard is laid out for direct I/O
        assert header.metadata["run"] == "7"
    back = fastckpt.load(tmp_path)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert back["tied"] is back["layers.1.weight"]
    # the index written last: no shard is newer than it
    index_time = (tmp_path / INDEX).stat().st_mtime_ns
    assert all((tmp_path / n).stat().st_mtime_ns <= index_time for n in names[:-1])


def test_load_index_path_keys_and_open(tmp_path):
    state = _state()
    fastckpt.save(state, str(tmp_path), max_shard_size="10KB")
    part = fastckpt.load(str(tmp_path / INDEX), keys=["layers.5.weight", "layers.0.weight"])
    assert list(part) == ["layers.5.weight", "layers.0.weight"]
    assert torch.equal(part["layers.5.weight"], state["layers.5.weight"])
    # keys= reads only the shards that hold them: the others may even be gone
    index = json.loads((tmp_path / INDEX).read_text())
    (tmp_path / index["weight_map"]["layers.2.weight"]).unlink()
    assert list(fastckpt.load(tmp_path, keys=["layers.0.weight"])) == ["layers.0.weight"]
    with pytest.raises(FileNotFoundError):
        fastckpt.load(tmp_path)
    fastckpt.save(state, str(tmp_path), max_shard_size="10KB")
    with fastckpt.open(tmp_path) as reader:
        assert reader.keys() == list(state)
        assert reader.metadata() == {"total_size": str(6 * 4000)}
        got = reader.get_tensors(["layers.4.weight", "layers.0.weight"], verify=True)
        assert torch.equal(got["layers.4.weight"], state["layers.4.weight"])
        with pytest.raises(KeyError, match="nope"):
            reader.get_tensor("nope")


def test_resave_removes_stale_shards(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    fastckpt.save(_state(), tmp_path, max_shard_size="10KB")
    fastckpt.save(_state(2), tmp_path, max_shard_size="10KB")  # one shard now
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert list(fastckpt.load(tmp_path)) == ["layers.0.weight", "layers.1.weight"]


def test_failed_shard_writes_no_index(tmp_path):
    state = _state()
    state["layers.4.weight"] = torch.zeros(3, device="meta")
    with pytest.raises(TypeError):
        fastckpt.save(state, tmp_path, max_shard_size="10KB")
    assert INDEX not in os.listdir(tmp_path)


def test_errors_name_the_place(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
        fastckpt.load(tmp_path)
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    with pytest.raises(fastckpt.HeaderError, match="not a file name"):
        fastckpt.load(tmp_path)
    (tmp_path / INDEX).write_text("{not json")
    with pytest.raises(fastckpt.HeaderError, match="not a JSON index"):
        fastckpt.load(tmp_path)
    with pytest.raises(TypeError, match="flat str -> Tensor"):
        fastckpt.save({"nested": {"w": torch.ones(1)}}, tmp_path / "x", max_shard_size="1KB")


def test_round_trip_memory_url():
    url = f"memory://shards-{uuid.uuid4().hex}/model"
    state = _state()
    fastckpt.save(state, url, max_shard_size="10KB")
    back = fastckpt.load(url)
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    with fastckpt.open(url + "/" + INDEX) as reader:
        assert torch.equal(reader.get_tensor("layers.3.weight"), state["layers.3.weight"])


# --------------------------------------------------------------------------- interop


def test_huggingface_hub_reads_ours_and_we_read_theirs(tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = _state(8, 3000)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    fastckpt.save(state, ours, max_shard_size="30KB")
    # their loader, shard by shard through the index
    index = json.loads((ours / INDEX).read_text())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(safetensors_torch.load_file(ours / shard))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    model = torch.nn.Module()
    for i in range(8):
        model.register_buffer(f"b{i}", torch.zeros(3000))
    renamed = {f"b{i}": state[f"layers.{i}.weight"] for i in range(8)}
    fastckpt.save(renamed, tmp_path / "module", max_shard_size="30KB")
    hub.load_torch_model(model, tmp_path / "module")
    assert all(torch.equal(getattr(model, k), v) for k, v in renamed.items())
    # theirs, read by us
    theirs.mkdir()
    hub.save_torch_state_dict(state, theirs, max_shard_size="30KB")
    assert (theirs / INDEX).is_file()
    back = fastckpt.load(theirs)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _tiny_bert(transformers):
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def _assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_transformers_loads_fastckpt_directory(tmp_path, transformers):
    model = _tiny_bert(transformers)
    model.config.save_pretrained(tmp_path)
    fastckpt.save(model.state_dict(), tmp_path, max_shard_size="20KB")
    assert (tmp_path / INDEX).is_file()
    again = transformers.AutoModel.from_pretrained(tmp_path)
    _assert_same_model(model, again)


def test_fastckpt_loads_save_pretrained_directory(tmp_path, transformers):
    model = _tiny_bert(transformers)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / INDEX).is_file()
    back = fastckpt.load(tmp_path)
    expected = model.state_dict()
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)
    with fastckpt.open(tmp_path) as reader:
        assert sorted(reader.keys()) == sorted(expected)


def test_tied_weights_round_trip_through_transformers(tmp_path, transformers):
    config = transformers.GPT2Config(
        vocab_size=100,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    model.config.save_pretrained(tmp_path)
    fastckpt.save(state, tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / INDEX).read_text())
    # every key, the tied one too, for readers that follow the index (transformers' own
    # indexes leave it out; from_pretrained reads both)
    assert index["weight_map"].keys() == state.keys()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_same_model(model, again)
    back = fastckpt.load(tmp_path)
    assert back["lm_head.weight"] is back["transformer.wte.weight"]


def test_directory_without_max_shard_size_gets_one_model_safetensors(tmp_path):
    fastckpt.save({"w": torch.ones(2)}, tmp_path)  # shards only when max_shard_size asks
    assert os.listdir(tmp_path) == ["model.safetensors"]


# --------------------------------------------------------------------------- reading follows the index


def _two_shards_with_stale_bytes(directory) -> dict:
    """A directory whose index maps a -> shard 1 and b -> shard 2, where shard 2 also holds an
    older ``a`` and a tensor the index does not name (left by an earlier save)."""
    directory.mkdir(exist_ok=True)
    fresh = {"a": torch.ones(4), "b": torch.full((4,), 2.0)}
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    fastckpt.save({"a": fresh["a"]}, str(directory / first))
    fastckpt.save(
        {"a": torch.zeros(4), "b": fresh["b"], "stale": torch.ones(2)}, str(directory / second)
    )
    index = {"metadata": {"total_size": 32}, "weight_map": {"a": first, "b": second}}
    (directory / INDEX).write_text(json.dumps(index))
    return fresh


def test_load_and_open_follow_the_index(tmp_path):
    fresh = _two_shards_with_stale_bytes(tmp_path)
    loaded = fastckpt.load(tmp_path)
    assert list(loaded) == ["a", "b"]  # no "stale", and "a" from the shard the index names
    assert torch.equal(loaded["a"], fresh["a"]) and torch.equal(loaded["b"], fresh["b"])
    with fastckpt.open(tmp_path) as reader:
        assert reader.keys() == ["a", "b"]
        assert torch.equal(reader.get_tensor("a"), fresh["a"])
        with pytest.raises(KeyError, match="stale"):
            reader.get_tensor("stale")


@pytest.mark.parametrize(
    "document",
    ["[]", "not json", '{"weight_map": []}', '{"weight_map": {"a": "x"}, "metadata": "m"}'],
)
def test_a_malformed_index_is_a_header_error(tmp_path, document):
    _two_shards_with_stale_bytes(tmp_path)
    (tmp_path / INDEX).write_text(document)
    with pytest.raises(fastckpt.HeaderError, match=INDEX):
        fastckpt.open(tmp_path)
    with pytest.raises(fastckpt.HeaderError, match=INDEX):
        fastckpt.load(tmp_path)


def test_an_index_naming_a_tensor_its_shard_lacks_is_a_header_error(tmp_path):
    _two_shards_with_stale_bytes(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"]["c"] = index["weight_map"]["a"]
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(fastckpt.HeaderError, match="lacks tensor 'c'"):
        fastckpt.open(tmp_path)


def test_opening_a_url_directory_keeps_the_read_options():
    """A URL of a directory (no trailing slash, no index name) falls back to the sharded
    reader with the options it was given, as load does."""
    url = f"memory://shards-{uuid.uuid4().hex[:8]}/run"
    fastckpt.save(_state(), url + "/", max_shard_size="10KB")
    with fastckpt.open(url, part_size=1 << 20, parallel=3) as reader:
        assert isinstance(reader, hf_shards.ShardedReader)
        shards = list(reader._readers.values())
        assert len(shards) > 1
        options = {
            reader._cache.call(h.key, lambda r: (r.storage.part_size, r.storage.parallel))
            for h in shards
        }
        assert options == {(1 << 20, 3)}
        assert reader.read_mode == "ranged"


def test_a_reader_whose_set_was_replaced_while_opening_opens_the_new_set(tmp_path, monkeypatch):
    """A save removes the old set's shards once its own index is published; a reader that had
    just read the old index finds a shard gone, and opens the set the new index names."""
    first = {"a": torch.zeros(2048), "b": torch.zeros(2048)}
    second = {"a": torch.ones(2048), "b": torch.ones(2048)}
    fastckpt.save(first, tmp_path, max_shard_size="8KB")
    old_index = (tmp_path / hf_shards.INDEX_NAME).read_bytes()
    fastckpt.save(second, tmp_path, max_shard_size="8KB")  # the first set's shards are gone
    real_read = hf_shards_read._read_index_document
    calls = []

    def read_old_index_first(index, storage_options):
        calls.append(index)
        if len(calls) == 1:  # what a reader saw just before the second save was published
            document = json.loads(old_index)
            return document["weight_map"], document.get("metadata", {})
        return real_read(index, storage_options)

    monkeypatch.setattr(hf_shards_read, "_read_index_document", read_old_index_first)
    loaded = fastckpt.load(tmp_path)
    assert len(calls) == 2
    assert all(torch.equal(loaded[k], second[k]) for k in second)


def test_a_set_missing_a_shard_still_fails_naming_it(tmp_path):
    fastckpt.save({"a": torch.zeros(2048), "b": torch.ones(2048)}, tmp_path, max_shard_size="8KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        fastckpt.load(tmp_path)


# --------------------------------------------------------------------------- another tool's files


def _listing(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize("shard_size", ["20KB", None])
@pytest.mark.parametrize("how", ["save", "sharded", "async_save"])
def test_a_save_never_replaces_save_pretrained_files(tmp_path, transformers, shard_size, how):
    """save, a sharded save and async_save into a directory holding save_pretrained's
    checkpoint (shards and index, or one model.safetensors) refuse, naming the files, and
    leave every byte of it; a file path in the directory is written beside them."""
    model = _tiny_bert(transformers)
    if shard_size is None:
        model.save_pretrained(tmp_path)
        assert (tmp_path / "model.safetensors").is_file()
    else:
        model.save_pretrained(tmp_path, max_shard_size=shard_size)
        assert (tmp_path / INDEX).is_file()
    before = _listing(tmp_path)
    lora = {"lora.A": torch.randn(8, 32)}
    with pytest.raises(FileExistsError) as refused:
        if how == "save":
            fastckpt.save(lora, str(tmp_path))
        elif how == "sharded":
            fastckpt.save(lora, tmp_path, max_shard_size="1MB")
        else:
            fastckpt.async_save(lora, f"{tmp_path}/").result()
    message = str(refused.value)
    assert "fastckpt did not write" in message
    first = INDEX if shard_size else "model.safetensors"
    assert first in message and refused.value.filename == str(tmp_path / first)
    assert refused.value.errno == errno.EEXIST
    assert _listing(tmp_path) == before  # nothing replaced, removed or left behind

    fastckpt.save(lora, tmp_path / "adapter.safetensors")  # beside them: fine
    assert transformers.AutoModel.from_pretrained(tmp_path) is not None
    assert {**before, "adapter.safetensors": b""}.keys() == _listing(tmp_path).keys()


def test_a_save_replaces_its_own_checkpoint_in_a_directory(tmp_path):
    """fastckpt's own sets (a sharded one, then one file, then sharded again) are replaced."""
    fastckpt.save(_state(), tmp_path, max_shard_size="10KB")
    fastckpt.save({"only": torch.ones(3)}, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    fastckpt.save(_state(), tmp_path, max_shard_size="10KB")
    assert INDEX in os.listdir(tmp_path) and "model.safetensors" not in os.listdir(tmp_path)
    assert hf_shards.foreign_files(str(tmp_path)) == []
