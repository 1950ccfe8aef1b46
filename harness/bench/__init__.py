"""Benchmarks that print figures (`mrh bench ...`)."""
