"""Lightning: the ``self.log`` calls of a step that ``OOMRecovery`` runs, held back and logged once it succeeded.

A step that ran whole logs its calls as they were made. A split step logs each call of a name
once, as the whole batch's call would have logged it: the n-th call of a name, the
micro-batches' n-th calls of it combined as ``reduce_fx`` reduces (integer tensors, counts,
added up, as ``accumulate`` joins a step's outputs), with the ``batch_size`` the whole call
would have passed (see :func:`batch_size`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from koila_retry.integrations._lightning_module import ABSENT

__all__ = ["WHOLE", "Logs", "batch_size", "combined", "weights"]

# The rows of a part that ran the batch as given, not one of accumulate's micro-batches.
WHOLE = -1

# The reductions Lightning accepts as functions (its _Metadata: torch's and the builtins), by the name it gives them.
_FUNCTIONS: tuple[tuple[Any, str], ...] = (
    (torch.mean, "mean"),
    (torch.sum, "sum"),
    (sum, "sum"),
    (torch.max, "max"),
    (max, "max"),
    (torch.min, "min"),
    (min, "min"),
)
_NAMED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
# LightningModule.log's own parameters, less self: what the options given by position mean to
# Lightning, where the module's log passes them on through *args.
_LIGHTNING = inspect.signature(pl.LightningModule.log)
_LIGHTNING = _LIGHTNING.replace(parameters=list(_LIGHTNING.parameters.values())[1:])

# A call of self.log: the name, the value, and the options as keywords.
Call = tuple[str, Any, dict[str, Any]]


def _unset(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("OOMRecovery: the step is not installed on a module")


class Logs:
    """The ``self.log`` calls of one step hook of a module, held while it runs and logged once it succeeded."""

    def __init__(self) -> None:
        self.calls: list[Call] = []  # of the part (the whole batch, or a micro-batch) running
        self.parts: list[tuple[int, list[Call]]] = []  # the parts that ran, with their rows (WHOLE: as given)
        self.log: Callable[..., Any] = _unset  # the module's own, through which the calls are logged
        self.signature: inspect.Signature | None = None  # to bind options given by position
        self.keywords: frozenset[str] = frozenset()  # the names the module's log takes
        self.open = False  # whether it takes any keyword (**kwargs)
        self.saved: Any = ABSENT  # a log of the module object's own, while the step runs
        # Whether the step's values are sums over its rows (OOMRecovery(reduction="sum")): a mean logged
        # of them (the loss) adds up over the micro-batches, as accumulate adds up such a step's numbers.
        # Not told from a value of the step's own by being the same in each: so is a count at equal sizes.
        self.summed = False

    def attach(self, module: pl.LightningModule) -> None:
        """Log through ``module.log``, an override of the module's included."""
        self.log = module.log
        try:
            own = inspect.signature(self.log)
        except (TypeError, ValueError):  # not introspectable: taken for Lightning's
            own = _LIGHTNING
        kinds = [parameter.kind for parameter in own.parameters.values()]
        self.keywords = frozenset(own.parameters)
        self.open = inspect.Parameter.VAR_KEYWORD in kinds
        # An override that takes *args hands the options given by position on to Lightning's log.
        named = len(kinds) >= 2 and kinds[0] in _NAMED and kinds[1] in _NAMED
        self.signature = own if named and inspect.Parameter.VAR_POSITIONAL not in kinds else _LIGHTNING

    def detach(self) -> None:
        """Forget the module and every call held."""
        self.calls, self.parts = [], []
        self.log, self.signature, self.saved = _unset, None, ABSENT
        self.keywords, self.open = frozenset(), False

    def hold(self, module: pl.LightningModule) -> None:
        """Hold the module's ``self.log`` calls back from now on (on the module object, not its class)."""
        self.saved = vars(module).get("log", ABSENT)
        vars(module)["log"] = self.record  # not through Module.__setattr__, which looks for tensors

    def release(self, module: pl.LightningModule) -> None:
        """Let the module's ``self.log`` calls through again."""
        saved, self.saved = self.saved, ABSENT
        if saved is ABSENT:
            vars(module).pop("log", None)
        else:
            vars(module)["log"] = saved

    def record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Hold back a call of ``self.log`` until the step succeeded."""
        options = kwargs  # keywords only, as usual: kept as the call made them
        if args or not (self.open or kwargs.keys() <= self.keywords):
            # By position, as the module's log (or Lightning's, behind *args) reads them; a wrong
            # call raises here, in the step, as it does without the callback.
            signature = self.signature or _LIGHTNING
            bound = signature.bind(name, value, *args, **kwargs).arguments
            first, second = list(signature.parameters)[:2]
            name, value, options = bound[first], bound[second], {}
            for key, item in bound.items():
                if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
                    options.update(item)
                elif key not in (first, second):
                    options[key] = item
        if isinstance(value, torch.Tensor):
            # A copy, as Lightning's log makes at the call: the step may change the tensor after it (a
            # buffer, loss *= 0.5). Without its graph, which would hold the activations, unless asked.
            value = value.clone() if options.get("enable_graph", False) else value.detach().clone()
        self.calls.append((name, value, options))

    def drop(self) -> None:
        """Let go of every call held: a value logged with ``enable_graph=True`` holds its graph."""
        self.calls, self.parts = [], []

    def flush(self) -> None:
        """Log the calls of a step that ran whole, as they were made."""
        calls, self.calls = self.calls, []
        for name, value, options in calls:
            self.log(name, value, **options)

    def replay(self, rows: int) -> None:
        """Log what the successful attempt logged: as it was when whole, combined when split over ``rows``."""
        kept: list[tuple[int, list[Call]]] = []
        covered = 0
        for part in reversed(self.parts):  # the successful attempt's micro-batches are the last ones
            if part[0] == WHOLE:  # the batch as given, which the last attempt ran, or an earlier one
                kept = kept or [part]
                break
            if covered >= rows:
                break
            kept.insert(0, part)
            covered += part[0]
        self.drop()  # what is logged is in kept now
        if len(kept) <= 1:
            for _, calls in kept:
                for name, value, options in calls:
                    self.log(name, value, **options)
            return
        # A name's n-th call combines the n-th calls of the micro-batches that made one (as many calls as
        # the micro-batch that made most): each of the whole batch's calls reaches the epoch's value.
        positions: dict[tuple[str, int], list[tuple[int, Call]]] = {}
        for part_rows, calls in kept:
            made: dict[str, int] = {}
            for call in calls:
                index = made.get(call[0], 0)
                made[call[0]] = index + 1
                positions.setdefault((call[0], index), []).append((part_rows, call))
        for (name, _), entries in positions.items():
            options = dict(entries[-1][1][2])
            counts = [n for n, _ in entries]
            sizes = [call[2].get("batch_size") for _, call in entries]
            reduce_fx = options.get("reduce_fx", "mean")
            if self.summed and _reduction(reduce_fx) == "mean":
                reduce_fx = "sum"
            value = combined([call[1] for _, call in entries], weights(sizes, counts), reduce_fx)
            options["batch_size"] = batch_size(sizes, counts)
            self.log(name, value, **options)


def _counted(sizes: list[Any], rows: list[int]) -> list[Any] | None:
    """Return the ``batch_size`` of each micro-batch's call where they count its items; ``None`` where not.

    None where a call passed none, or where every call passed the same number that is not its
    rows: a fixed size (``self.hparams.batch_size``). Else ``len(x)``, or another count (tokens).
    """
    if any(size is None for size in sizes):
        return None
    numbers = [size.item() if isinstance(size, torch.Tensor) else size for size in sizes]
    return None if len(set(numbers)) == 1 and numbers != rows else numbers


def batch_size(sizes: list[Any], rows: list[int]) -> Any:
    """Return the ``batch_size`` the whole batch's call passes, from its micro-batches' (``None``: passed none)."""
    # None passed: None, for Lightning to find in the whole batch, which it still holds, as for the whole
    # batch's call (the first tensor's rows, or 1 for a number first). None in some calls only: the rows.
    if all(size is None for size in sizes):
        return None
    if any(size is None for size in sizes):
        return sum(rows)
    if _counted(sizes, rows) is None:  # a fixed size
        return sizes[-1]
    return sum(sizes[1:], sizes[0])


def weights(sizes: list[Any], rows: list[int]) -> list[Any]:
    """Return what weighs each micro-batch's mean: the ``batch_size`` its call passed where that counts its items."""
    # As Lightning weighs the batches of an epoch's mean by them: a mean over tokens, logged with their count.
    counted = _counted(sizes, rows)
    return rows if counted is None or not sum(counted) > 0 else counted


