"""The series of checkpoints of a training run: one directory per step, committed by a
marker written last, kept per retention policy, in a fast tier and a durable one.

:class:`~fastckpt.series.manager.CheckpointManager` is the entry point; :mod:`.steps` is the
on-disk layout (step directories, commit markers) and :mod:`.retention` decides which
steps stay.
"""
