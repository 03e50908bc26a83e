"""The DeepNVMe API: tensor swapping with aio_handle, as DeepSpeed code does it.

Run: python examples/deepnvme.py [DIRECTORY]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from fastckpt.aio import aio_handle, deepspeed_memcpy


def main(directory: str) -> None:
    h = aio_handle(block_size=1 << 20, queue_depth=32, overlap_events=True, intra_op_parallelism=2)
    print(f"engine {h.get_engine()}, block {h.get_block_size()}, depth {h.get_queue_depth()}")

    # Swap out several tensors without blocking, compute, then wait once.
    layers = [torch.randn(256, 256) for _ in range(4)]
    for i, t in enumerate(layers):
        h.async_pwrite(t, os.path.join(directory, f"layer{i}.swp"))
    print("completed writes:", h.wait())

    # Swap back in, into page-locked memory.
    buffers = [h.new_cpu_locked_tensor(t.numel(), t) for t in layers]
    for i, b in enumerate(buffers):
        h.async_pread(b, os.path.join(directory, f"layer{i}.swp"))
    print("completed reads:", h.wait())
    restored = [torch.empty_like(t) for t in layers]
    for dst, src in zip(restored, buffers):
        deepspeed_memcpy(dst, src.view(dst.shape))
    print("identical:", all(torch.equal(a, b) for a, b in zip(layers, restored)))
    for b in buffers:
        h.free_cpu_locked_tensor(b)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
