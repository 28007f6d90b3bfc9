"""Least-squares lines and medians for the measurements: plain Python, no torch."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    intercept: float
    slope: float
    residual: float  # root-mean-square of the relative residuals (0.05: the points sit 5 % off the line)


def median(values) -> float:
    return float(statistics.median(values))


def fit_line(xs, ys, relative: bool = False) -> Line:
    """y = intercept + slope * x by least squares. `relative`: minimise relative residuals
    (each point weighted 1/y), so points of very different size (1 KB and 64 MB messages)
    count alike and the intercept is not lost in the large points' noise."""
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"a line needs points at two x values at least, got x = {xs}")
    weights = [1.0 / (y * y) if relative and y > 0 else 1.0 for y in ys]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys)) / total
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs))
    sxy = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    return Line(intercept, slope, relative_rms(xs, ys, intercept, slope))


def relative_rms(xs, ys, intercept: float, slope: float) -> float:
    """How far the points sit from the line, as a fraction of each point's value."""
    errors = [(intercept + slope * x - y) / y for x, y in zip(xs, ys) if y != 0]
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0


def spread(values) -> float:
    """Relative spread of repeated samples: (upper - lower quartile) / median."""
    values = sorted(values)
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4)
    mid = statistics.median(values)
    return (quartiles[2] - quartiles[0]) / mid if mid else 0.0