def combined(values: list[Any], rows: list[Any], reduce_fx: Any) -> Any:
    """Return the values one name was logged with in each micro-batch, combined as ``reduce_fx`` reduces."""
    # Under a mean: integer tensors (counts) added up, boolean ones whether any is true, other tensors and
    # numbers weighted by rows (or the counts of weights()). A sum, a max or a min as they say. Anything
    # else (a torchmetrics Metric, which keeps its own state): the last value.
    numbers = all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values)
    if not numbers and not all(isinstance(value, torch.Tensor) for value in values):
        return values[-1]
    reduce_fx = _reduction(reduce_fx)
    if reduce_fx == "mean":
        if not numbers and not (values[0].is_floating_point() or values[0].is_complex()):
            # A count, as accumulate joins a step's outputs: the whole batch's is the sum.
            total = torch.stack([value.detach() for value in values]).sum(0)
            return total.to(values[0].dtype)
        everything = sum(rows)
        # A micro-batch that counted no items logged the mean of none (nan): it weighs nothing.
        weighed = [(value, n) for value, n in zip(values, rows, strict=True) if n]
        if numbers:
            return math.fsum(value * n for value, n in weighed) / everything
        return sum(value.detach() * (n / everything) for value, n in weighed)
    if reduce_fx == "sum":
        return sum(values[1:], values[0])
    if reduce_fx in ("max", "min"):
        pick = max if reduce_fx == "max" else min
        if numbers:
            return pick(values)
        stacked = torch.stack([torch.as_tensor(value).detach().reshape(()) for value in values])
        return stacked.max() if pick is max else stacked.min()
    return values[-1]


def _reduction(reduce_fx: Any) -> str | None:
    """Return ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for a ``reduce_fx`` Lightning reads as it; else None."""
    # As Lightning's _Metadata._parse_reduce_fx: a string in any case, "avg" for "mean"; a function of _FUNCTIONS.
    if isinstance(reduce_fx, str):
        name = reduce_fx.lower()
        name = "mean" if name == "avg" else name
        return name if name in ("mean", "sum", "max", "min") else None
    for function, name in _FUNCTIONS:
        if reduce_fx is function:
            return name
    return None
