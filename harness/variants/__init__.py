"""The catalog of wrong variants (negative controls, upstream bugs) and `mrh repro`."""
from harness.variants.catalog import (
    CATALOG,
    CHECKS,
    COMPONENTS,
    Variant,
    VariantError,
    for_components,
    get,
    require,
)

__all__ = ["CATALOG", "CHECKS", "COMPONENTS", "Variant", "VariantError", "for_components", "get",
           "require"]
