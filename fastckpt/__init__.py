"""fastckpt: PyTorch checkpoints at the speed of the storage device."""

from fastckpt.errors import ChecksumError, EngineUnavailableError, FastCkptError, HeaderError

__all__ = ["FastCkptError", "HeaderError", "ChecksumError", "EngineUnavailableError"]
__version__ = "0.1.0"
