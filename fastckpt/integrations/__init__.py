"""Integrations of fastckpt with other frameworks' checkpointing (torch.distributed.checkpoint)."""
