"""The one adapter from a peer library's options to koila's, written as a table.

A stand-in lists its peer's options once, in a :class:`Table`: for each, the
peer's name, what it becomes (``initial``, one of the shared
:class:`~koila_retry.Options`, or a setting the stand-in reads itself, such as
toma's ``context``), what ``None`` stands for, and how a given value is checked
and converted. What the peer always does (toma's halving, accelerate's one size
per function) is in the table too, as settings no caller gives.
:meth:`Table.read` turns what a caller gave into settings, and
:meth:`Table.policy` those settings into the engine's :class:`Policy`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, cast

from koila_retry._core.policy import Options, Policy

__all__ = ["REQUIRED", "Convert", "Option", "Table", "given", "integer"]

#: Checks a value given under a name, and returns what it becomes; raises an error naming both.
Convert = Callable[[Any, str], Any]

#: The default of an option that ``None`` does not stand for: ``None`` is checked like any value.
REQUIRED: Any = object()

_OPTIONS = frozenset(Options.__annotations__)


def given(value: object, name: str) -> object:
    """Return ``value`` as it is: one of koila's own options, which the policy checks.

    Args:
        value (object): the value given.
        name (str): the option's name.

    Returns:
        object: ``value``.
    """
    return value


def integer(minimum: int | None = None, *, indexes: bool = True) -> Convert:
    """Return a conversion that takes an integer, not below ``minimum``.

    Args:
        minimum (int, optional): the smallest value allowed; ``None``: any.
        indexes (bool): whether other integers (with ``__index__``, such as
            ``numpy.int64``) are taken too. A bool never is: more likely a mistake.

    Returns:
        callable: ``convert(value, name)``, which returns the value as an ``int``.
    """

    def convert(value: object, name: str) -> int:
        if type(value) is not int:
            if isinstance(value, bool) or not (indexes and hasattr(type(value), "__index__")):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            value = operator.index(cast(SupportsIndex, value))
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return value

    return convert


@dataclass(frozen=True)
class Option:
    """One of a peer's options: what it becomes, how it converts, and what ``None`` stands for.

    Attributes:
        becomes (str): the setting it gives: ``initial``, a key of
            :class:`~koila_retry.Options`, or one the stand-in reads itself.
        convert (callable): ``convert(value, name)`` checks a value that is
            not ``None`` and returns the setting's value.
        default (object): the setting when the value is ``None``;
            :data:`REQUIRED` converts ``None`` too (and so refuses it).
    """

    becomes: str
    convert: Convert = given
    default: Any = None


@dataclass(frozen=True)
class Table:
    """A peer's options by name, and the settings the peer always has.

    Attributes:
        front_end (str): how errors name the stand-in.
        options (Mapping): each option's :class:`Option`, by the peer's name.
        fixed (Mapping): the settings no caller gives, each made by calling
            its factory (so that each wrapper has its own cache, say).
    """

    front_end: str
    options: Mapping[str, Option]
    fixed: Mapping[str, Callable[[], object]] = field(default_factory=dict)

    def convert(self, name: str, value: object) -> Any:
        """Return the setting of one option given as ``name``: its default for ``None``, else converted.

        Args:
            name (str): the peer's name for the option.
            value (object): what the caller gave.

        Returns:
            object: the setting's value.

        Raises:
            TypeError: if the value has the wrong type.
            ValueError: if the value is out of range.
        """
        option = self.options[name]
        if value is None and option.default is not REQUIRED:
            return option.default
        return option.convert(value, name)

    def read(self, values: Mapping[str, object]) -> dict[str, Any]:
        """Return the settings that the options a caller gave make, with the fixed ones.

        Args:
            values (Mapping): the caller's options, by the peer's names, checked in order.

        Returns:
            dict: each setting by what it is called in koila (:attr:`Option.becomes`).

        Raises:
            TypeError: if a value has the wrong type.
            ValueError: if a value is out of range.
        """
        settings = {name: make() for name, make in self.fixed.items()}
        for name, value in values.items():
            settings[self.options[name].becomes] = self.convert(name, value)
        return settings

    def policy(self, settings: Mapping[str, Any], *, rows: bool = False) -> Policy:
        """Return the engine's policy of some settings: their ``initial`` and their :class:`Options`.

        Args:
            settings (Mapping): what :meth:`read` returned, or the fixed settings alone.
            rows (bool): whether calls bring their own size, so that ``initial`` may be absent.

        Returns:
            Policy: the checked policy.

        Raises:
            TypeError: if a setting has the wrong type.
            ValueError: if a setting is out of range.
        """
        options = {name: value for name, value in settings.items() if name in _OPTIONS}
        return Policy.of(self.front_end, settings.get("initial"), options, rows=rows)
