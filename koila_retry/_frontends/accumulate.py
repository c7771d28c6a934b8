"""``accumulate``: a training step that does not fit runs as micro-batches with the full batch's gradient.

The whole step is one attempt of the engine: an out-of-memory error in any micro-batch throws away
what the step computed and runs it again smaller, with ``.grad`` as it was. ``gradients`` decides
how a step's gradients reach ``.grad`` (docs/architecture.rst, "How accumulate keeps a step's gradients").
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import FrameType, MethodType
from typing import Any, Literal, ParamSpec, TypeVar, cast, overload

import torch
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm

from koila_retry._common.batches import Split
from koila_retry._common.callables import check_takes
from koila_retry._common.places import Replayed, levels_to_caller, release_ours
from koila_retry._common.tensors import zeroed
from koila_retry._common.units import checked_dim
from koila_retry._common.walk import trainable_module
from koila_retry._common.warn import warn_or_log
from koila_retry._core import distributed
from koila_retry._core.attempt import agreement_of
from koila_retry._core.cache import function_identity
from koila_retry._core.distributed import Agreement, GradientSync, ddp_modules, modules_of
from koila_retry._core.engine import Attempt, Call, Controller, Sampled, run
from koila_retry._core.memory import PeakMeter
from koila_retry._core.overlap import Overlap, overlaps
from koila_retry._core.policy import Options, Policy
from koila_retry._core.ranks import Found
from koila_retry._core.sharded import ShardedStep, fsdp_modules
from koila_retry._core.stats import Stats
from koila_retry._diagnostics import exhausted
from koila_retry._estimation.auto import AUTO, AutoFirst, check_auto
from koila_retry._estimation.estimate import MemoryEstimate, estimate_batch
from koila_retry._frontends import own_backward
from koila_retry._frontends.batch import (
    Batched,
    bindable,
    refuse_generator,
    refuse_iterators,
    unwrap_binding,
    with_controller,
)
from koila_retry._frontends.combine import Results, loss_of
from koila_retry._frontends.gradients import HIDDEN, ONE_ROW, ROWS, Backward, Gradients, backward_of, plain_backward
from koila_retry._frontends.other_leaves import OtherLeaves
from koila_retry._frontends.weighing import Weighing

# At run time too: typing.get_type_hints() reads the options' annotations.
if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # the backport torch depends on
    from typing_extensions import Unpack

__all__ = ["accumulate"]

P = ParamSpec("P")
R = TypeVar("R")

_REDUCTIONS = ("mean", "sum")
_OWN = ("initial", "dim", "reduction", "weight", "scaler", "backward", "ddp")  # its options besides Options


@overload
def accumulate(fn: Callable[P, R], /) -> Batched[P, R]: ...


@overload
def accumulate(
    *,
    initial: int | Literal["auto"] | None = ...,
    dim: int = ...,
    reduction: str = ...,
    weight: Callable[..., Any] | None = ...,
    scaler: Any = ...,
    backward: Callable[..., Any] | None = ...,
    ddp: Any = ...,
    **options: Unpack[Options],
) -> Callable[[Callable[P, R]], Batched[P, R]]: ...


def accumulate(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    initial: int | Literal["auto"] | None = None,
    dim: int = 0,
    reduction: str = "mean",
    weight: Callable[..., Any] | None = None,
    scaler: Any = None,
    backward: Callable[..., Any] | None = None,
    ddp: Any = None,
    **options: Unpack[Options],
) -> Any:
    """Run a training step over a batch, split into micro-batches when it does not fit.

    The decorated function takes a batch (tensor arguments, all with the same
    size along ``dim``, and any other arguments) and returns the loss of what it
    was given: a scalar tensor, a tuple or list whose first item is the loss
    (a named tuple's ``loss`` field, if it has one), or a dict whose ``"loss"``
    entry is. Calling it runs the step and its
    backward pass: ``loss.backward()``, or ``backward(loss)`` with a training
    engine's ``backward=``. If the whole batch fits, that is one forward and one
    backward. If not, the tensor arguments are split into micro-batches of a
    power of two rows (the last takes the remainder), and each micro-batch's
    loss is weighted by its share of the rows (``reduction="mean"``) or not at
    all (``"sum"``) before its backward, so that the gradients add up to the
    full batch's. Where a gradient is already in ``.grad``, the step's is added
    to it in place once the step succeeded, so the optimizer sees it plus the
    full-batch gradient, as after a plain ``backward()``; until then it is set
    aside (one gradient buffer more than a hand-written loop). An
    out-of-memory error in any micro-batch discards what the step computed and
    runs it again at the next smaller size; a call that fails leaves ``.grad``
    as it was. Threads that train one model at once may each call a step:
    their gradients add up in ``.grad`` as their plain ``backward()`` calls
    would. A tensor hook on a parameter (``register_hook``) sees each
    backward's gradient once, and a post-accumulate-grad hook runs once per
    step. See :doc:`accumulate` for how the gradients reach ``.grad``.

    The call returns the full-batch loss, detached: the weighted sum of the
    micro-batches' losses. Other items of a tuple, list or dict result (a
    Hugging Face ``ModelOutput``) are combined too, leaf by leaf, and
    detached: tensors with a row per row of the batch along ``dim`` are
    concatenated along it; floating-point numbers and tensors are weighted
    like the loss; integers (counts) are added up; other objects (a model's
    key-value cache, strings) come back as ``None``, with a warning, once.

    The batch may be a tree: tensors inside dicts and other mappings (a
    tokenizer's ``BatchEncoding``), lists, tuples and dataclasses are split, and
    each micro-batch gets the same containers back (see :ref:`batches`).

    Under ``torch.no_grad()``, or when nothing in the loss needs a gradient, no
    backward runs: the call only computes the loss, in micro-batches if needed.

    BatchNorm layers in training mode see each micro-batch's statistics instead
    of the batch's, so a split step differs from the full step when they take
    part: a :class:`UserWarning` says so, once. See :doc:`accumulate`.

    Use it bare (``@koila.accumulate``) or called
    (``@koila.accumulate(initial=64)``).

    Args:
        fn (callable): the step, when used bare.
        initial (int, str or None): the first micro-batch size to try.
            ``"auto"``: the whole batch if the estimate of its step (forward
            and backward) fits in the device's free memory, else the largest
            power of two at which a split step, with its own memory, fits;
            estimated once per input signature and kept in ``cache`` (see
            :doc:`accumulate`). Default: ``None``, the whole batch.
        dim (int): the dimension of the tensor arguments that holds the rows.
            Default: 0.
        reduction (str): ``"mean"`` if the loss is a mean over the rows,
            ``"sum"`` if it is a sum. Default: ``"mean"``.
        weight (callable, optional): for a loss that is a mean over items
            other than rows (tokens that are not padding, valid pixels):
            called with a micro-batch's arguments, exactly as the step gets
            them, it returns how many items that micro-batch's loss averages
            over (an int, a float or a 0-dimensional tensor). Each
            micro-batch's loss is then weighted by its count over the whole
            batch's, so the gradient and the returned loss are the full
            batch's mean over those items. Not called when the whole batch
            runs at once. Default: ``None``, weights by rows.
        scaler (torch.amp.GradScaler, optional): for mixed precision: each
            backward runs on ``scaler.scale(loss)``. You still call
            ``scaler.step(optimizer)`` and ``scaler.update()``.
        backward (callable, optional): what runs the backward pass of a
            loss, for a training engine that wants its own:
            ``accelerator.backward`` (accelerate) or ``fabric.backward``
            (Lightning Fabric). Each backward of the step is then
            ``backward(weighted_loss)``, with ``retain_graph=True`` added when
            a tensor argument carries a graph from before the call. What the
            engine does besides is its own: accelerate divides the loss by its
            ``gradient_accumulation_steps``, and mixed precision scales it, so
            pass no ``scaler`` with it. The ``initial="auto"`` estimate runs a
            plain backward. Default: ``None``, ``loss.backward()``. See
            :doc:`accumulate`.
        ddp (DistributedDataParallel or list, optional): DDP modules the
            step trains, added to those it finds itself (through its
            arguments, closure, globals or ``self``, see :doc:`distributed`):
            name any the search may miss. The step covers both. Every
            micro-batch but the last runs under ``no_sync()``, and the last
            one's backward all-reduces as DDP does it; a rank that fails
            plays along the all-reduces it did not make, and the ranks agree
            (docs/distributed.rst, "DDP: the overlap, kept"). Several
            modules, like the other cases that page lists, run every
            micro-batch under ``no_sync()`` and all-reduce after the ranks
            agree. Default: ``None``, the modules found.
        **options (Options): the shared options, the sizes being those of
            micro-batches; see :ref:`options`. ``cache`` defaults to a new
            :class:`StackMemoryCache` for this function, and ``group`` to the
            process group of ``ddp``, else all the ranks.

    Returns:
        Batched: the wrapped step, with ``stats`` (``stats.batch_size`` is the
        micro-batch size), ``cache_info()`` and ``cache_clear()``.

    Raises:
        TypeError: if the step is not callable or is a coroutine or generator
            function, or an option has the wrong type. When called: if the
            step returns no loss.
        ValueError: if an option is out of range, ``ddp`` is given with
            ``sync=False``, ``backward`` with ``scaler``, or ``weight`` with
            ``reduction="sum"``. When called: if the batch has no rows, tensor
            arguments differ in size along ``dim``, the loss is not a scalar,
            or ``weight`` counts something other than a number >= 0.
        NotImplementedError: when called, if ranks agree and the step
            reaches FSDP1, HSDP, a tensor-parallel module, a
            ``SyncBatchNorm`` that trains or DDP under ``Join``, or FSDP2
            with ``initial="auto"`` (docs/distributed.rst lists each).
        RuntimeError: when called, if the loss needs no gradient while grad
            mode is on and a module the step uses has parameters that do, or
            if the step runs a backward pass itself (``loss.backward()`` or
            ``torch.autograd.backward`` inside it; ``torch.autograd.grad`` is
            allowed), refused before that backward writes any ``.grad``.
        BatchSizeExhausted: when called, if the step runs out of memory even at
            ``minimum`` rows per micro-batch.

    Errors raised when called leave every ``.grad`` as it was before the call.

    Example::

        >>> import torch, koila_retry as koila
        >>> model = torch.nn.Linear(3, 1)
        >>> @koila.accumulate(initial=2)  # micro-batches of 2, 2 and 1 rows
        ... def step(x, y):
        ...     return torch.nn.functional.mse_loss(model(x), y)
        >>> x, y = torch.randn(5, 3), torch.randn(5, 1)
        >>> loss = step(x, y)
        >>> split = model.weight.grad.clone()
        >>> model.zero_grad()
        >>> torch.nn.functional.mse_loss(model(x), y).backward()
        >>> torch.allclose(split, model.weight.grad, atol=1e-6)
        True

    .. versionadded:: 0.1.0
    """
    decorate: Callable[[Callable[..., Any]], Batched[..., Any]] = accumulator(
        initial=initial,
        dim=dim,
        reduction=reduction,
        weight=weight,
        scaler=scaler,
        backward=backward,
        ddp=ddp,
        options=options,
    )
    return decorate if fn is None else decorate(fn)


def accumulator(
    *,
    initial: int | Literal["auto"] | None = None,
    dim: int = 0,
    reduction: str = "mean",
    weight: Callable[..., Any] | None = None,
    scaler: Any = None,
    backward: Callable[..., Any] | None = None,
    ddp: Any = None,
    # False for a step inside a DDP module's forward (Lightning's training_step): DDP's own
    # backward after it averages what the step left in .grad. The ranks still agree on sizes.
    averages: bool = True,
    # For a trainer's integration that ran the whole batch itself and ran out of memory: returns that error's
    # message and place (places.replayable), once, and the call's attempt of the whole batch raises it again.
    replay: Callable[[], tuple[str, str] | None] | None = None,
    # For a trainer's integration whose micro-batches' tensors differ in size outside dim (generated tokens):
    # the value they are padded with to be joined, or None to leave torch.cat's error (see combine.Results).
    pad: Callable[[], float | None] | None = None,
    # For an integration whose wrapper runs one of several steps per call: the statistics they all write.
    stats: Stats | None = None,
    # For a trainer's integration: the user's step (file, line, name) that keys the sizes, not its wrapper.
    identity: tuple[str, int, str] | None = None,
    options: Options,
) -> Callable[[Callable[P, R]], Batched[P, R]]:
    """Check :func:`accumulate`'s arguments once; return what decorates a step with them."""
    decorator = functools.partial(accumulator, **locals())  # the arguments as given, to remake copies (bindable)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if weight is not None and not callable(weight):
        raise TypeError(
            "weight must be a callable that takes a micro-batch's arguments and returns how many items its "
            f"loss averages over, got {type(weight).__name__} {weight!r:.200}"
        )
    if weight is not None and reduction == "sum":
        raise ValueError(
            "weight= weighs micro-batches whose loss is a mean over items, and reduction='sum' adds them "
            "unweighted: drop one of them"
        )
    dim = checked_dim(dim)
    # A class passes a look for a callable scale(): GradScaler without its parentheses.
    if scaler is not None and (isinstance(scaler, type) or not callable(getattr(scaler, "scale", None))):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler (or have its scale()), got {type(scaler).__name__} {scaler!r:.200}"
            + (": give an instance, such as torch.amp.GradScaler('cuda')" if isinstance(scaler, type) else "")
        )
    if backward is not None and (not callable(backward) or inspect.iscoroutinefunction(backward)):
        raise TypeError(  # an async def's call runs nothing until awaited: no backward, silently
            "backward must be a callable that runs the backward pass of a loss, such as accelerator.backward "
            f"or fabric.backward (not an async def), got {type(backward).__name__} {backward!r:.200}"
        )
    if backward is not None:  # Accelerator.backward, the class's: the loss would become its self
        check_takes("backward", backward, "the loss", None)
    if backward is not None and scaler is not None:
        raise ValueError(
            "backward= and scaler= both scale the loss: a training engine's backward does its own loss scaling "
            "(accelerate's or Lightning Fabric's mixed precision), so pass one of them: backward= with the "
            "engine, or scaler= with a plain torch.amp.GradScaler"
        )
    run_backward = backward_of(backward, scaler)
    check_auto(initial)
    given = distributed.given_ddp(ddp)
    if given and options.get("sync") is False:
        raise ValueError(
            "ddp= needs the ranks to agree on each step (a rank that runs out of memory plays along, then all "
            "agree), and sync=False turns agreement off: drop one of them"
        )
    if given and options.get("group") is None:
        options = {**options, "group": given[0].process_group}
    first = None if initial == AUTO else cast("int | None", initial)
    policy = Policy.of("koila.accumulate", first, options, rows=True, own=_OWN)

    def decorate(function: Callable[P, R]) -> Batched[P, R]:
        function, binding = unwrap_binding(function)
        if not callable(function):
            raise TypeError(f"@koila.accumulate decorates a callable, got {type(function).__name__} {function!r}")
        if inspect.iscoroutinefunction(function):
            raise TypeError("@koila.accumulate runs backward() itself and cannot wrap an async function")
        refuse_generator(function, "@koila.accumulate")
        own_backward.guard()  # a backward the step runs itself is refused (see own_backward)
        name = getattr(function, "__qualname__", None) or type(function).__qualname__
        controller = Controller(name, policy, explain=exhausted.message, stats=stats, function=function)
        auto = initial == AUTO
        step = _Accumulator(function, controller, dim, reduction == "mean", run_backward, policy.device, auto)
        step.weighing.weight = weight
        step.ddp = given
        step.averages = averages
        step.replay = replay
        step.pad = pad
        step.identity = identity or step.identity
        getframe = sys._getframe

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return step(args, kwargs, getframe(1))

        @functools.wraps(function)
        def method(instance: Any, /, *args: Any, **kwargs: Any) -> Any:
            # Bound to the step, not split with the batch: a dataclass's tensors are its own (as chunked's).
            return step(args, kwargs, getframe(1), MethodType(function, instance))

        plain, method = with_controller(wrapper, controller), with_controller(method, controller)
        return cast(Batched[P, R], bindable(function, plain, method, decorator, binding))

    return decorate


