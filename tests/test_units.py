"""Tests for parse_bytes and format_bytes (koila_retry._common.units)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import koila_retry as koila
from koila_retry._common.units import as_int, format_bytes, format_free, parse_bytes

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

# ---------------------------------------------------------------------------
# parse_bytes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1KiB", KiB),
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("1TiB", TiB),
        ("1K", KiB),
        ("3M", 3 * MiB),
        ("4G", 4 * GiB),
        ("1T", TiB),
    ],
)
def test_binary_units_are_powers_of_1024(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1KB", 1000), ("512MB", 512 * 10**6), ("2GB", 2 * 10**9), ("1TB", 10**12)],
)
def test_decimal_units_are_powers_of_1000(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(("text", "expected"), [("0", 0), ("1", 1), ("12B", 12), ("12 b", 12), ("4096", 4096)])
def test_plain_numbers_and_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["512mib", "512MIB", "512Mib", "512mIb", "512 MiB"])
def test_units_are_case_insensitive(text: str) -> None:
    assert parse_bytes(text) == 512 * MiB


@pytest.mark.parametrize(("text", "expected"), [("1kb", 1000), ("1Kb", 1000), ("1kB", 1000), ("1k", KiB)])
def test_case_does_not_change_binary_versus_decimal(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", [" 512MiB", "512MiB ", "  512   MiB  ", "512\tMiB", "\n512 MiB\n"])
def test_whitespace_around_and_between_is_ignored(text: str) -> None:
    assert parse_bytes(text) == 512 * MiB


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1.5 KiB", 1536), ("1.5KB", 1500), ("0.5 GiB", GiB // 2), ("2.25 MiB", 2 * MiB + MiB // 4), ("1.0", 1)],
)
def test_floats_are_accepted(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_fractional_bytes_are_dropped() -> None:
    assert parse_bytes("1.5") == 1
    assert parse_bytes("2.3 KiB") == 2355  # 2355.2 bytes


@pytest.mark.parametrize("value", [0, 1, 4096, 2**63])
def test_ints_are_returned_unchanged(value: int) -> None:
    assert parse_bytes(value) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "MiB",
        "12 parsecs",
        "-1",
        "-1 MiB",
        "1e3",
        ".5K",
        "5.",
        "1,024",
        "1 MiBs",
        "1 KiB 2",
        "0x10",
        "1 bytes",
    ],
)
def test_unreadable_strings_raise_value_error_naming_them(text: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_bytes(text)
    assert repr(text) in str(excinfo.value)


def test_value_error_lists_the_units() -> None:
    with pytest.raises(ValueError, match=r"KiB, MiB, GiB, TiB"):
        parse_bytes("12 parsecs")


def test_negative_int_raises_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r">= 0 bytes, got -1$"):
        parse_bytes(-1)


@pytest.mark.parametrize("value", [1.5, 1.0, None, True, False, b"1", [1]])
def test_other_types_raise_type_error_naming_them(value: object) -> None:
    with pytest.raises(TypeError) as excinfo:
        parse_bytes(value)  # type: ignore[arg-type]
    assert repr(value) in str(excinfo.value)


@given(st.integers(min_value=0, max_value=2**53))
def test_parse_of_str_is_the_number(n: int) -> None:
    assert parse_bytes(str(n)) == n


@given(st.integers(min_value=0, max_value=2**20), st.sampled_from(["KiB", "MiB", "GiB", "K", "M", "G"]))
def test_whole_binary_sizes_are_exact(n: int, unit: str) -> None:
    factor = {"K": KiB, "M": MiB, "G": GiB}[unit[0]]
    assert parse_bytes(f"{n} {unit}") == n * factor


def test_large_integer_strings_are_exact() -> None:
    """Regression: parse_bytes went through float(), and '9007199254740993' gave 9007199254740992."""
    assert parse_bytes(str(2**53 + 1)) == 2**53 + 1


@pytest.mark.parametrize(("text", "expected"), [("2.01 KB", 2010), ("4.02 KB", 4020), ("8.03 KB", 8030)])
def test_decimal_sizes_that_are_whole_bytes_are_exact(text: str, expected: int) -> None:
    """Regression: int(2.01 * 1000) is 2009, because 2.01 * 1000 == 2009.9999999999998."""
    assert parse_bytes(text) == expected


# ---------------------------------------------------------------------------
# format_bytes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (0, "0 bytes"),
        (1, "1 bytes"),
        (1023, "1023 bytes"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (MiB, "1.00 MiB"),
        (4 * MiB + 4096, "4.00 MiB"),
        (2 * GiB, "2.00 GiB"),
        (GiB + GiB // 4, "1.25 GiB"),
        (TiB, "1.00 TiB"),
        (1024 * TiB, "1024.00 TiB"),
    ],
)
def test_format_bytes_uses_the_largest_unit_at_or_above_one(count: int, expected: str) -> None:
    assert format_bytes(count) == expected


@pytest.mark.parametrize(
    ("count", "expected"),
    [(-1, "-1 bytes"), (-1023, "-1023 bytes"), (-1024, "-1.00 KiB"), (-2 * GiB, "-2.00 GiB")],
)
def test_format_bytes_keeps_the_sign_of_negative_counts(count: int, expected: str) -> None:
    assert format_bytes(count) == expected


def test_format_bytes_accepts_floats() -> None:
    assert format_bytes(1536.0) == "1.50 KiB"
    assert format_bytes(10.7) == "10 bytes"


@given(st.integers(min_value=KiB, max_value=1023 * TiB))
def test_format_then_parse_is_close(n: int) -> None:
    number, unit = format_bytes(n).split()
    assert unit in ("KiB", "MiB", "GiB", "TiB")
    assert 1 <= float(number) < 1024.005
    # Two decimals: the parsed value is within half a hundredth of the unit.
    factor = {"KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}[unit]
    assert abs(parse_bytes(format_bytes(n)) - n) <= 0.006 * factor


def test_a_free_reading_is_unknown_or_unlimited_at_its_ends() -> None:
    # The meta device reads 2**63 - 1 free: "8388608.00 TiB free on meta" said nothing true.
    assert format_free(-1) == "unknown memory"
    assert format_free(2**63 - 1) == "unlimited memory"
    assert format_free(koila.free_memory("meta")) == "unlimited memory"
    assert format_free(2**62) == format_bytes(2**62)
    assert format_free(1536) == "1.50 KiB"


def test_as_int_takes_what_pythons_range_takes() -> None:
    numpy = pytest.importorskip("numpy")
    assert [as_int(value) for value in (3, numpy.int64(3), torch.tensor(3))] == [3, 3, 3]
    assert type(as_int(numpy.int64(3))) is int
    for refused in (True, 3.0, "3", None, torch.tensor(3.0), numpy.array([1, 2])):
        assert as_int(refused) is None, refused
