"""delayd.durations: the one reading of "90s" or "1h30m"."""

from __future__ import annotations

import pytest

from delayd.durations import format_duration_ms, parse_duration_ms


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("250ms", 250),
        ("90s", 90_000),
        ("15m", 900_000),
        ("2h", 7_200_000),
        ("7d", 604_800_000),
        ("1.5h", 5_400_000),
        ("0s", 0),
        (" 90s ", 90_000),
        ("1h30m", 5_400_000),
        ("1d2h3m4s5ms", 93_784_005),
        ("1m30s", 90_000),
        ("1.5s250ms", 1_750),
    ],
)
def test_durations(text, ms):
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0.5ms", "whole number of milliseconds"),
        ("90", "use a number and a unit"),
        ("3y", "use a number and a unit"),
        ("-5s", "use a number and a unit"),
        ("s", "use a number and a unit"),
        ("1e3s", "use a number and a unit"),
        ("", "use a number and a unit"),
        ("1h 30m", "use a number and a unit"),
        ("1h30", "use a number and a unit"),
        ("\uff190s", "use a number and a unit"),  # a full-width digit
        ("30m1h", "the largest first"),
        ("1s1s", "the largest first"),
    ],
)
def test_what_is_not_a_duration_is_refused_with_the_reason(text, why):
    with pytest.raises(ValueError, match=why) as caught:
        parse_duration_ms(text)
    assert repr(text) in str(caught.value)


def test_the_leaf_imports_nothing_of_delayd():
    import ast
    import pathlib

    import delayd.durations
    import delayd.timestamps

    for module in (delayd.durations, delayd.timestamps):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        imported = {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }  # fmt: skip
        assert not {name for name in imported if name.split(".")[0] == "delayd"}


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (1, "1s"),  # rounded up: a wait said so is never too short
        (90_000, "1m30s"),
        (86_400_000 + 60_000, "1d1m"),
        (86_399_001, "1d"),
    ],
)
def test_a_duration_is_written_in_its_largest_units(ms: int, text: str):
    assert format_duration_ms(ms) == text
    assert parse_duration_ms(text) >= ms  # read back, never shorter
