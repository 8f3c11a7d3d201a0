"""Attention data parallelism + MoE expert parallelism over the contract's collectives."""
