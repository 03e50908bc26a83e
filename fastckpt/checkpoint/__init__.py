"""The checkpoint layer: objects <-> named tensors and JSON (``tree``), and the save, read,
load and asynchronous paths built on :mod:`fastckpt.io` and :mod:`fastckpt.format`."""
