"""The suite's own settings, which every other test relies on."""

from __future__ import annotations

import gc

from hypothesis import settings


def test_hypothesis_gives_no_test_a_deadline() -> None:
    assert settings().deadline is None
    # A module's own settings object inherits the profile, unless it sets a deadline itself.
    assert settings(max_examples=3).deadline is None


def test_objects_made_by_the_imports_are_left_out_of_collections() -> None:
    assert gc.get_freeze_count() > 100_000
