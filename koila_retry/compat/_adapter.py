"""The one adapter from a peer library's options to koila's, written as a table.

A stand-in lists its peer's options once, in a :class:`Table`, with what the peer always does
(toma's halving, accelerate's one size per function) as settings no caller gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from koila_retry._common.units import as_int
from koila_retry._core.policy import Options, Policy

__all__ = ["REQUIRED", "Convert", "Option", "Table", "given", "integer"]

#: Checks a value given under a name, and returns what it becomes; raises an error naming both.
Convert = Callable[[Any, str], Any]

#: The default of an option that ``None`` does not stand for: ``None`` is checked like any value.
REQUIRED: Any = object()

_OPTIONS = frozenset(Options.__annotations__)


def given(value: object, name: str) -> object:
    """Return ``value`` as it is: one of koila's own options, which the policy checks."""
    return value


def integer(minimum: int | None = None, *, indexes: bool = True) -> Convert:
    """Return a conversion to ``int``, not below ``minimum``; ``indexes``: also from ``numpy.int64`` and the like."""

    def convert(value: object, name: str) -> int:
        if type(value) is not int:
            # A bool is never taken: more likely a mistake.
            taken = as_int(value) if indexes else None
            if taken is None:
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            value = taken
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return value

    return convert


@dataclass(frozen=True)
class Option:
    """One of a peer's options: what it becomes, how it converts, and what ``None`` stands for."""

    becomes: str  # ``initial``, a key of :class:`~koila_retry.Options`, or one the stand-in reads itself
    convert: Convert = given  # for values that are not ``None``
    default: Any = None


@dataclass(frozen=True)
class Table:
    """A peer's options by name, and the settings the peer always has."""

    front_end: str  # how errors name the stand-in
    options: Mapping[str, Option]
    # Factories, called for each wrapper: so that each has its own cache, say.
    fixed: Mapping[str, Callable[[], object]] = field(default_factory=dict)

    def convert(self, name: str, value: object) -> Any:
        """Return the setting of one option given as ``name``: its default for ``None``, else converted."""
        option = self.options[name]
        if value is None and option.default is not REQUIRED:
            return option.default
        return option.convert(value, name)

    def read(self, values: Mapping[str, object]) -> dict[str, Any]:
        """Return the settings, by their names in koila, that the options a caller gave make, with the fixed ones."""
        settings = {name: make() for name, make in self.fixed.items()}
        for name, value in values.items():
            settings[self.options[name].becomes] = self.convert(name, value)
        return settings

    def policy(self, settings: Mapping[str, Any], *, rows: bool = False) -> Policy:
        """Return the engine's policy of some settings; with ``rows`` (calls give a size) ``initial`` may be absent."""
        options = {name: value for name, value in settings.items() if name in _OPTIONS}
        return Policy.of(self.front_end, settings.get("initial"), options, rows=rows)