# What autograd says of a graph that a backward freed; a micro-batch's backward meets it in a graph from before
# the call that the step reaches without an argument, which koila cannot keep (a retry's, too).
_FREED = "backward through the graph a second time"
_OUTSIDE_GRAPH = (
    "{name} ran in micro-batches, and each one's backward runs through what the step reaches from before the call. "
    "If the graph is one made outside the step and reached without an argument (a closure, a global, an "
    "attribute), the first micro-batch's backward freed it. Pass it to the step as an argument, whose graph is "
    "kept for the whole step, or compute it inside the step. A cache entered around the call does the same "
    "(torch.nn.utils.parametrize.cached()): its first micro-batch builds the weight, whose graph that "
    "micro-batch's backward frees; enter it inside the step. If the step itself runs a backward through its "
    "graph before returning the loss (torch.autograd.grad without retain_graph=True), it fails on the whole "
    "batch too: pass retain_graph=True there."
)


def _weighed(loss: torch.Tensor, weight: float) -> torch.Tensor:
    """Return ``loss * weight`` with its graph, also where the step left grad mode off for good."""
    if torch.is_grad_enabled():
        return loss * weight
    with torch.enable_grad():  # the caller's mode wants a backward (Gradients.grad_mode), whatever the step left
        return loss * weight


