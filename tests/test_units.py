"""Byte parsing and human-readable formatting."""

from __future__ import annotations

import math

import pytest

from hf_colossal_auto.units import (
    GB,
    GiB,
    KiB,
    MiB,
    TiB,
    format_bytes,
    format_flops,
    format_seconds,
    parse_bytes,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (12345, 12345),
        ("40GiB", 40 * GiB),
        ("40 GB", 40 * GB),
        ("512MiB", 512 * MiB),
        ("1.5TiB", 1.5 * TiB),
        ("80e9", 80 * GB),
        ("80E9", 80 * GB),
        ("40gib", 40 * GiB),
        ("40GIB", 40 * GiB),
        ("40 gb", 40 * GB),
        ("  7 KiB ", 7 * KiB),
        ("100", 100),
        ("100B", 100),
        ("100 bytes", 100),
        ("1.1GB", 1_100_000_000),
        (".5 KiB", 512),
        ("2e3 MB", 2 * GB),
        (1.5e9, 1_500_000_000),
    ],
)
def test_parse_bytes_accepts(text: int | float | str, expected: float) -> None:
    value = parse_bytes(text)
    assert isinstance(value, int)
    assert value == int(expected)


def test_parse_bytes_is_exact_for_large_integers() -> None:
    # Routed through a float this would lose the low bits.
    assert parse_bytes("123456789123 TiB") == 123456789123 * TiB


@pytest.mark.parametrize(
    "bad", ["abc", "40 GX", "40G", "40 M", "-1GB", "", "GiB", "1.2.3GB", "nan GB", "inf"]
)
def test_parse_bytes_rejects_bad_strings_and_names_them(bad: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_bytes(bad)
    message = str(excinfo.value)
    assert repr(bad) in message
    # The error must tell the user what would have worked.
    assert "GiB" in message and "GB" in message


@pytest.mark.parametrize("bad", [-5, -1.0, float("nan"), float("inf"), True, None, [1]])
def test_parse_bytes_rejects_bad_values(bad: object) -> None:
    with pytest.raises(ValueError, match="Accepted forms"):
        parse_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (KiB, "1.00 KiB"),
        (1.5 * GiB, "1.50 GiB"),
        (3 * TiB, "3.00 TiB"),
        (1024 * KiB - 1, "1.00 MiB"),  # rounds up into the next unit, never "1024.00 KiB"
        (-2 * MiB, "-2.00 MiB"),
    ],
)
def test_format_bytes(n: float, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize("n", [1, 999, 4 * KiB, 123 * MiB, int(1.5 * GiB), 40 * GiB, 7 * TiB])
def test_format_parse_round_trip(n: int) -> None:
    # Two decimals of the chosen unit: relative error below 0.5%.
    assert math.isclose(parse_bytes(format_bytes(n)), n, rel_tol=5e-3)


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0.0123, "12.3 ms"),
        (1.2, "1.20 s"),
        (85e-6, "85 us"),
        (5e-9, "5 ns"),
        (0.0, "0 s"),
        (999.6e-6, "1.0 ms"),  # promoted after rounding, not "1000 us"
        (7200.0, "2.00 h"),
        (-0.5, "-500.0 ms"),
    ],
)
def test_format_seconds(seconds: float, expected: str) -> None:
    assert format_seconds(seconds) == expected


@pytest.mark.parametrize(
    ("flops", "kwargs", "expected"),
    [
        (84.2e12, {}, "84.2 TFLOP"),
        (312e12, {"per_second": True}, "312.0 TFLOP/s"),
        (999.96e9, {}, "1.0 TFLOP"),
        (1.5e9, {}, "1.5 GFLOP"),
        (5, {}, "5 FLOP"),
        (2e18, {}, "2.0 EFLOP"),
    ],
)
def test_format_flops(flops: float, kwargs: dict[str, bool], expected: str) -> None:
    assert format_flops(flops, **kwargs) == expected
