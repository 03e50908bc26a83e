"""What fastckpt does with damaged files: a flipped bit in the header, a crashed writer's
temporary file, and a torch.save file handed to fastckpt.load.

Run: python examples/damaged_files.py [WORK_DIR]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

import fastckpt
from fastckpt.cli.verify import verify_file

# without an argument, a scratch folder that is removed when the run ends
_scratch = None if len(sys.argv) > 1 else tempfile.TemporaryDirectory()
work = sys.argv[1] if _scratch is None else _scratch.name
path = os.path.join(work, "ckpt.safetensors")
state = {"model": {"w": torch.randn(4, 4)}, "param_groups": [{"lr": 0.1}], "epoch": 3}
fastckpt.save(state, path)

# 1. One bit flipped in the header (here: lr 0.1 becomes 0.3): refused, never loaded.
with open(path, "r+b") as f:
    header = f.read(4096)
    at = header.index(b"0.1")
    f.seek(at + 2)
    f.write(b"3")
try:
    fastckpt.load(path)
except fastckpt.HeaderError as exc:
    print("damaged header refused:", "checksum" in str(exc))
print("verify says:", verify_file(path).status)

# 2. A writer killed mid-save leaves a temporary file; the next save to the path removes it.
fastckpt.save(state, path)
stale = path + ".0123456789ab.tmp"
open(stale, "wb").close()
fastckpt.save(state, path)
print("stale temporary removed:", not os.path.exists(stale))

# 3. A torch.save file: a clear error that points to `fastckpt convert`.
pt = os.path.join(work, "model.pt")
torch.save(state, pt)
try:
    fastckpt.load(pt)
except fastckpt.HeaderError as exc:
    print("torch.save file recognised:", "fastckpt convert" in str(exc))
