"""Parity checks between HF and Megatron: metrics, the tolerance table, the checks built on them."""
