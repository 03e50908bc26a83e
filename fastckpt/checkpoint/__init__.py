"""The checkpoint layer: objects <-> named tensors and JSON (``tree``), and the save, read,
load and asynchronous paths, written once over :mod:`fastckpt.storage` (wherever the bytes
live), :mod:`fastckpt.io` and :mod:`fastckpt.format`. ``reader`` defines the one
:class:`~fastckpt.checkpoint.reader.Reader` type that ``fastckpt.open`` returns."""
