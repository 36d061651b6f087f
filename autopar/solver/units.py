"""Sizes and times as people write and read them: "40GB" -> bytes, bytes -> "30.5 GiB",
seconds -> "14.10 ms"."""
from __future__ import annotations

import math
import re

from autopar.errors import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value) -> float:
    """Bytes from a number or a string like "40GB", "512 MiB", "1.5e9"."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"memory budget must be a number of bytes or a string like 40GB, got {value!r}")
    if isinstance(value, (int, float)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"memory budget must be a positive, finite number of bytes, got {value}")
        return float(value)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot read memory size {value!r}; write it like 40GB, 512MiB or 1.5e9")
    try:
        n = float(m.group(1)) * _UNITS[m.group(2).upper()]
    except ValueError:
        raise ConfigError(f"cannot read memory size {value!r}; write it like 40GB, 512MiB or 1.5e9") from None
    if not (math.isfinite(n) and n > 0):
        raise ConfigError(f"memory budget must be positive and finite, got {value!r}")
    return n


def fmt_s(s: float) -> str:
    """Seconds in the unit people read them in: "20.08 s", "14.10 ms", "305.0 us"."""
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_bytes(n: float) -> str:
    """Bytes in binary units: "30.5 GiB", "4.1 TiB", "512 B"."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"
