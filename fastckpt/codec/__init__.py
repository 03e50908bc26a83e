"""Lossless compression of tensor bytes: byte planes for floating point, zstd for the rest.

:mod:`fastckpt.codec.frames` compresses one tensor's bytes into a frame (layout in
:mod:`fastckpt.format.compressed`) on every core and decompresses it back, checking sizes
and checksums; :mod:`fastckpt.codec.byteplane` splits elements into byte planes. Needs the
``zstandard`` package (``pip install 'fastckpt-io[compress]'``; in a clone,
``pip install '.[compress]'``), imported only when used.
"""
