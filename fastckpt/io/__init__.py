"""The I/O layer: files opened for direct I/O, the executor over the native engines, atomic
commits, aligned and staging memory, streaming checksums, device copies and the cuFile
runtime. It moves bytes; it knows nothing of checkpoints' structure."""
