"""Durations as settings write them: '90s', '30m', '6h', '2d' or a bare number of seconds."""
from __future__ import annotations

from ftbench.errors import ConfigError


def parse_duration(text: str, setting: str) -> float:
    """'90s', '30m', '6h', '2d' or a bare number of seconds -> seconds."""
    units = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
    raw = str(text).strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if raw.endswith(suffix):
            number = raw[: -len(suffix)]
            break
    else:
        suffix, number = "s", raw
    try:
        seconds = float(number) * units[suffix]
    except ValueError:
        raise ConfigError(setting, f"'{text}' is not a duration",
                          "write a number with a unit, e.g. 30m, 6h or 1d") from None
    if seconds <= 0:
        raise ConfigError(setting, f"'{text}' is not positive", "give a period above zero, e.g. 6h")
    return seconds
