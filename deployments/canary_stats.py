"""The statistics the canary policy judges with (deployments/rollout_gates): nearest-rank percentiles and the paired
bootstrap bound on a bits-per-byte difference. Pure functions of numbers, seeded, so a verdict can be replayed."""

from __future__ import annotations

import math

BOOTSTRAP_RESAMPLES = 2000


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in (0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def p95(values: list[float]) -> float | None:
    return percentile(values, 0.95)


def paired_upper_bound(deltas: list[list[float]], confidence: float, seed: int) -> tuple[float, float]:
    """(bpb difference, its one-sided upper bound) from a paired bootstrap over requests.

    Each entry is [challenger bits, champion bits, bytes] of one request; the statistic is the byte-weighted
    difference sum(ch - base) / sum(bytes). Resampling whole requests keeps each pair together.
    """
    import numpy as np

    arr = np.asarray(deltas, dtype=np.float64)
    diff, nbytes = arr[:, 0] - arr[:, 1], arr[:, 2]
    point = float(diff.sum() / nbytes.sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(arr), size=(BOOTSTRAP_RESAMPLES, len(arr)))
    stats = diff[idx].sum(axis=1) / nbytes[idx].sum(axis=1)
    return point, float(np.quantile(stats, confidence))
