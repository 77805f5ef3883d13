"""Benchmarks: fsdp_compose vs torch FSDP2 vs DDP (see README.md)."""
