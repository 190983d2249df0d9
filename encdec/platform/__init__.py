"""The host process: CPU threads, host memory (allocator, huge pages) and host values moved to device tensors."""