def _step(split: Split) -> Callable[..., Any]:
    """Return the step a call runs: the function, or the function bound to the instance it was called on."""
    return split.fn  # type: ignore[return-value]  # always given by _Accumulator; not cast(): a call per micro-batch


class _Accumulator:
    """One decorated step: runs calls of it, whole or in micro-batches."""

    def __init__(
        self,
        fn: Callable[..., Any],
        controller: Controller,
        dim: int,
        mean: bool,
        backward: Backward,
        device: torch.device | None,
        auto: bool = False,
    ) -> None:
        self.fn, self.controller, self.dim, self.mean = fn, controller, dim, mean
        self.backward, self.device, self.auto = backward, device, auto
        self.identity = function_identity(fn)
        self.warned_batchnorm = self.warned_checkpoint = self.warned_comm_hook = False
        self.warned_dropped = False
        self.weighing = Weighing(controller.name, mean)  # weight= sets its weight
        self.ddp: list[Any] = []  # given by ddp=, besides those the controller finds
        self.averages = True  # see accumulator()
        self.replay: Callable[[], tuple[str, str] | None] | None = None  # see accumulator()
        self.pad: Callable[[], float | None] | None = None  # see accumulator()
        # The modules a step reaches where one is an FSDP2 module, looked at where that decides anything
        # (no agreement, or initial="auto", under a process group), again when it is given another model.
        self.sharded: Found[list[weakref.ref[torch.nn.Module]]] = Found(getattr(fn, "__code__", None))
        # The normalisation layers it reaches, looked at where the graph cannot tell (see _normalised_by_batch).
        self.norms: Found[list[weakref.ref[torch.nn.Module]]] = Found(getattr(fn, "__code__", None))

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], caller: FrameType, bound: Any = None) -> Any:
        fn = self.fn if bound is None else bound  # the step, or the step bound to its instance
        refuse_iterators(fn, args, kwargs, "koila.accumulate", "micro-batch")
        split = Split(args, kwargs, self.dim, "koila.accumulate", fn)
        rows = split.rows
        if rows == 0:
            raise ValueError(f"{self.controller.name} was given a batch of 0 rows along dim {self.dim}")
        device = self.device or split.device
        roots = (fn, split.args, split.kwargs)
        if self.auto and distributed.is_running() and self._sharded_modules(roots):
            raise NotImplementedError(
                f"{self.controller.name} trains an FSDP2 module (fully_shard) with initial='auto': the estimate "
                "does not cover sharded modules yet. Pass initial=<rows> or None"
            )
        if not self.auto and not distributed.is_running():
            return self._alone(split, device, roots, caller)
        first = self._estimated(split, device) if self.auto else None
        call = Call(self.identity, caller, device, split.sample, rows, first, roots=roots, per_sample=split.per_sample)
        attempt = self.controller.start(call)
        shards = self._sharded_step(roots) if attempt.agrees else self._sharded_alone(roots)
        if shards is not None and attempt.agrees and self._gradient_sync() is not None:
            # A rank that failed would play along FSDP2's collectives but not DDP's buckets: the job aborted.
            raise NotImplementedError(
                f"{self.controller.name} trains a DistributedDataParallel module in a step that also reaches an "
                "FSDP2 module (fully_shard), through its arguments, closure, globals or self: recovering from an "
                "out-of-memory error covers one of them per step. Shard the DDP module with fully_shard too, or "
                "call the FSDP2 one before the step and pass its outputs to a step that cannot reach it (a "
                "function given the student, not a method of an object that holds the teacher)"
            )
        if shards is not None:
            return self._planned(split, attempt, shards)
        sync = self._gradient_sync() if attempt.agrees else None
        if sync is not None:
            sync.before_step(self.controller.name)
            if overlaps(sync.modules):
                agreement = cast(Agreement, agreement_of(attempt))  # the sync is made where the ranks agree
                return self._planned(split, attempt, Overlap(sync.modules[0], agreement))
            self._warn_comm_hook(sync.modules)
        # Direct into .grad where nothing else may see it (see Gradients), an engine's backward= included: each
        # backward it starts is seen there. Under a process group, DDP's hooks would see a direct one: captured.
        gradients = Gradients(sync is None and not distributed.is_running())

        def work(size: int) -> Results:
            if sync is None:
                results = self._run(split, size, gradients, attempt, first)
            else:
                with sync.no_sync():
                    results = self._run(split, size, gradients, attempt, first)
                gradients.own()  # the averages are written into the sums, made now while memory may fail the attempt
                sync.prepare(gradients.sums, gradients.leaves)
            results.finish()  # inside the attempt (see Results.finish)
            return results

        def undo() -> None:
            if sync is not None:
                sync.forget()
            gradients.discard()

        # Whether every rank used every parameter rides on the agreement: usually yes, and
        # then which ones each rank used need not be exchanged.
        vote = None if sync is None else sync.used_everything
        try:
            finished = run(attempt, work, rows=rows, vote=vote, undo=undo)
            if sync is not None:
                sync.reduce(used_everywhere=attempt.unanimous)
            result = finished.finish()
            # Inside the try: an interrupt (Ctrl-C) lets go too.
            return self._delivered(gradients, finished, result, rows, roots)
        except BaseException:
            gradients.abandon()
            raise

    def _alone(self, split: Split, device: torch.device, roots: tuple[Any, ...], caller: FrameType) -> Any:
        """Run a call no other rank takes part in and no estimate starts, the usual one.

        Through the engine's short way, which makes the call's attempts only if the first fails.
        """
        rows = split.rows
        gradients = Gradients(True)

        def work(size: int) -> Results:
            results = self._run(split, size, gradients, None)
            results.finish()  # inside the attempt (see Results.finish)
            return results

        sampled = Sampled(split.sample, split.per_sample, rows, gradients.discard)
        try:
            finished = self.controller.call(self.identity, caller, device, work, roots, rows, sampled)
            result = finished.finish()
            # Inside the try: an interrupt (Ctrl-C) lets go too.
            return self._delivered(gradients, finished, result, rows, roots)
        except BaseException:
            gradients.abandon()
            raise

    def _delivered(
        self, gradients: Gradients, finished: Results, result: Any, rows: int, roots: tuple[Any, ...]
    ) -> Any:
        """Put the step's gradients in ``.grad``, warn of what the step could not do exactly, and return ``result``."""
        gradients.committing = True
        gradients.restore()
        gradients.deliver()
        # The step's gradients are in .grad now: a warning that a filter makes an error must
        # not make a step that succeeded raise (warn_or_log logs it then).
        if gradients.hidden and not self.warned_checkpoint:
            self.warned_checkpoint = True
            warn_or_log(
                f"{self.controller.name} runs a backward inside its own (torch.utils.checkpoint(use_reentrant=True) "
                "around a function that is not a module, or a custom autograd Function's over parameters that "
                "another thread's step holds): the gradients that backward writes cannot all be found, so an "
                "out-of-memory error part-way through a step could leave some of them written twice. Use "
                "use_reentrant=False, or checkpoint a module. This warning is shown once.",
                UserWarning,
                stacklevel=levels_to_caller(),
            )
        if finished.size < rows and not self.warned_batchnorm and self._normalised_by_batch(gradients, finished, roots):
            self._warn_batchnorm(finished.size)
        return result

    def _normalised_by_batch(self, gradients: Gradients, finished: Results, roots: tuple[Any, ...]) -> bool:
        """Return whether a BatchNorm layer in training mode took part in a split step."""
        seen = gradients.batchnorm
        if seen & ROWS:
            return True
        # The graph cannot tell: inside a compiled graph; or over one row, InstanceNorm's or BatchNorm's on
        # micro-batches of one row. The modules the step reaches can, looked at only then.
        if not (seen & HIDDEN or (seen & ONE_ROW and finished.size == 1)):
            return False

        def look() -> list[weakref.ref[torch.nn.Module]]:
            return [weakref.ref(module) for module in modules_of(roots) if isinstance(module, _NormBase)]

        norms = [module for module in (ref() for ref in self.norms.get(roots, look)) if module is not None]
        if any(isinstance(module, _BatchNorm) and module.training for module in norms):
            return True
        return bool(seen & ONE_ROW and finished.size == 1 and not any(isinstance(m, _InstanceNorm) for m in norms))

    def _warn_batchnorm(self, size: int) -> None:
        self.warned_batchnorm = True
        warn_or_log(
            f"koila.accumulate split a step of {self.controller.name} into micro-batches of "
            f"{size} rows while a BatchNorm layer in training mode took part: it normalises "
            "each micro-batch with that micro-batch's statistics and updates its running statistics "
            "once per micro-batch, so the step differs from the full batch's. Use GroupNorm or "
            "LayerNorm, or never split the batch: minimum=<batch size> raises BatchSizeExhausted "
            "instead. This warning is shown once.",
            UserWarning,
            stacklevel=levels_to_caller(),
        )

    def _sharded_step(self, roots: tuple[Any, ...]) -> ShardedStep | None:
        """Return what a step over FSDP2 modules does about their gradients, if it reaches any."""
        if not self.controller.fsdp_modules:
            return None
        # Every module the step reaches: the backward writes .grad of unsharded ones too.
        return ShardedStep(modules_of(roots))

    def _sharded_alone(self, roots: tuple[Any, ...]) -> ShardedStep | None:
        """Return what a step without agreement (one rank, ``sync=False``) does about the FSDP2 modules it reaches."""
        # Nothing to exchange, but FSDP2's hooks must see the backward write .grad (captured, the
        # gradients would never reach them), and its state be reset after a failed attempt.
        modules = self._sharded_modules(roots) if distributed.is_running() else []
        return ShardedStep(modules, alone=True) if modules else None

    def _sharded_modules(self, roots: tuple[Any, ...]) -> list[torch.nn.Module]:
        """Return the modules a step reaches if one is an FSDP2 module, else none."""

        def look() -> list[weakref.ref[torch.nn.Module]]:
            modules = modules_of(roots)
            return [weakref.ref(module) for module in modules] if fsdp_modules(modules) else []

        return [module for module in (ref() for ref in self.sharded.get(roots, look)) if module is not None]

    def _planned(self, split: Split, attempt: Attempt, plan: ShardedStep | Overlap) -> Any:
        """Run a step over FSDP2 or DDP modules: micro-batches with a plain backward, the last one's reduced."""
        rows = split.rows
        retain = any(tensor.grad_fn is not None for tensor in split.tensors)
        wanted = torch.is_grad_enabled()  # the caller's, as Gradients.grad_mode
        fn = _step(split)
        overlap = plan if isinstance(plan, Overlap) else None
        # The plan looks after its modules' parameters; what else the backward writes is found in each graph.
        others = OtherLeaves(plan.owned)
        kept = split.contents()  # the whole batch runs on the caller's containers: put back after it failed

        def work(size: int) -> Results:
            # Sync on for the last micro-batch only, as FSDP2 and DDP document. The first begins before
            # anything of the attempt can run out of memory: a rank that fails then plays along all of it.
            last = -(-rows // size) - 1
            plan.micro_batch(last == 0, first=True)
            results = Results(self, size, split.tensors if size < rows else None)
            weights = self.weighing.weights(split, size) if size < rows else [1.0]
            pieces = list(split.pieces(size)) if size < rows else [(split.args, split.kwargs, rows)]
            backed = False
            for index, ((args, kwargs, count), weight) in enumerate(zip(pieces, weights, strict=True)):
                if index:
                    plan.micro_batch(index == last, first=False)
                if torch.is_grad_enabled() is not wanted:  # as in _micro_batch
                    torch._C._set_grad_enabled(wanted)
                loss = results.add(own_backward.call(fn, self.controller.name, args, kwargs), weight, count)
                if loss.requires_grad and wanted:
                    # A micro-batch that weighs nothing runs its backward too: FSDP2's collectives and DDP's
                    # reducer follow the backward, the same on every rank whatever its data weighs, and the
                    # last one's reduces the step's gradients. What it writes is zeros: its loss's own
                    # backward may be 0/0 (a mean over no items), which loss * 0 would spread. The plan's
                    # leaves too, which a backward of a reentrant checkpoint's own writes unseen by the walk.
                    weighted = _weighed(loss, weight) if weight != 1.0 else loss
                    leaves = others.see(weighted)
                    if overlap is not None:
                        overlap.backward_begins(index == last)
                    # Into .grad, not captured: FSDP2's and DDP's hooks reduce what the backward writes.
                    if weight != 0.0:
                        self.backward(weighted, retain)
                    else:
                        with zeroed([*leaves, *plan.accumulated()]):
                            self.backward(weighted, retain)
                    del weighted, leaves
                    if overlap is not None:
                        overlap.backward_ended()
                    backed = True
                del loss, args, kwargs
            if not backed:
                self._check_no_grad_wanted(split, wanted)
            if overlap is not None:
                overlap.finished(self.controller.name)
            results.finish()  # inside the attempt (see Results.finish)
            return results

        def undo() -> None:
            plan.undo()
            others.undo()
            if kept is not None:
                kept.restore()

        # The parameters' gradients set aside, added back after: not safe while another thread trains
        # the model, which neither FSDP2 nor DDP allows anyway.
        plan.before()
        try:
            # A rank that failed plays along DDP's buckets before the ranks agree (see overlap.py).
            vote = None if overlap is None else overlap.play_along
            finished = run(attempt, work, rows=rows, vote=vote, undo=undo)
            result = finished.finish()
        except BaseException:
            plan.give_back()
            others.give_back()
            raise
        plan.restore()
        others.restore()
        if overlap is not None and finished.size < rows and not self.warned_batchnorm and overlap.batchnorm_trains():
            self._warn_batchnorm(finished.size)
        return result

    def _gradient_sync(self) -> GradientSync | None:
        """Return what averages the step's DDP gradients, if it trains a DDP module with grad on."""
        modules = distributed.joined(self.ddp, self.controller.ddp_modules)
        if not modules or not self.averages or not torch.is_grad_enabled():
            return None
        return GradientSync(modules)

    def _warn_comm_hook(self, modules: list[Any]) -> None:
        """Warn, once, that a step all-reducing after its backward does not call a DDP communication hook."""
        if not self.warned_comm_hook and any(getattr(module, "_comm_hooks", None) for module in modules):
            self.warned_comm_hook = True
            warnings.warn(
                f"{self.controller.name} trains a DistributedDataParallel module with a communication hook "
                "in a way that keeps DDP's overlap off (see docs/distributed.rst): koila.accumulate averages "
                "the gradients with a plain all-reduce once the ranks agree that the step succeeded, and the "
                "hook is not called. This warning is shown once.",
                UserWarning,
                stacklevel=levels_to_caller(),
            )

    def _estimated(self, split: Split, device: torch.device) -> AutoFirst:
        """Return what asks the estimates of a whole and a split step for the first size (``initial="auto"``)."""
        name, fn = self.controller.name, _step(split)

        def micro_batch(gradients: Gradients, args: tuple[Any, ...], kwargs: dict[str, Any], split: bool) -> None:
            # As ``_micro_batch``: a split step's loss weighed and let go of, with the buffer some losses keep
            # (mse_loss's). A plain backward, never a scaler's or an engine's ``backward=``: they would run on
            # meta tensors and keep state made from them (a GradScaler's scale), or count micro-steps.
            if torch.is_grad_enabled() is not gradients.grad_mode:  # as _micro_batch
                torch._C._set_grad_enabled(gradients.grad_mode)
            loss = loss_of(own_backward.call(fn, name, args, kwargs), name)
            if loss.requires_grad and gradients.grad_mode:
                weighted = _weighed(loss, 0.5) if split and self.mean else loss  # a sum's weighs 1: the loss itself
                del loss
                gradients.backward(plain_backward, weighted, False)

        def steps(count: int) -> Callable[..., None]:
            def step(*args: Any, **kwargs: Any) -> None:
                gradients = Gradients(not distributed.is_running())  # as _run runs it: direct, or captured
                try:
                    for _ in builtins.range(count):
                        micro_batch(gradients, args, kwargs, count > 1)
                except BaseException:  # an estimate that fails: it must let go of the leaves it holds
                    gradients.abandon()
                    raise
                gradients.restore()
                gradients.deliver()

            return step

        def estimated(count: int) -> Callable[[], MemoryEstimate]:
            def make() -> MemoryEstimate:
                # Only the ranks whose cache knows no size estimate: DDP's collectives must stay out of it.
                modules = distributed.joined(self.ddp, ddp_modules((fn, split.args, split.kwargs)))
                with GradientSync(modules).silent() if modules else contextlib.nullcontext():
                    return estimate_batch(steps(count), split, device=device)

            return make

        key = (self.identity, split.sample, device)
        return AutoFirst(
            key,
            split.rows,
            estimated(1),
            device,
            name,
            self.controller.cache,
            estimated(2),
            step=True,
            sample_bytes=split.per_sample,
            inputs=split.tensors,
        )

    def _run(
        self, split: Split, size: int, gradients: Gradients, attempt: Attempt | None, auto: AutoFirst | None = None
    ) -> Results:
        """Run the step over every micro-batch of ``size`` rows, with backward unless none is needed."""
        rows = split.rows
        if self.replay is not None and size >= rows:
            failed = self.replay()
            if failed is not None:  # the whole batch failed already, outside: this attempt is that failure
                raise Replayed(*failed)
        results = Results(self, size, split.tensors if size < rows else None)
        # The whole batch runs on the caller's containers, and each piece on the per-row records they hold: what
        # a failed attempt changed there (batch.pop("labels"), a record's boxes) is put back.
        kept = split.contents()
        try:
            # An argument made by a graph outside the step (``step(encoder(x), y)``) is backed through by
            # every micro-batch and retry: that graph must outlive each backward (freed with the arguments).
            # A loop, not any() over a generator: every call of a step pays for this.
            retain = False
            for tensor in split.tensors:
                if tensor.grad_fn is not None:
                    retain = True
                    break
            meter = None if attempt is None else attempt.meter
            if meter is not None:
                backed = self._measured(split, size, gradients, cast(Attempt, attempt), meter, results, retain, auto)
            elif size >= rows:  # the happy path: the batch as given, one forward, one backward
                result = own_backward.call(_step(split), self.controller.name, split.args, split.kwargs)
                loss = results.add(result, 1.0, rows)
                if loss.requires_grad and gradients.grad_mode:
                    gradients.backward(self.backward, loss, retain)
                else:
                    self._check_no_grad_wanted(split, gradients.grad_mode)
                return results
            else:
                backed = False  # whether any micro-batch's loss needed a gradient, as the whole one's would
                weights = self.weighing.weights(split, size)
                for (chunk_args, chunk_kwargs, count), weight in zip(split.pieces(size), weights, strict=True):
                    backed = (
                        self._micro_batch(split, chunk_args, chunk_kwargs, count, weight, results, gradients, retain)
                        or backed
                    )
                    del chunk_args, chunk_kwargs  # not alive during the next forward
            if not backed:
                self._check_no_grad_wanted(split, gradients.grad_mode)
            return results
        except BaseException as error:
            if kept is not None:
                kept.restore()
            results.drop()  # the error's traceback holds this frame: what the micro-batches returned would outlive it
            release_ours(error)  # and the frames below, of a micro-batch's result and what was kept
            raise

    def _micro_batch(
        self,
        split: Split,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        rows: int,
        weight: float,
        results: Results,
        gradients: Gradients,
        retain: bool,
    ) -> bool:
        """Run one micro-batch, forward and weighted backward; return whether its loss needed a gradient."""
        if torch.is_grad_enabled() is not gradients.grad_mode:  # a micro-batch before turned it off (or on)
            torch._C._set_grad_enabled(gradients.grad_mode)  # each forward runs as the whole batch's would
        result = own_backward.call(_step(split), self.controller.name, args, kwargs)
        loss = results.add(result, weight, rows)
        del result
        # One that needs no gradient (no rows counted, say), or counts no items, adds nothing: no backward,
        # whose 0/0 would reach leaves that an inner backward (a reentrant checkpoint's) writes unseen.
        if not (loss.requires_grad and gradients.grad_mode) or weight == 0.0:
            return False
        if weight != 1.0:
            weighted = _weighed(loss, weight)
            results.weighed(weighted)
        else:
            weighted = loss
        del loss
        try:
            gradients.backward(self.backward, weighted, retain)
        except RuntimeError as error:
            if _FREED in str(error) and hasattr(error, "add_note"):  # Python 3.11 on
                error.add_note(_OUTSIDE_GRAPH.format(name=self.controller.name))
            raise
        return True

    def _measured(
        self,
        split: Split,
        size: int,
        gradients: Gradients,
        attempt: Attempt,
        meter: PeakMeter,
        results: Results,
        retain: bool,
        auto: AutoFirst | None,
    ) -> bool:
        """Run the first micro-batch measured, the rest at the corrected size; return whether a loss needed grad."""
        rows = split.rows
        first = min(size, rows)
        weighing = self.weighing
        total, head, by_items = weighing.items(split, first)
        if first < rows and weighing.weight is None:
            weighing.warn_if_ignored(split)
        args, kwargs = split.chunk(0, first)
        # Part of the step, weighed as any other: each micro-batch by its own rows (or items), whatever its size.
        weight = head / total if self.mean else 1.0
        with meter:
            backed = self._micro_batch(split, args, kwargs, first, weight, results, gradients, retain)
            del args, kwargs
        size = attempt.calibrate(first, meter.rise)
        if first >= rows:
            return backed
        if size >= rows:
            # The step is split already: the rest holds every gradient and the next micro-batch's.
            size = auto.split_rows() if auto is not None else max(rows // 2, 1)
        results.size = min(first, size)
        # The rest is measured too, as a split step at the corrected size: what the probe's
        # gradients hold was allocated before it, and is part of a split step's own memory.
        held = gradients.written_bytes()
        with meter:
            for begin in builtins.range(first, rows, size):
                end = min(begin + size, rows)
                args, kwargs = split.chunk(begin, end)
                weight = weighing.weight_of(args, kwargs, end - begin, total, by_items)
                backed = (
                    self._micro_batch(split, args, kwargs, end - begin, weight, results, gradients, retain) or backed
                )
                del args, kwargs
        if attempt.meter is not None:
            attempt.calibrate(min(size, rows - first), meter.rise + held)
        return backed

    def _check_no_grad_wanted(self, split: Split, grad_mode: bool) -> None:
        """Refuse a loss that needs no gradient where the caller's ``grad_mode`` wants one; no backward ran."""
        if grad_mode:
            owner = trainable_module(_step(split), split.args, split.kwargs)
            if owner is not None:
                raise RuntimeError(
                    f"{self.controller.name} returned a loss that does not require grad, while grad mode is "
                    f"on and {owner} has parameters that do: was the loss detached, made from .item(), or "
                    "computed under torch.no_grad()? Return the loss tensor itself"
                )
