"""Checkpoints at URLs and in Hugging Face shards.

A URL goes through fsspec: ``memory://`` here, ``s3://bucket/key`` with ``pip install s3fs``
(or ``pip install '.[s3]'`` in the clone) (credentials and endpoint in ``storage_options=`` or the environment).
A directory with ``max_shard_size=`` gets ``model-0000i-of-0000N.safetensors`` shards plus
``model.safetensors.index.json``, which transformers' ``from_pretrained`` also reads.

Run: python examples/remote_and_shards.py [DIRECTORY]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

import fastckpt


def main(directory: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    state = {"model": model.state_dict(), "step": 100}

    # 1. A URL: streamed out (header first, bounded memory), complete or absent.
    url = "memory://checkpoints/run1/step100.safetensors"
    fastckpt.save(state, url, metadata={"run": "run1"})
    back = fastckpt.load(url)
    same = all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
    print(f"step {back['step']} from {url}: identical: {same}")
    bias = fastckpt.load(url, keys=["model/0.bias"])  # fetches only this tensor's bytes
    print(f"partial load: {list(bias)}")

    # 2. Hugging Face shards in a local directory, loaded back in parallel.
    shards = os.path.join(directory, "sharded")
    fastckpt.save(model.state_dict(), shards, max_shard_size="40KB")
    files = sorted(os.listdir(shards))
    print(f"{len(files) - 1} shards + {files[-1]}")
    loaded = fastckpt.load(shards)
    print(
        f"sharded round trip: {all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())}"
    )
    with fastckpt.open(shards) as reader:
        print(f"lazy read of one tensor: {tuple(reader.get_tensor('2.weight').shape)}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:  # a scratch folder that goes away with the run
        with tempfile.TemporaryDirectory() as scratch:
            main(scratch)
