"""fastckpt for Lightning: ``FastCkptIO``, ``AsyncFastCkptIO``, ``FastCkptCheckpoint``,
``load_from_checkpoint`` and ``FastCkptLoadingMixin``.

Needs ``lightning`` (or ``pytorch_lightning``): ``pip install lightning`` (or ``pip install ".[lightning]"`` in a clone).
See :mod:`fastckpt.integrations.lightning` for what is stored and how.

Example:
    >>> from fastckpt.lightning import FastCkptCheckpoint
    >>> callback = FastCkptCheckpoint(dirpath="/tmp/fastckpt-ckpts", every_n_train_steps=500)
"""

from fastckpt.integrations.lightning import (
    AsyncFastCkptIO,
    CheckpointNotFoundError,
    FastCkptCheckpoint,
    FastCkptIO,
    FastCkptLoadingMixin,
    load_from_checkpoint,
)

__all__ = [
    "FastCkptIO",
    "AsyncFastCkptIO",
    "FastCkptCheckpoint",
    "FastCkptLoadingMixin",
    "CheckpointNotFoundError",
    "load_from_checkpoint",
]
