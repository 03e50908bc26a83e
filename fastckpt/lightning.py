"""fastckpt for Lightning: ``FastCkptIO``, ``AsyncFastCkptIO``, ``FastCkptCheckpoint`` and
``load_from_checkpoint``.

Needs ``lightning`` (or ``pytorch_lightning``): ``pip install "fastckpt[lightning]"``.
See :mod:`fastckpt.integrations.lightning` for what is stored and how.

Example:
    >>> from fastckpt.lightning import FastCkptCheckpoint
    >>> callback = FastCkptCheckpoint(dirpath="/tmp/fastckpt-ckpts", every_n_train_steps=500)
"""

from fastckpt.integrations.lightning import (
    AsyncFastCkptIO,
    FastCkptCheckpoint,
    FastCkptIO,
    load_from_checkpoint,
)

__all__ = ["FastCkptIO", "AsyncFastCkptIO", "FastCkptCheckpoint", "load_from_checkpoint"]
