"""Read part of a tensor, verified: only the checksummed pieces covering it are read.

Run: python examples/partial_reads.py [DIRECTORY]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

import fastckpt


def main(directory: str) -> None:
    path = os.path.join(directory, "embeddings.safetensors")
    table = torch.randn(32_768, 256)  # 32 MiB: 8 checksummed pieces of 4 MiB
    fastckpt.save({"embeddings": table}, path)

    with fastckpt.open(path) as reader:
        # rows 4096-8191 are exactly piece 1: 4 MiB read, not 32
        rows = reader.get_slice("embeddings", verify=True)[4096:8192]
        print(f"rows identical: {torch.equal(rows, table[4096:8192])}")
        print(f"read {reader.bytes_read >> 20} MiB of {os.path.getsize(path) >> 20} MiB")

        # a byte range into memory you own (here: one row), verified piece by piece
        row = torch.empty(256)
        reader.read_range("embeddings", 100 * 1024, 101 * 1024, out=row, verify=True)
        print(f"row identical: {torch.equal(row, table[100])}")

    # damage one byte in piece 5: reads of other pieces still succeed, reads of it fail
    with fastckpt.open(path) as reader:
        offset = reader.info("embeddings").offset + 5 * (4 << 20) + 10
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x00\x00\x00\x00")
    with fastckpt.open(path) as reader:
        rows = reader.get_slice("embeddings", verify=True)[:4096]
        print(f"undamaged piece still reads: {torch.equal(rows, table[:4096])}")
        try:
            reader.get_slice("embeddings", verify=True)[20_480:20_481]
        except fastckpt.ChecksumError as exc:
            print(f"damaged piece refused: {'piece 5 of 8' in str(exc)}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:  # a scratch folder that goes away with the run
        with tempfile.TemporaryDirectory() as scratch:
            main(scratch)
