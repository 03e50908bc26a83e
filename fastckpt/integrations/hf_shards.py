"""Sharded checkpoints in the Hugging Face convention: shards plus ``model.safetensors.index.json``.

``fastckpt.save(state_dict, directory, max_shard_size="5GB")`` writes::

    directory/model-00001-of-00003.safetensors
    directory/model-00002-of-00003.safetensors
    directory/model-00003-of-00003.safetensors
    directory/model.safetensors.index.json   {"metadata": {"total_size": ...}, "weight_map": {...}}

as ``transformers``' ``save_pretrained`` and ``huggingface_hub``'s ``save_torch_state_dict``
do, so each reads what the other writes. A state dict that fits in one shard is written as
``directory/model.safetensors`` alone, as they do too. Sizes are decimal (``"5GB"`` is
5 * 10**9 bytes, as ``huggingface_hub`` counts); ``"5GiB"`` means 5 * 2**30.

Sharding: tensors are taken in the state dict's order and a new shard starts when the next
one would overflow the limit; a tensor larger than the limit gets a shard of its own;
tensors sharing storage (tied weights) go to one shard, where the file stores them under each
name (so safetensors readers see every key; each copy counts toward the shard's size) and
fastckpt reads them once, tied again.

Each shard is a fastckpt file (aligned for direct I/O, with checksums), written in parallel
under a temporary name; once every shard is durable the set is published in one atomic step
(:mod:`fastckpt.io.commit_set`): the index, written last, or the rename of a lone
``model.safetensors``. A reader finds the old set or the new one, never a mix, and a failed
save leaves the old set unchanged. Into a directory that holds no checkpoint the shards get
Hugging Face's names; over an existing one they get names its index does not reference
(``model-00001-of-00003-<8 hex>.safetensors``; every reader follows the index). Files of
the earlier set are removed after the publish step.

``fastckpt.load(directory)`` (or the index file's path) returns one flat dict of the tensors
the index names, each read from the shard the index names, shards in parallel;
``fastckpt.open(directory)`` gives a :class:`ShardedReader`, the one
:class:`~fastckpt.Reader` type over a reader per shard, reading tensors lazily. Both take the
directories that ``transformers`` and ``huggingface_hub`` write. The directory may be a URL
(see :mod:`fastckpt.integrations.remote`).

The parts live beside this module, which gathers their public names:
:mod:`~fastckpt.integrations.hf_shards_plan` (file names, shard sizes, which tensors go to
which shard, the index's content), :mod:`~fastckpt.integrations.hf_shards_files` (which files
of a directory the published set references, and whether fastckpt wrote them),
:mod:`~fastckpt.integrations.hf_shards_write` (writing and publishing a set) and
:mod:`~fastckpt.integrations.hf_shards_read` (the index read and checked,
:class:`ShardedReader`).

Example:
    >>> import os, tempfile, torch, fastckpt
    >>> directory = tempfile.mkdtemp()
    >>> state = {f"layer{i}.weight": torch.full((256,), float(i)) for i in range(4)}
    >>> fastckpt.save(state, directory, max_shard_size="2KB")
    >>> sorted(os.listdir(directory))[:2]
    ['model-00001-of-00004.safetensors', 'model-00002-of-00004.safetensors']
    >>> fastckpt.load(directory)["layer3.weight"][0].item()
    3.0
"""

from __future__ import annotations

from fastckpt.integrations.hf_shards_files import (
    foreign_files,
    refuse_foreign_files,
    retire_sharded_set,
)
from fastckpt.integrations.hf_shards_plan import _SHARD_PATTERN as _SHARD_PATTERN
from fastckpt.integrations.hf_shards_plan import DEFAULT_PARALLEL as DEFAULT_PARALLEL
from fastckpt.integrations.hf_shards_plan import (
    INDEX_NAME,
    WEIGHTS_NAME,
    parse_shard_size,
    plan_shards,
)
from fastckpt.integrations.hf_shards_plan import _belongs as _belongs
from fastckpt.integrations.hf_shards_read import (
    ShardedReader,
    is_sharded,
    load_sharded,
    open_sharded,
)
from fastckpt.integrations.hf_shards_write import save_sharded

__all__ = [
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "foreign_files",
    "refuse_foreign_files",
    "retire_sharded_set",
    "ShardedReader",
    "is_sharded",
    "load_sharded",
    "open_sharded",
    "parse_shard_size",
    "plan_shards",
    "save_sharded",
]
