"""The Lightning package in use: the unified ``lightning`` first, else the standalone
``pytorch_lightning``; an ImportError that names the extra to install otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING

#: The standalone package's CheckpointIO module, where the unified package is the one used.
_OTHER_CHECKPOINT_IO: str | None
if TYPE_CHECKING:  # checked against the unified package; the standalone one has its interface
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
else:
    try:  # the unified package first, then the standalone one
        import lightning.pytorch as pl
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.callbacks import ModelCheckpoint

        _OTHER_CHECKPOINT_IO = "lightning_fabric.plugins.io.checkpoint_io"
    except ImportError:
        try:
            import pytorch_lightning as pl
            from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
            from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
            from pytorch_lightning.callbacks import ModelCheckpoint

            _OTHER_CHECKPOINT_IO = None
        except ImportError as exc:
            raise ImportError(
                "fastckpt.lightning needs Lightning (the 'lightning' or 'pytorch_lightning' "
                "package); install it with: pip install lightning (or, in a clone of fastckpt, pip install '.[lightning]')"
            ) from exc

__all__ = ["CheckpointIO", "ModelCheckpoint", "TorchCheckpointIO", "pl"]
