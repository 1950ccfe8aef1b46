"""What kind of claim a report row makes: the one thing a baseline compare judges it by.

A row's value is what one machine measured; what the harness *claims* is that the value meets its
bound. Another machine (CI's, a user's) rounds differently, so comparing values across machines
reports drift that means nothing (issue 23: 11 false regressions on untouched code). Every row
therefore says which kind of claim it is, and `mrh report compare` judges each kind by what the
claim is, not by the value:

  exact     the value must be exactly ideal (bit-equal tensors, 0 bytes, 0 violations). A
            regression: the outcome flips to failed, or the bound is loosened.
  bounded   a measured figure under a bound with a documented origin (logprob |Δ| <= 1e-5). A
            regression: the row is past its own bound, or the bound is loosened. A drift inside
            the bound is counted, never a regression.
  control   a negative control's separation: its worst metric's distance from a perfect match in
            units of the bound, which must stay >= SENSITIVITY_MARGIN (3). A regression: the margin
            falls below that, or the required multiple is lowered.
  timing    a wall time: reported and trended, never gating (speed lives in `mrh bench`).
  observed  a figure recorded for the record with no claim of its own: a variant's metrics on its
            wrong path (its claim is the control row), a loop's per-iteration reward. Listed when it
            changes, never gating.
"""
from __future__ import annotations

CLAIMS = ("exact", "bounded", "control", "timing", "observed")
GATING = ("exact", "bounded", "control")  # judged by outcome and bound in a compare
STRENGTH = {"exact": 2, "bounded": 1, "control": 1, "timing": 0, "observed": 0}


class ClaimError(ValueError):
    """A row with no claim, or one that is not in CLAIMS."""


def check(claim: object) -> str:
    if claim not in CLAIMS:
        raise ClaimError(f"a report row must say what it claims: one of {', '.join(CLAIMS)}, got {claim!r} "
                         "(harness.report.claims)")
    return claim  # type: ignore[return-value]


def of_bound(limit: float | None, ideal: float = 0.0) -> str:
    """The claim of a value held to `limit`: exact when the bound allows nothing but `ideal`."""
    if limit is None:
        return "observed"
    return "exact" if limit == ideal else "bounded"


def weakened(before: str, after: str) -> bool:
    """`after` claims less than `before` (exact -> bounded, anything gating -> not gating)."""
    return STRENGTH[after] < STRENGTH[before]


def infer_legacy(row: dict) -> str:
    """The claim of a row from a results.json written before rows said (schema 1): wall times are
    timings, separations controls, rows without a bound observations, a failed row whose test
    passed a variant's wrong path, a bound of 0 exact, anything else bounded."""
    metric = str(row.get("metric", ""))
    if metric.endswith("_s") or "_s_" in metric:
        return "timing"
    if metric == "separation":
        return "control"
    if row.get("tolerance") is None:
        return "observed"
    if not row.get("passed") and row.get("outcome") == "passed":
        return "observed"
    return "exact" if row.get("tolerance") == 0 else "bounded"
