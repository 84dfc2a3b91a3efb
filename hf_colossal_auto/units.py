"""Byte, time and FLOP units shared by the whole planner.

The planner works in SI base units everywhere: seconds, bytes and FLOPs (or
FLOP/s).  This module is the single place where human-written quantities such
as ``"40GiB"`` are turned into integers, and where numbers are turned back into
short strings for reports, so that every other module can stay unit-free.

Decimal prefixes (``KB``, ``MB``, ``GB``, ...) are powers of 1000 and binary
prefixes (``KiB``, ``MiB``, ``GiB``, ...) are powers of 1024, as in IEC 80000-13.
Vendors quote link and memory bandwidth in decimal units and allocators report
capacity in binary units, so both must be accepted and never conflated.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "KiB",
    "MiB",
    "GiB",
    "TiB",
    "KB",
    "MB",
    "GB",
    "TB",
    "parse_bytes",
    "format_bytes",
    "format_seconds",
    "format_flops",
]

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
PiB = 2**50
KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12
PB = 10**15

# Keys are lower-case because parsing is case-insensitive; "Gb" (gigabit) is
# therefore read as gigabyte, which is the only sensible reading for a memory
# budget.  Bare "K"/"M"/"G" are deliberately absent: whether they mean 1000 or
# 1024 differs between tools, and a silent 7% error in a memory budget is worse
# than asking the user to be explicit.
_UNIT_FACTORS: dict[str, int] = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": KB,
    "mb": MB,
    "gb": GB,
    "tb": TB,
    "pb": PB,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "pib": PiB,
}

_ACCEPTED_FORMS = (
    "an int, a float with an integral value, or a string '<number>[ ]<unit>' where the number may use "
    "a decimal point or exponent (e.g. '80e9', '1.5TiB') and the unit is one of "
    "B, KB, MB, GB, TB, PB (powers of 1000) or KiB, MiB, GiB, TiB, PiB (powers of 1024), case-insensitive"
)

_BYTES_RE = re.compile(
    r"^\s*(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$",
)


def _to_int_bytes(value: float, original: object) -> int:
    """Round a non-negative finite byte count to an int, rejecting anything else."""
    if not math.isfinite(value):
        raise ValueError(
            f"Invalid byte size {original!r}: must be finite. Accepted forms: {_ACCEPTED_FORMS}."
        )
    if value < 0:
        raise ValueError(
            f"Invalid byte size {original!r}: must be non-negative. Accepted forms: {_ACCEPTED_FORMS}."
        )
    # Rounding (not truncation) because decimal fractions such as 1.1 GB are not
    # exactly representable and would otherwise lose a byte.
    return int(round(value))


def parse_bytes(value: int | float | str) -> int:
    """Parse a byte quantity into an integer number of bytes.

    Accepts ``int`` (returned unchanged), ``float`` (must be finite and
    non-negative; rounded to the nearest byte) and strings such as ``"40GiB"``,
    ``"40 GB"``, ``"512MiB"``, ``"1.5TiB"`` or ``"80e9"``.  Units are
    case-insensitive; ``GB`` = 1e9 bytes and ``GiB`` = 2**30 bytes.

    Raises:
        ValueError: naming the offending value and listing the accepted forms.
    """
    # bool is a subclass of int, but True bytes is always a bug at the call site.
    if isinstance(value, bool):
        raise ValueError(
            f"Invalid byte size {value!r}: booleans are not sizes. Accepted forms: {_ACCEPTED_FORMS}."
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(
                f"Invalid byte size {value!r}: must be non-negative. Accepted forms: {_ACCEPTED_FORMS}."
            )
        return value
    if isinstance(value, float):
        return _to_int_bytes(value, value)
    if not isinstance(value, str):
        raise ValueError(
            f"Invalid byte size {value!r} of type {type(value).__name__}. Accepted forms: {_ACCEPTED_FORMS}."
        )
    match = _BYTES_RE.match(value)
    if match is None:
        raise ValueError(f"Cannot parse byte size {value!r}. Accepted forms: {_ACCEPTED_FORMS}.")
    unit = match.group("unit").lower()
    factor = _UNIT_FACTORS.get(unit)
    if factor is None:
        raise ValueError(
            f"Cannot parse byte size {value!r}: unknown unit {match.group('unit')!r}. "
            f"Accepted forms: {_ACCEPTED_FORMS}."
        )
    number = match.group("num")
    # Integers are multiplied exactly so that e.g. "3TiB" is not routed through a float.
    if re.fullmatch(r"[+-]?\d+", number):
        exact = int(number) * factor
        if exact < 0:
            return _to_int_bytes(float(exact), value)
        return exact
    return _to_int_bytes(float(number) * factor, value)


_BINARY_STEPS: tuple[tuple[int, str], ...] = (
    (PiB, "PiB"),
    (TiB, "TiB"),
    (GiB, "GiB"),
    (MiB, "MiB"),
    (KiB, "KiB"),
)


def format_bytes(n: int | float) -> str:
    """Format a byte count with binary prefixes and two decimals, e.g. ``"1.50 GiB"``.

    Binary prefixes are used because the numbers this prints are almost always
    memory footprints, which allocators and ``nvidia-smi`` report in MiB/GiB.
    Counts below 1 KiB are printed as whole bytes (``"512 B"``).
    """
    sign = "-" if n < 0 else ""
    magnitude = abs(n)
    for factor, name in _BINARY_STEPS:
        # Compare the *rounded* value so 1023.999 KiB prints as "1.00 MiB", not "1024.00 KiB".
        if round(magnitude / factor, 2) >= 1.0:
            return f"{sign}{magnitude / factor:.2f} {name}"
    return f"{sign}{int(round(magnitude))} B"


def format_seconds(s: float) -> str:
    """Format a duration for humans: ``"85 us"``, ``"12.3 ms"``, ``"1.20 s"``.

    Sub-microsecond durations use ``ns``; durations of an hour or more use
    minutes or hours so that whole-run estimates stay readable.
    """
    if not math.isfinite(s):
        return f"{s} s"
    sign = "-" if s < 0 else ""
    t = abs(s)
    if t == 0:
        return "0 s"
    # Each branch checks the value *after* rounding so that e.g. 999.6 us is
    # promoted to "1.0 ms" instead of printing "1000 us".
    if round(t * 1e9) < 1000:
        return f"{sign}{t * 1e9:.0f} ns"
    if round(t * 1e6) < 1000:
        return f"{sign}{t * 1e6:.0f} us"
    if round(t * 1e3, 1) < 1000:
        return f"{sign}{t * 1e3:.1f} ms"
    if round(t, 2) < 3600:
        return f"{sign}{t:.2f} s"
    return f"{sign}{t / 3600:.2f} h"


_SI_STEPS: tuple[tuple[float, str], ...] = (
    (1e18, "E"),
    (1e15, "P"),
    (1e12, "T"),
    (1e9, "G"),
    (1e6, "M"),
    (1e3, "K"),
)


def format_flops(f: float, per_second: bool = False) -> str:
    """Format a FLOP count with SI prefixes and one decimal, e.g. ``"84.2 TFLOP"``.

    With ``per_second=True`` the suffix is ``FLOP/s`` so the same helper serves
    for device peak rates.  SI (decimal) prefixes match vendor datasheets.
    """
    suffix = "FLOP/s" if per_second else "FLOP"
    if not math.isfinite(f):
        return f"{f} {suffix}"
    sign = "-" if f < 0 else ""
    magnitude = abs(f)
    for factor, prefix in _SI_STEPS:
        if round(magnitude / factor, 1) >= 1.0:
            return f"{sign}{magnitude / factor:.1f} {prefix}{suffix}"
    return f"{sign}{magnitude:.0f} {suffix}"
