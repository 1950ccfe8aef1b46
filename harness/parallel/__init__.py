"""Parallel layouts and switching Megatron's model-parallel state inside a live world."""
from harness.parallel.layout import (
    Layout,
    LayoutError,
    enumerate_layouts,
    parse_layout,
    parse_layout_list,
    resolve,
    validate,
)

__all__ = [
    "Layout", "LayoutError", "enumerate_layouts", "parse_layout", "parse_layout_list", "resolve",
    "validate",
]
