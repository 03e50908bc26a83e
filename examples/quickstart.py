"""Save a training state, load it back, read single tensors lazily, save in the background.

Run: python examples/quickstart.py [DIRECTORY]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

import fastckpt


def main(directory: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()

    path = os.path.join(directory, "train-state.safetensors")
    fastckpt.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)
    state = fastckpt.load(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    print(f"epoch {state['epoch']}: restored {len(state['model'])} model tensors")

    with fastckpt.open(path) as reader:
        info = reader.info("model/0.weight")
        print(f"model/0.weight: {info.dtype} {info.shape} at byte {info.offset}")
        print("checksums intact:", reader.verify() == [])

    future = fastckpt.async_save(model.state_dict(), os.path.join(directory, "weights.safetensors"))
    model[0].weight.data.zero_()  # safe: the snapshot was taken before async_save returned
    future.result()
    weights = fastckpt.load(os.path.join(directory, "weights.safetensors"))
    print("background save kept the old weights:", bool(weights["0.weight"].abs().sum() > 0))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
