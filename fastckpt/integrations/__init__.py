"""Adapters that bring fastckpt to other frameworks' checkpointing: Lightning and
torch.distributed.checkpoint."""
