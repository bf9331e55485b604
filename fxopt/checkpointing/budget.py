"""What `memory_budget` may be, parsed: a fraction of the step's peak, or a size with a unit."""
from __future__ import annotations

import math
import re
from typing import NamedTuple

from ..errors import FxoptError

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)?\s*$", re.IGNORECASE)


def parse_budget(value) -> tuple[str, float]:
    """("fraction", f) for a number in (0, 1] (1 and 1.0 alike); ("bytes", n) for a size with a unit ("512MB").

    A bare number is always a fraction of the captured step's peak: bytes need a unit, so that
    `1` cannot silently mean one byte.
    """
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is not None and match.group(2) is None:
            return parse_budget(float(match.group(1)))
        if match is None or match.group(2).lower() not in _UNITS:
            raise FxoptError(f"memory_budget {value!r} is not a size; write it like '512MB' or '1.5GiB'")
        size = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if size < 1:
            raise FxoptError(f"memory_budget {value!r} must be at least one byte")
        return "bytes", size
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FxoptError(f"memory_budget must be a fraction in (0, 1] or a size with a unit such as '512MB', "
                         f"got {type(value).__name__}")
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise FxoptError(f"memory_budget {value} is not a fraction in (0, 1]; give bytes with a unit, e.g. '512MB'")
    return "fraction", float(value)


class KeptBytes(NamedTuple):
    """Bytes training graphs keep for backward from the end of their forward: as eager keeps them, and as their
    plans keep them (fxopt/frontends/step_memory.py: the graphs of a step split by graph breaks)."""
    eager: int = 0
    planned: int = 0


def graph_limit(kind: str, amount: float, captured_peak: int, held: KeptBytes = KeptBytes()) -> float:
    """The peak one graph's step may reach under a budget parsed as (`kind`, `amount`), the graph's own step peak as
    captured being `captured_peak`, while the step's earlier graphs keep `held`: the budget less what they keep,
    a fraction applying to eager's step there (what they would keep in eager plus this graph's peak)."""
    step = amount * (held.eager + captured_peak) if kind == "fraction" else amount
    return step - held.planned
