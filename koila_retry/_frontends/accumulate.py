"""The front end that splits a training step into micro-batches: ``accumulate``.

A step is one call of the engine, and the whole step is the attempt: an
out-of-memory error in any micro-batch throws away the gradients the step had
computed so far and runs the step again at the next smaller size. The step's
gradients are kept apart from ``.grad`` while it runs (each backward runs as
``torch.autograd.grad``) and added into ``.grad`` through autograd once it
succeeded, so ``.grad`` is never written by a step that fails, nor behind the
back of another thread's backward through the same model.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import math
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, NoReturn, ParamSpec, TypeVar, cast, overload

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointFunction

from koila_retry._common.batches import Split
from koila_retry._common.places import levels_to_caller
from koila_retry._common.results import flatten, flatten_with_path
from koila_retry._common.tensors import TensorBase
from koila_retry._common.walk import call_references
from koila_retry._common.warn import warn_or_log
from koila_retry._core import distributed
from koila_retry._core.cache import function_identity
from koila_retry._core.distributed import GradientSync, ddp_modules, modules_of
from koila_retry._core.engine import Attempt, Call, Controller, run
from koila_retry._core.memory import PeakMeter
from koila_retry._core.policy import Options, Policy
from koila_retry._core.sharded import ShardedStep, fsdp_modules
from koila_retry._diagnostics import exhausted
from koila_retry._estimation.estimate import AUTO, AutoFirst, MemoryEstimate, check_auto, estimate_batch
from koila_retry._frontends import own_backward
from koila_retry._frontends.batch import Batched, refuse_generator, with_controller

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["accumulate"]

P = ParamSpec("P")
R = TypeVar("R")

_REDUCTIONS = ("mean", "sum")
# The autograd node that writes a leaf's ``.grad``.
_AccumulateGrad = getattr(torch._C._functions, "AccumulateGrad")  # noqa: B009 (not in the stubs)
# The backward nodes of batch normalisation; those of training mode save ``training=True``,
# or always train (``WithUpdate``). Found in the graph, they cost nothing to watch for.
_BatchNormNodes = frozenset(
    getattr(torch._C._functions, name)
    for name in (
        "NativeBatchNormBackward0",
        "NativeBatchNormLegitBackward0",
        "NativeBatchNormLegitBackward1",
        "CudnnBatchNormBackward0",
        "MiopenBatchNormBackward0",
        "BatchNormWithUpdateBackward0",
    )
    if hasattr(torch._C._functions, name)
)
# Reentrant checkpointing runs a backward of its own inside this node, writing gradients
# of leaves that the graph around it does not lead to.
_ReentrantCheckpoint = CheckpointFunction._backward_cls

# The gradients from this size up are added into the step's sums as soon as autograd has
# computed them (see ``_Gradients.capture``); smaller ones are held until the end of their
# backward, which costs a little memory (a bias, a norm's weight) and saves a call into
# Python for each (some 20 us each).
_EARLY_BYTES = 64 * 1024

# What becomes of each leaf of a result: the loss; one row per row of the batch, joined;
# a number or per-batch tensor of floats, weighted like the loss; one of integers (a
# count), added up; anything else, dropped.
_LOSS, _JOIN, _WEIGH, _COUNT, _DROP = "loss", "join", "weigh", "count", "drop"
_LEAF_SPEC = tree_flatten(0)[1]


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
    was given: a scalar tensor, or a tuple or list whose first item is the loss,
    or a dict whose ``"loss"`` entry is. Calling it runs the step and its
    backward pass: ``loss.backward()``, or ``backward(loss)`` with a training
    engine's ``backward=``. If the whole batch fits, that is one forward and one
    backward. If not, the tensor arguments are split into micro-batches of a
    power of two rows (the last takes the remainder), and each micro-batch's
    loss is weighted by its share of the rows (``reduction="mean"``) or not at
    all (``"sum"``) before its backward, so that the gradients add up to the
    full batch's. The step's gradients are kept apart from ``.grad`` while it
    runs, and added into it, through autograd, once it succeeded: in place
    where a gradient is already there, so the optimizer sees it plus the
    full-batch gradient, as after a plain ``backward()``. An out-of-memory
    error in any micro-batch discards what the step computed and runs it again
    at the next smaller size; a call that fails leaves ``.grad`` as it was.
    Threads that train one model at once may each call a step: their
    gradients add up in ``.grad`` as their plain ``backward()`` calls would.
    A tensor hook on a parameter (``register_hook``) sees each backward's
    gradient once, and a post-accumulate-grad hook runs once per step.

    The call returns the full-batch loss, detached: the weighted sum of the
    micro-batches' losses. Other items of a tuple, list, dict or dataclass
    result (a Hugging Face ``ModelOutput``) are combined too, leaf by leaf, and
    detached: tensors with a ``dim`` are concatenated along it; numbers and
    0-dimensional tensors are weighted like the loss; other objects (a model's
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
        ddp (DistributedDataParallel or list, optional): the DDP module the
            step trains, or a list of them. Their micro-batches run under
            ``no_sync()`` and the gradients are averaged across ranks once
            per step, after the ranks agreed that it succeeded everywhere.
            Default: the DDP modules the step reaches (through its
            arguments, closure, globals or ``self``), found at its first call.
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
            or ``weight`` counts something other than a number >= 0, or
            nothing in the whole batch.
        NotImplementedError: when called, if ranks agree and the step
            reaches an FSDP or tensor-parallel module.
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
    averages: bool = True,
    options: Options,
) -> Callable[[Callable[P, R]], Batched[P, R]]:
    """Check the arguments of :func:`accumulate` once; return what decorates a step with them.

    Args:
        initial, dim, reduction, weight, scaler, backward, ddp: as :func:`accumulate` takes them.
        averages (bool): whether the step averages the gradients of the DDP
            modules it trains, once the ranks agreed (what :func:`accumulate`
            does). ``False`` for a step that runs inside a DDP module's forward,
            as Lightning runs ``training_step``: DDP's own backward, after the
            step, averages what the step left in ``.grad``. The ranks still agree
            on every size.
        options (Options): the shared options.

    Returns:
        callable: takes a step, returns it wrapped.

    Raises:
        TypeError, ValueError: as :func:`accumulate` raises them.
    """
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
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
    if scaler is not None and not callable(getattr(scaler, "scale", None)):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (or have its scale()), got {type(scaler).__name__}")
    if backward is not None and not callable(backward):
        raise TypeError(
            "backward must be a callable that runs the backward pass of a loss, such as accelerator.backward "
            f"or fabric.backward, got {type(backward).__name__} {backward!r:.200}"
        )
    if backward is not None and scaler is not None:
        raise ValueError(
            "backward= and scaler= both scale the loss: a training engine's backward does its own loss scaling "
            "(accelerate's or Lightning Fabric's mixed precision), so pass one of them: backward= with the "
            "engine, or scaler= with a plain torch.amp.GradScaler"
        )
    run_backward = _backward_of(backward, scaler)
    check_auto(initial)
    given = _given_ddp(ddp)
    if given and options.get("sync") is False:
        raise ValueError(
            "ddp= averages gradients after the ranks agree on the step, and sync=False turns agreement off: "
            "drop one of them"
        )
    if given and options.get("group") is None:
        options = {**options, "group": given[0].process_group}
    policy = Policy.of("koila.accumulate", None if initial == AUTO else cast("int | None", initial), options, rows=True)

    def decorate(function: Callable[P, R]) -> Batched[P, R]:
        if not callable(function):
            raise TypeError(f"@koila.accumulate decorates a callable, got {type(function).__name__} {function!r}")
        if inspect.iscoroutinefunction(function):
            raise TypeError("@koila.accumulate runs backward() itself and cannot wrap an async function")
        refuse_generator(function, "@koila.accumulate")
        own_backward.guard()  # a backward the step runs itself is refused (see own_backward)
        name = getattr(function, "__qualname__", None) or type(function).__qualname__
        controller = Controller(name, policy, explain=exhausted.message)
        auto = initial == AUTO
        step = _Accumulator(function, controller, dim, reduction == "mean", run_backward, policy.device, auto)
        step.weight = weight
        step.ddp = given
        step.averages = averages
        getframe = sys._getframe

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return step(args, kwargs, getframe(1))

        return cast(Batched[P, R], with_controller(wrapper, controller))

    return decorate


class _Accumulator:
    """One decorated step: runs calls of it, whole or in micro-batches."""

    def __init__(
        self,
        fn: Callable[..., Any],
        controller: Controller,
        dim: int,
        mean: bool,
        backward: _Backward,
        device: torch.device | None,
        auto: bool = False,
    ) -> None:
        self.fn, self.controller, self.dim, self.mean = fn, controller, dim, mean
        self.backward, self.device, self.auto = backward, device, auto
        self.identity = function_identity(fn)
        self.warned_batchnorm = False
        self.warned_checkpoint = False
        self.warned_comm_hook = False
        self.warned_ignored = False
        self.warned_dropped = False
        self.weight: Callable[..., Any] | None = None  # given by weight=: items per micro-batch
        self.ddp: list[Any] = []  # given by ddp=; else found by the controller
        self.averages = True  # see accumulator()
        # Whether the step reaches FSDP2 modules, looked at once where that decides anything:
        # at the first call without agreement, or with initial="auto", while a process group runs.
        self.alone_sharded: bool | None = None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], caller: FrameType) -> Any:
        split = Split(args, kwargs, self.dim, "koila.accumulate", self.fn)
        rows = split.rows
        if rows == 0:
            raise ValueError(f"{self.controller.name} was given a batch of 0 rows along dim {self.dim}")
        device = self.device or split.device
        roots = (self.fn, split.args, split.kwargs)
        if self.auto and self.alone_sharded is None and distributed.is_running():
            self._refuse_sharded_estimate(roots)
        first = self._estimated(split, device) if self.auto else None
        call = Call(self.identity, caller, device, split.sample, rows, first, roots=roots, per_sample=split.per_sample)
        attempt = self.controller.start(call)
        shards = self._sharded_step(roots) if attempt.agrees else self._sharded_alone(roots)
        if shards is not None:
            return self._sharded(split, attempt, shards)
        sync = self._gradient_sync() if attempt.agrees else None
        if sync is not None:
            sync.before_step()
        gradients = _Gradients()

        def work(size: int) -> _Results:
            if sync is None:
                return self._run(split, size, gradients, attempt, first)
            with sync.no_sync():
                results = self._run(split, size, gradients, attempt, first)
            gradients.own()  # the averages are written into the sums, made now while memory may fail the attempt
            sync.prepare(gradients.sums, gradients.leaves)
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
        except BaseException:
            gradients.discard()
            gradients.restore()
            raise
        gradients.restore()
        gradients.deliver()
        # The step's gradients are in .grad now: a warning that a filter makes an error must
        # not make a step that succeeded raise (warn_or_log logs it then).
        if gradients.hidden and not self.warned_checkpoint:
            self.warned_checkpoint = True
            warn_or_log(
                f"{self.controller.name} checkpoints a function that is not a module with "
                "torch.utils.checkpoint(use_reentrant=True): the gradients its own backward writes cannot be "
                "found, so an out-of-memory error part-way through a step could leave some of them written "
                "twice. Use use_reentrant=False, or checkpoint a module. This warning is shown once.",
                UserWarning,
                stacklevel=3,
            )
        if gradients.batchnorm and finished.size < rows and not self.warned_batchnorm:
            self.warned_batchnorm = True
            warn_or_log(
                f"koila.accumulate split a step of {self.controller.name} into micro-batches of "
                f"{finished.size} rows while a BatchNorm layer in training mode took part: it normalises "
                "each micro-batch with that micro-batch's statistics and updates its running statistics "
                "once per micro-batch, so the step differs from the full batch's. Use GroupNorm or "
                "LayerNorm, or never split the batch: minimum=<batch size> raises BatchSizeExhausted "
                "instead. This warning is shown once.",
                UserWarning,
                stacklevel=3,
            )
        return result

    def _refuse_sharded_estimate(self, roots: tuple[Any, ...]) -> None:
        """Refuse ``initial="auto"`` over FSDP2 modules, at the first call, before any rank estimates.

        The estimate would run FSDP2's hooks, whose collectives only the ranks
        that estimate would make.
        """
        modules = modules_of(roots)
        self.alone_sharded = bool(fsdp_modules(modules))
        if self.alone_sharded:
            raise NotImplementedError(
                f"{self.controller.name} trains an FSDP2 module (fully_shard) with initial='auto': the estimate "
                "does not cover sharded modules yet. Pass initial=<rows> or None"
            )

    def _sharded_step(self, roots: tuple[Any, ...]) -> ShardedStep | None:
        """Return what a step over FSDP2 modules does about their gradients, if it reaches any."""
        if not self.controller.fsdp_modules:
            return None
        # Every module the step reaches: the backward writes .grad of unsharded ones too.
        return ShardedStep(modules_of(roots))

    def _sharded_alone(self, roots: tuple[Any, ...]) -> ShardedStep | None:
        """Return what a step over FSDP2 modules that runs without agreement does about them, if any.

        One rank, or ``sync=False``: nothing to exchange, but FSDP2's own hooks
        must see the backward write ``.grad`` (captured, the gradients would
        never reach them), and its state must be reset after a failed attempt.
        Whether the step reaches any is looked at on its first call with a
        process group only: every call would pay for the look otherwise.
        """
        if self.alone_sharded is False or not distributed.is_running():
            return None
        modules = modules_of(roots)
        self.alone_sharded = bool(fsdp_modules(modules))
        return ShardedStep(modules, alone=True) if self.alone_sharded else None

    def _sharded(self, split: Split, attempt: Attempt, shards: ShardedStep) -> Any:
        """Run a step over FSDP2 modules: micro-batches with a plain backward, FSDP reducing the last one's.

        FSDP2's own hooks turn the unsharded gradients into sharded ones, so the
        backward runs as it is, writing ``.grad``, not captured as elsewhere: the
        gradients the parameters had are set aside by reference before the step
        and added back after it (not safe while another thread trains the model,
        which FSDP2 does not allow anyway). Gradient sync is off for every
        micro-batch but the last, as FSDP2 documents for gradient accumulation.
        """
        rows = split.rows
        retain = any(tensor.grad_fn is not None for tensor in split.tensors)

        def work(size: int) -> _Results:
            results = _Results(self, size)
            weights = self._weights(split, size) if size < rows else [1.0]
            pieces = list(split.pieces(size)) if size < rows else [(split.args, split.kwargs, rows)]
            backed = False
            for index, ((args, kwargs, count), weight) in enumerate(zip(pieces, weights, strict=True)):
                shards.micro_batch(index == len(pieces) - 1)
                loss = results.add(own_backward.call(self.fn, self.controller.name, args, kwargs), weight, count)
                if loss.requires_grad and weight != 0.0:
                    self.backward(loss * weight if weight != 1.0 else loss, retain)
                    backed = True
                del loss, args, kwargs
            if not backed:
                self._check_no_grad_wanted(split)
            return results

        shards.before()
        try:
            finished = run(attempt, work, rows=rows, undo=shards.undo)
            result = finished.finish()
        except BaseException:
            shards.give_back()
            raise
        shards.restore()
        return result

    def _gradient_sync(self) -> GradientSync | None:
        """Return what averages the step's DDP gradients, if it trains a DDP module with grad on."""
        modules = self.ddp or self.controller.ddp_modules
        if not modules or not self.averages or not torch.is_grad_enabled():
            return None
        if not self.warned_comm_hook and any(getattr(module, "_comm_hooks", None) for module in modules):
            self.warned_comm_hook = True
            warnings.warn(
                f"{self.controller.name} trains a DistributedDataParallel module with a communication hook: "
                "koila.accumulate averages the gradients with a plain all-reduce once the ranks agree that the "
                "step succeeded, and the hook is not called. This warning is shown once.",
                UserWarning,
                stacklevel=4,
            )
        return GradientSync(modules)

    def _estimated(self, split: Split, device: torch.device) -> AutoFirst:
        """Return what asks the memory estimates for the first micro-batch size (``initial="auto"``).

        Two steps are estimated: one micro-batch (the whole batch's step), and, when
        that does not fit, two, the second adding its gradients into the first's. A
        split step holds every gradient from its second micro-batch on, and autograd
        computes each incoming gradient into a new buffer before it is added into the
        step's; a whole step holds neither. The steps run as ``_run`` runs them: the
        gradients kept apart, then delivered into ``.grad``.
        """
        name = self.controller.name

        def micro_batch(gradients: _Gradients, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # The forward, then the backward captured as ``_run`` captures it. A plain
            # backward, never a scaler's or an engine's
            # ``backward=``: they would run on meta tensors and keep state made from them
            # (a GradScaler makes its scale on the loss's device, lazily), and an
            # engine's may count micro-steps or communicate. Scaling a scalar loss, or
            # weighing it, adds nothing to the peak.
            loss = _loss_of(own_backward.call(self.fn, name, args, kwargs), name)
            if loss.requires_grad:
                gradients.backward(_plain_backward, loss, False)

        def steps(count: int) -> Callable[..., None]:
            def step(*args: Any, **kwargs: Any) -> None:
                gradients = _Gradients()
                for _ in builtins.range(count):
                    micro_batch(gradients, args, kwargs)
                gradients.restore()
                gradients.deliver()

            return step

        def estimated(count: int) -> Callable[[], MemoryEstimate]:
            def make() -> MemoryEstimate:
                # Only the ranks whose cache knows no size estimate: DDP's collectives must stay out of it.
                modules = self.ddp or ddp_modules((self.fn, split.args, split.kwargs))
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
        )

    def _run(
        self, split: Split, size: int, gradients: _Gradients, attempt: Attempt, auto: AutoFirst | None = None
    ) -> _Results:
        """Run the step over every micro-batch of ``size`` rows, with backward unless none is needed."""
        rows = split.rows
        results = _Results(self, size)
        # An argument made by a graph outside the step (``step(encoder(x), y)``) is backed
        # through by every micro-batch, and again by a retry: that graph must outlive each
        # backward. It is freed with the arguments, as usual.
        retain = any(tensor.grad_fn is not None for tensor in split.tensors)
        meter = attempt.meter
        if meter is not None:
            backed = self._measured(split, size, gradients, attempt, meter, results, retain, auto)
        elif size >= rows:  # the happy path: the batch as given, one forward, one backward
            result = own_backward.call(self.fn, self.controller.name, split.args, split.kwargs)
            loss = results.add(result, 1.0, rows)
            if loss.requires_grad:
                gradients.backward(self.backward, loss, retain)
            else:
                self._check_no_grad_wanted(split)
            return results
        else:
            backed = False  # whether any micro-batch's loss needed a gradient, as the whole one's would
            weights = self._weights(split, size)
            for (chunk_args, chunk_kwargs, count), weight in zip(split.pieces(size), weights, strict=True):
                backed = (
                    self._micro_batch(chunk_args, chunk_kwargs, count, weight, results, gradients, retain) or backed
                )
                del chunk_args, chunk_kwargs  # not alive during the next forward
        if not backed:
            self._check_no_grad_wanted(split)
        return results

    def _micro_batch(
        self,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        rows: int,
        weight: float,
        results: _Results,
        gradients: _Gradients,
        retain: bool,
    ) -> bool:
        """Run one micro-batch, forward and weighted backward; return whether its loss needed a gradient."""
        result = own_backward.call(self.fn, self.controller.name, args, kwargs)
        loss = results.add(result, weight, rows)
        del result
        # One that needs no gradient (no rows counted, say), or counts no items, adds nothing.
        if not loss.requires_grad or weight == 0.0:
            return False
        weighted = loss * weight if weight != 1.0 else loss
        del loss
        gradients.backward(self.backward, weighted, retain)
        return True

    def _measured(
        self,
        split: Split,
        size: int,
        gradients: _Gradients,
        attempt: Attempt,
        meter: PeakMeter,
        results: _Results,
        retain: bool,
        auto: AutoFirst | None,
    ) -> bool:
        """Run the step with its first micro-batch measured, and the rest at the size the measurement corrects.

        The measured micro-batch is part of the step, weighed as any other: the
        micro-batches need not be of one size, since each is weighed by its own rows
        (or items, with ``weight=``). Returns whether any loss needed a gradient.
        """
        rows = split.rows
        first = min(size, rows)
        total = self._items(split, first)
        args, kwargs = split.chunk(0, first)
        weight = self._weight_of(args, kwargs, first, total)
        with meter:
            backed = self._micro_batch(args, kwargs, first, weight, results, gradients, retain)
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
                weight = self._weight_of(args, kwargs, end - begin, total)
                backed = self._micro_batch(args, kwargs, end - begin, weight, results, gradients, retain) or backed
                del args, kwargs
        if attempt.meter is not None:
            attempt.calibrate(min(size, rows - first), meter.rise + held)
        return backed

    def _items(self, split: Split, first: int) -> float:
        """Return the items of the whole batch that ``weight=`` counts (its rows without), counted in two parts."""
        if self.weight is None:
            return float(split.rows)
        counts = [self._count_of(*split.chunk(0, first))]
        if first < split.rows:
            counts.append(self._count_of(*split.chunk(first, split.rows)))
        return self._checked_total(math.fsum(counts))

    def _count_of(self, args: Sequence[Any], kwargs: dict[str, Any]) -> float:
        return _count(cast(Callable[..., Any], self.weight)(*args, **kwargs), self.controller.name)

    def _weight_of(self, args: Sequence[Any], kwargs: dict[str, Any], rows: int, total: float) -> float:
        """Return one micro-batch's weight: its share of the items (or rows) of a mean loss; 1 for a sum."""
        if not self.mean:
            return 1.0
        return (rows if self.weight is None else self._count_of(args, kwargs)) / total

    def _checked_total(self, total: float) -> float:
        if total == 0:
            raise ValueError(
                f"weight= counted 0 items in the whole batch of {self.controller.name}: the mean loss over them "
                "is undefined"
            )
        return total

    def _weights(self, split: Split, size: int) -> list[float]:
        """Return each micro-batch's weight: its share of the items ``weight=`` counts, or of the rows."""
        rows = split.rows
        if self.weight is None:
            if self.mean and not self.warned_ignored and _ignores_labels(split):
                self.warned_ignored = True
                # Usually in the retry that an out-of-memory error made: raised by a filter, it
                # would end the recovery.
                warn_or_log(
                    f"koila.accumulate split a step of {self.controller.name} whose batch has labels with "
                    "ignored entries (-100), and weighs its micro-batches by rows: that is exact only if every "
                    "row counts as many items. For a loss that is a mean over tokens, pass weight=, such as "
                    "weight=lambda batch: (batch['labels'][:, 1:] != -100).sum() for a causal language model "
                    "(see the docs: Training Hugging Face models). This warning is shown once.",
                    UserWarning,
                    stacklevel=levels_to_caller(),
                )
            return [min(size, rows - begin) / rows if self.mean else 1.0 for begin in builtins.range(0, rows, size)]
        counts = [self._count_of(args, kwargs) for args, kwargs, _ in split.pieces(size)]
        total = self._checked_total(math.fsum(counts))
        return [count / total for count in counts]

    def _check_no_grad_wanted(self, split: Split) -> None:
        """Refuse a loss that needs no gradient where one is clearly wanted; no backward ran."""
        if torch.is_grad_enabled():
            owner = _module_with_trainable_parameters(self.fn, split.args, split.kwargs)
            if owner is not None:
                raise RuntimeError(
                    f"{self.controller.name} returned a loss that does not require grad, while grad mode is "
                    f"on and {owner} has parameters that do: was the loss detached, made from .item(), or "
                    "computed under torch.no_grad()? Return the loss tensor itself"
                )


# Runs the backward pass of a (weighted) loss; the flag says whether to retain the graph.
_Backward = Callable[[torch.Tensor, bool], None]


def _backward_of(engine: Callable[..., Any] | None, scaler: Any) -> _Backward:
    """Return what runs each backward of a step, chosen once, when it is decorated."""
    if engine is not None:

        def engine_backward(loss: torch.Tensor, retain: bool) -> None:
            # The keyword only when it is needed: the engines pass it on to Tensor.backward.
            if retain:
                engine(loss, retain_graph=True)
            else:
                engine(loss)

        return engine_backward
    if scaler is not None:
        return _Scaled(scaler.scale)
    return _plain_backward


def _plain_backward(loss: torch.Tensor, retain: bool) -> None:
    """Run ``loss.backward()``: the step's backward without a scaler or an engine, and the estimate's."""
    loss.backward(retain_graph=retain)  # type: ignore[no-untyped-call]


class _Scaled:
    """Run the backward of a gradient scaler's ``scale(loss)``."""

    __slots__ = ("scale",)

    def __init__(self, scale: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.scale = scale

    def __call__(self, loss: torch.Tensor, retain: bool) -> None:
        self.scale(loss).backward(retain_graph=retain)  # type: ignore[no-untyped-call]


class _Gradients:
    """The gradients of one step, kept apart from ``.grad`` until the step succeeded.

    Every backward the step runs goes through :meth:`backward`, which runs it as
    ``torch.autograd.grad`` over the leaves its graph reaches and adds what comes back
    into buffers of its own, one per leaf (:attr:`sums`). ``.grad`` is not written
    while the step runs: another thread may be running a backward through the same
    model, and autograd adds into ``.grad`` under a lock of its own that a Python
    assignment to ``.grad`` does not take. When the step succeeded, :meth:`deliver`
    adds the sums into ``.grad`` through autograd, in one backward; when an attempt
    failed, :meth:`discard` drops them, and nothing of it was ever in ``.grad``.

    A backward that ``torch.autograd.grad`` cannot run (the graph holds a reentrant
    checkpoint, or the call asks for ``create_graph`` or gives ``inputs`` that are not
    leaves) runs as it is, writing ``.grad``: for it, the gradients the leaves had are
    set aside first (:attr:`aside`), what it wrote is moved into the sums after it, and
    the gradients set aside are given back by :meth:`restore`. That fallback writes
    ``.grad`` from Python, so it is not safe while another thread trains the model.

    Attributes:
        sums (dict): the step's gradient of each leaf so far, by ``id`` of the leaf.
        leaves (dict): the leaf of each sum, by its ``id``.
        hidden (bool): whether a backward may have written leaves the walk cannot find.
        batchnorm (bool): whether a batch normalisation in training mode took part.
    """

    __slots__ = ("aside", "batchnorm", "exposed", "hidden", "leaves", "lock", "owned", "sums")

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}
        self.leaves: dict[int, torch.Tensor] = {}
        # The sums that are tensors of this object's own, safe to add into in place; the
        # others are as autograd returned them, possibly views or shared between leaves.
        self.owned: set[int] = set()
        # The fallback's: the leaves whose ``.grad`` a plain backward may write, and the
        # gradients they had before it.
        self.exposed: dict[int, torch.Tensor] = {}
        self.aside: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.hidden = False
        self.batchnorm = False
        # Autograd runs the nodes of each device on a thread of its own; hooks that add into
        # the sums (see ``_taker``) may run on two at once.
        self.lock = threading.Lock()

    def backward(self, run: _Backward, loss: torch.Tensor, retain: bool) -> None:
        """Run ``run(loss, retain)`` with the backward passes it starts captured into :attr:`sums`.

        Args:
            run (callable): what runs the backward of the loss: ``loss.backward()``,
                a scaler's or a training engine's ``backward``.
            loss (torch.Tensor): the (weighted) loss of a micro-batch.
            retain (bool): whether to keep the graph for another backward.
        """
        # Known backward passes are captured directly, without the function mode, which
        # would send every call the backward makes through Python.
        if run is _plain_backward or type(run) is _Scaled:
            if run is not _plain_backward:
                loss = cast(_Scaled, run).scale(loss)

            def plain() -> None:
                torch.autograd.backward(loss, retain_graph=retain)

            self.capture(_Call((loss,), None, retain, False, None), plain)
            return
        with _Capture(self):
            run(loss, retain)

    def capture(self, call: _Call, plain: Callable[[], None]) -> None:
        """Run one backward as ``torch.autograd.grad`` into :attr:`sums`, or, when it cannot, as ``plain()``.

        Args:
            call (_Call): the backward as it was asked for.
            plain (callable): runs it as it was asked for, writing ``.grad``.
        """
        outputs, inputs = call.outputs, call.inputs
        found, reentrant, early = self._walk(outputs)
        odd = (
            call.create_graph
            or not all(isinstance(output, torch.Tensor) for output in outputs)
            or (inputs is not None and not all(_is_leaf(tensor) for tensor in inputs))
        )
        if reentrant or odd:
            self._plain(found, plain)
            return
        if inputs is not None:  # the engine's choice; each once
            found = list({id(tensor): tensor for tensor in inputs if tensor.requires_grad}.values())
            chosen = {id(tensor) for tensor in found}
            early = {node: [entry for entry in taken if id(entry[1]) in chosen] for node, taken in early.items()}
        if not found:  # a graph that reaches no leaf: nothing to capture, but its hooks may count
            plain()
            return
        # A leaf that has a sum already gets each gradient added into it as soon as the node
        # that computes it has run, and autograd.grad returns None for it: captured whole, the
        # gradients of a micro-batch would all be held beside the sums until the end of its
        # backward, twice the memory a plain backward into .grad needs.
        handles = [node.register_hook(self._taker(taken)) for node, taken in early.items() if taken]
        del early
        try:
            grads: list[torch.Tensor | None] = list(
                torch.autograd.grad(
                    cast("tuple[torch.Tensor, ...]", outputs),
                    found,
                    call.grad_outputs,
                    retain_graph=call.retain_graph,
                    allow_unused=True,
                )
            )
        finally:
            for handle in handles:
                handle.remove()
        present = [grad for grad in grads if grad is not None]
        shared = set()
        if len({id(grad) for grad in present}) < len(present):  # one tensor for several leaves, as x + y gives
            counts: dict[int, int] = {}
            for grad in present:
                counts[id(grad)] = counts.get(id(grad), 0) + 1
            shared = {key for key, count in counts.items() if count > 1}
        given = {id(grad) for grad in call.grad_outputs if grad is not None}
        del present
        sums, owned = self.sums, self.owned
        totals: list[torch.Tensor] = []
        added: list[torch.Tensor] = []
        for index, leaf in enumerate(found):
            gradient = grads[index]
            grads[index] = None
            if gradient is None:
                continue
            key = id(leaf)
            if key in owned and gradient.layout == torch.strided and sums[key].layout == torch.strided:
                totals.append(sums[key])  # the usual later micro-batch: all added in one call, below
                added.append(gradient)
            else:
                # Nothing else can see it, unless it went to several leaves, came in as
                # the gradient of an output, or a hook (which may have kept it) saw it.
                private = id(gradient) not in shared and id(gradient) not in given and not leaf._backward_hooks
                self._add(leaf, gradient, private)
            del gradient
        if totals:
            with self.lock:
                torch._foreach_add_(totals, added)

    def _taker(self, taken: list[tuple[int, torch.Tensor]]) -> Callable[..., tuple[torch.Tensor | None, ...]]:
        """Return a node's post hook that adds the gradients it computes for ``taken``'s leaves into their sums.

        The hook hands autograd ``None`` in their place: nothing is left to capture.
        It runs on the engine's thread for the node's device, one per device:
        :meth:`_add` locks.

        Args:
            taken (list): ``(output, leaf)``: which output of the node goes to which leaf.

        Returns:
            callable: the hook, for ``Node.register_hook``.
        """

        def take(grad_inputs: tuple[torch.Tensor | None, ...], _: Any) -> tuple[torch.Tensor | None, ...]:
            replaced = list(grad_inputs)
            for slot, leaf in taken:
                gradient = replaced[slot]
                if gradient is not None:
                    replaced[slot] = None
                    self._add(leaf, gradient)
            return tuple(replaced)

        return take

    def _add(self, leaf: torch.Tensor, gradient: torch.Tensor, private: bool = False) -> None:
        """Add one backward's gradient of ``leaf`` into its sum.

        The first becomes the sum as it is when it is ``private`` (nothing else can
        see it) and laid out as ``leaf`` (the layout autograd gives ``.grad``), or a
        copy of it in that layout, made now, when it is private only: what
        ``AccumulateGrad`` would do with it. Sums that are not private are added into
        out of place, and the new sum is.

        Args:
            leaf (torch.Tensor): the leaf.
            gradient (torch.Tensor): its gradient from one backward.
            private (bool): whether nothing but this call holds ``gradient``.
        """
        key = id(leaf)
        with self.lock:
            total = self.sums.get(key)
            if total is None:
                if private and gradient.layout == torch.strided:
                    if gradient.stride() != leaf.stride():
                        gradient = torch.empty_like(leaf, dtype=gradient.dtype).copy_(gradient)
                    self.owned.add(key)
                self.sums[key] = gradient
                self.leaves[key] = leaf
                return
            # Gradients have no graph, except a fallback's with create_graph=True, which is not kept.
            with torch.no_grad() if gradient.requires_grad else contextlib.nullcontext():
                if key in self.owned and (total.layout == torch.strided or total.layout == gradient.layout):
                    total.add_(gradient)
                    return
                if total.layout == torch.strided and gradient.layout == torch.strided:
                    total = torch.add(total, gradient, out=torch.empty_like(leaf, dtype=total.dtype))
                elif total.layout == torch.strided:
                    total = total + gradient
                else:  # a dense gradient onto a sparse sum: as autograd does, a new sum
                    total = gradient + total
                self.sums[key] = total
                self.owned.add(key)

    def _walk(self, outputs: Sequence[Any]) -> tuple[list[torch.Tensor], bool, dict[Any, list[tuple[int, Any]]]]:
        """Return what a backward of ``outputs`` writes.

        Returns:
            tuple: the leaves it reaches; whether it runs a reentrant checkpoint; and, for
            each node that computes a gradient of a leaf that has a sum (of
            ``_EARLY_BYTES`` or more, and without tensor hooks, which must see the
            gradient), which of its outputs go to which leaf.
        """
        found: dict[int, torch.Tensor] = {}
        sums = self.sums
        early: dict[Any, list[tuple[int, Any]]] = {}
        reentrant = False
        stack: list[Any] = []
        for output in outputs:
            node = output.grad_fn if isinstance(output, torch.Tensor) else getattr(output, "node", None)
            if node is not None:
                stack.append(node)
            elif isinstance(output, torch.Tensor) and output.requires_grad:  # the loss is itself a leaf
                found[id(output)] = output
        # The graph's nodes are not kept past the walk: after a backward that failed
        # half-way, those not yet run still hold their saved tensors.
        seen: set[Any] = set(stack)
        parent = None
        while stack:
            parent = stack.pop()
            for slot, (node, _) in enumerate(parent.next_functions):
                if node is None:
                    continue
                kind = type(node)
                if kind is _AccumulateGrad:  # every edge to it, for ``early``: no ``seen`` here
                    leaf = node.variable
                    if not leaf.requires_grad:  # turned off since the forward: autograd writes nothing
                        continue
                    key = id(leaf)
                    found[key] = leaf
                    if key in sums and not leaf._backward_hooks and leaf.numel() * leaf.element_size() >= _EARLY_BYTES:
                        early.setdefault(parent, []).append((slot, leaf))
                    continue
                if node in seen:
                    continue
                seen.add(node)
                if kind in _BatchNormNodes:
                    self.batchnorm = self.batchnorm or getattr(node, "_saved_training", True)
                elif kind is _ReentrantCheckpoint:
                    reentrant = True
                    for parameter in self._checkpointed(node):
                        found[id(parameter)] = parameter
                stack.append(node)
        del seen, stack, parent
        return list(found.values()), reentrant, early

    def _checkpointed(self, node: Any) -> list[torch.Tensor]:
        """Return the parameters a reentrant checkpoint's own backward writes, when it can tell."""
        function = getattr(node, "run_function", None)
        owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return [parameter for parameter in owner.parameters() if parameter.requires_grad]
        self.hidden = True
        return []

    def _plain(self, found: list[torch.Tensor], run: Callable[[], None]) -> None:
        """Run a backward that writes ``.grad`` itself, and move what it wrote into :attr:`sums`.

        Not safe while another thread trains the same model: ``.grad`` is set from
        Python, outside autograd's lock. Only for what ``torch.autograd.grad``
        cannot run (see the class).

        Args:
            found (list): the leaves the backward reaches.
            run (callable): runs the backward.
        """
        exposed, aside, sums = self.exposed, self.aside, self.sums
        for leaf in found:
            key = id(leaf)
            if key not in exposed:
                exposed[key] = leaf
                if leaf.grad is not None:
                    aside.append((leaf, leaf.grad))
                    leaf.grad = None
        # The step's gradients so far go into .grad, for the backward to add to in place, as
        # in a loop written by hand: beside .grad, they would need twice the memory.
        for key, leaf in exposed.items():
            if key in sums:
                self.own(key)
                self.owned.discard(key)
                del self.leaves[key]
                leaf.grad = sums.pop(key)
        run()
        for leaf in exposed.values():
            written = leaf.grad
            if written is not None:
                leaf.grad = None
                self._add(leaf, written, private=True)  # AccumulateGrad's: nothing else holds it

    def own(self, key: int | None = None) -> None:
        """Make a sum a tensor of this object's own, which may be written in place: by default, every sum.

        Args:
            key (int, optional): the ``id`` of the leaf whose sum to make one.
        """
        for each in list(self.sums) if key is None else [key]:
            if each not in self.owned:
                total = self.sums[each]
                if total.layout == torch.strided:
                    self.sums[each] = torch.empty_like(self.leaves[each], dtype=total.dtype).copy_(total)
                else:
                    self.sums[each] = total.clone()
                self.owned.add(each)

    def gradients_aside(self) -> dict[int, torch.Tensor]:
        """Return the gradients set aside while the step runs, by the ``id`` of their leaf.

        :func:`koila.report <koila_retry.report>` names them as the gradients of
        their parameters when a step gives up. Only a backward that writes ``.grad``
        itself sets any aside (see the class).

        Returns:
            dict[int, torch.Tensor]: each gradient set aside, by ``id`` of its leaf.
        """
        return {id(leaf): gradient for leaf, gradient in self.aside}

    def gradients_of_step(self) -> dict[int, torch.Tensor]:
        """Return the step's own gradients so far, by the ``id`` of their leaf.

        :func:`koila.report <koila_retry.report>` names them as the step's
        gradients of their parameters.

        Returns:
            dict[int, torch.Tensor]: the sum of each leaf's gradients, by ``id`` of the leaf.
        """
        return dict(self.sums)

    def written_bytes(self) -> int:
        """Return the bytes of the gradients the step has computed so far.

        Returns:
            int: the bytes of the storages of :attr:`sums`, each counted once.
        """
        storages = {}
        for total in self.sums.values():
            if total.layout == torch.strided:
                storage = total.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
        return sum(storages.values())

    def discard(self) -> None:
        """Forget every gradient the step computed, and what a plain backward left in ``.grad``."""
        self.sums, self.leaves, self.owned = {}, {}, set()
        for leaf in self.exposed.values():
            leaf.grad = None

    def restore(self) -> None:
        """Give back the gradients a plain backward's fallback set aside."""
        for leaf, before in self.aside:
            written = leaf.grad  # None, unless a backward wrote leaves the walk could not find
            if written is not None:
                with torch.no_grad():
                    if before.layout == torch.strided or written.layout == before.layout:
                        before.add_(written)
                    else:  # a dense gradient onto a sparse one: as autograd does, a new sum
                        before = before + written
            leaf.grad = before
        self.aside.clear()
        self.exposed.clear()

    def deliver(self) -> None:
        """Add the step's gradients into ``.grad`` through autograd, and forget them.

        One backward through :class:`_Deliver` hands each sum to its leaf's
        ``AccumulateGrad``, which takes the leaf's lock: where ``.grad`` is ``None``
        it becomes the sum itself (no copy, since nothing else holds it by then),
        and otherwise the sum is added into it in place, exactly as a plain
        ``backward()`` from another thread would add. Post-accumulate-grad hooks run
        there, once per step. A leaf with tensor hooks (``register_hook``) had them
        applied to each backward's gradient when it was captured: its sum is handed
        to its ``AccumulateGrad`` directly, which adds it under the same lock without
        running the hooks a second time.
        """
        sums, leaves = self.sums, self.leaves
        if not sums:
            return
        self.sums, self.leaves, self.owned = {}, {}, set()
        plain: list[torch.Tensor] = []
        box = _Box()
        hooked: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, total in sums.items():
            leaf = leaves[key]
            if leaf._backward_hooks:
                hooked.append((leaf, total))
            else:
                plain.append(leaf)
                box.gradients.append(total)
        # Only the box holds the sums now, so that AccumulateGrad may take them as they are.
        del sums, leaves, total
        if plain:
            with torch.enable_grad():
                done = _Deliver.apply(box, *plain)  # type: ignore[no-untyped-call]
            del plain
            torch.autograd.backward(done)
        if hooked:
            with torch.no_grad():
                for leaf, total in hooked:
                    accumulate = torch.autograd.graph.get_gradient_edge(leaf).node
                    cast(Any, accumulate)(total)


class _Box:
    """The gradients that a :class:`_Deliver` hands over, held nowhere else until it does."""

    __slots__ = ("gradients",)

    def __init__(self) -> None:
        self.gradients: list[torch.Tensor] = []

    def take(self) -> list[torch.Tensor]:
        gradients, self.gradients = self.gradients, []
        return gradients


class _Deliver(torch.autograd.Function):
    """A function of the leaves whose backward returns the step's gradients of them (see ``_Gradients.deliver``)."""

    @staticmethod
    def forward(ctx: Any, box: _Box, *leaves: torch.Tensor) -> torch.Tensor:
        ctx.box = box
        return torch.empty((), device=leaves[0].device)

    @staticmethod
    def backward(ctx: Any, *_: Any) -> tuple[Any, ...]:
        return (None, *ctx.box.take())


class _Call:
    """A backward pass as it was asked for: ``Tensor.backward`` or ``torch.autograd.backward``'s arguments."""

    __slots__ = ("create_graph", "grad_outputs", "inputs", "outputs", "retain_graph")

    def __init__(
        self,
        outputs: tuple[Any, ...],
        grad_outputs: Any,
        retain_graph: bool | None,
        create_graph: bool,
        inputs: Any,
    ) -> None:
        self.outputs = outputs
        if grad_outputs is None:
            grad_outputs = (None,) * len(outputs)
        elif isinstance(grad_outputs, torch.Tensor):
            grad_outputs = (grad_outputs,)
        self.grad_outputs: tuple[torch.Tensor | None, ...] = tuple(grad_outputs)
        self.retain_graph, self.create_graph = retain_graph, create_graph
        if isinstance(inputs, dict):
            inputs = tuple(inputs.values())
        elif isinstance(inputs, torch.Tensor) or (inputs is not None and not isinstance(inputs, Sequence)):
            inputs = (inputs,)
        self.inputs: tuple[Any, ...] | None = None if inputs is None else tuple(inputs)


def _tensor_backward(
    self: torch.Tensor,
    gradient: torch.Tensor | None = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> _Call:
    return _Call((self,), gradient, retain_graph, create_graph, inputs)


def _autograd_backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
) -> _Call:
    outputs = (tensors,) if not isinstance(tensors, Sequence) else tuple(tensors)
    return _Call(outputs, grad_variables if grad_tensors is None else grad_tensors, retain_graph, create_graph, inputs)


def _is_leaf(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.grad_fn is None


_TENSOR_BACKWARD = torch.Tensor.backward
_AUTOGRAD_BACKWARD = torch.autograd.backward


class _Capture(TorchFunctionMode):
    """Run the backward passes started inside it (``Tensor.backward``, ``torch.autograd.backward``) as captures.

    A function mode is this thread's only: other threads' backward passes through the
    same model are not seen. It is on only while a backward of the step runs, not
    during its forward.
    """

    def __init__(self, gradients: _Gradients) -> None:
        super().__init__()
        self.gradients = gradients

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is _TENSOR_BACKWARD:
            call = _tensor_backward(*args, **kwargs)
        elif func is _AUTOGRAD_BACKWARD:
            call = _autograd_backward(*args, **kwargs)
        else:
            return func(*args, **kwargs)
        self.gradients.capture(call, lambda: func(*args, **kwargs))
        return None


class _Results:
    """The results of a step's micro-batches: checked as they come, combined at the end."""

    __slots__ = ("columns", "kinds", "size", "spec", "step")

    def __init__(self, step: _Accumulator, size: int) -> None:
        self.step, self.size = step, size
        self.spec: TreeSpec | None = None
        self.kinds: list[str] = []
        self.columns: list[list[Any]] = []

    def add(self, result: Any, weight: float, rows: int) -> torch.Tensor:
        """Check one micro-batch's result, keep its parts, and return its loss.

        Args:
            result (Any): what the step returned for the micro-batch.
            weight (float): the micro-batch's share, as its loss is weighted.
            rows (int): the micro-batch's rows: a tensor with as many along ``dim``
                has one per row, and is joined.

        Returns:
            torch.Tensor: the loss.
        """
        loss = _loss_of(result, self.step.controller.name)
        if loss is result:  # the usual case, kept without flattening
            if self.spec is None:
                self.spec, self.kinds, self.columns = _LEAF_SPEC, [_LOSS], [[]]
            elif self.spec is not _LEAF_SPEC:
                self._changed(_LEAF_SPEC)
            self.columns[0].append((_kept(loss), weight))
            return cast(torch.Tensor, loss)  # the identity check above leaves mypy with Any
        leaves, spec = flatten(result)
        kinds = [self._kind(leaf, loss, rows) for leaf in leaves]
        if self.spec is None:
            self.spec, self.kinds, self.columns = spec, kinds, [[] for _ in leaves]
            if _DROP in kinds:
                self._dropping(result, kinds)
        elif spec != self.spec:
            self._changed(spec)
        elif kinds != self.kinds:
            self._rows_changed(result, kinds, rows)
        for column, kind, leaf in zip(self.columns, kinds, leaves, strict=True):
            if kind == _DROP:
                continue
            if kind == _JOIN:
                column.append(leaf.detach())
            else:
                column.append((_kept(leaf) if isinstance(leaf, TensorBase) else leaf, weight))
        return loss

    def _changed(self, spec: TreeSpec) -> NoReturn:
        raise ValueError(
            f"{self.step.controller.name} returned results of different structures for different "
            f"micro-batches: {self.spec} and then {spec}"
        )

    def _kind(self, leaf: Any, loss: torch.Tensor, rows: int) -> str:
        if leaf is loss:
            return _LOSS
        if not isinstance(leaf, TensorBase):
            if isinstance(leaf, bool) or not isinstance(leaf, (int, float)):
                return _DROP
            return _COUNT if isinstance(leaf, int) else _WEIGH
        dim = self.step.dim
        if -leaf.dim() <= dim < leaf.dim() and leaf.size(dim) == rows:
            return _JOIN
        # A value of the whole micro-batch (a mean, a count per class): the same shape
        # whatever the rows, so that the result's shape never depends on the split.
        return _WEIGH if leaf.is_floating_point() or leaf.is_complex() else _COUNT

    def _rows_changed(self, result: Any, kinds: list[str], rows: int) -> NoReturn:
        paths = flatten_with_path(result)
        path, leaf, kind = next(
            (path, leaf, kind)
            for (path, leaf), kind, before in zip(paths, kinds, self.kinds, strict=True)
            if kind != before
        )
        raise ValueError(
            f"{self.step.controller.name} returned {_describe(leaf)} at the result{keystr(path)} for a micro-batch "
            f"of {rows} rows, which {'has one row per row' if kind == _JOIN else 'is not one row per row'} of it, "
            f"unlike for the micro-batch before: a tensor with as many rows along dim {self.step.dim} as its "
            "micro-batch is joined, any other is a value of the whole micro-batch, and each must be the same "
            "kind in every micro-batch"
        )

    def _dropping(self, result: Any, kinds: list[str]) -> None:
        """Warn, once per step, that the leaves of ``result`` that cannot be combined come back as ``None``."""
        step = self.step
        if step.warned_dropped:
            return
        step.warned_dropped = True
        paths = flatten_with_path(result)
        dropped = [
            f"the result{keystr(path)} ({type(leaf).__name__})"
            for (path, leaf), kind in zip(paths, kinds, strict=True)
            if kind == _DROP
        ]
        warnings.warn(
            f"{step.controller.name} returned {', '.join(dropped)}: koila.accumulate combines tensors and "
            "numbers across micro-batches, and returns other objects (a model's key-value cache, strings, "
            "flags) as None, split or not. This warning is shown once.",
            UserWarning,
            stacklevel=levels_to_caller(),
        )

    def finish(self) -> Any:
        if self.spec is _LEAF_SPEC and len(self.columns[0]) == 1:  # one loss, as it came
            return self.columns[0][0][0]
        combined: list[Any] = []
        for kind, column in zip(self.kinds, self.columns, strict=True):
            if kind == _DROP:
                combined.append(None)
                continue
            if kind in (_LOSS, _WEIGH):
                # A micro-batch that counts no items (weight=) adds nothing, not its loss's nan times 0.
                column = [entry for entry in column if entry[1] != 0.0]
            if kind == _JOIN:
                combined.append(column[0] if len(column) == 1 else torch.cat(column, dim=self.step.dim))
            elif kind == _COUNT:  # counts add up to the whole batch's, in their own type
                counts = [value for value, _ in column]
                if len(counts) == 1:
                    combined.append(counts[0])
                elif isinstance(counts[0], TensorBase):  # booleans add up to whether any is true
                    combined.append(torch.stack(counts).sum(0).to(counts[0].dtype))
                else:
                    combined.append(sum(counts))
            elif isinstance(column[0][0], TensorBase):  # sum(value * weight) in a few operations
                values = torch.stack([value for value, _ in column])
                if all(weight == 1.0 for _, weight in column):
                    combined.append(values.sum(0))
                    continue
                # A count's weighted sum is a fraction; a half-precision loss is summed in float32,
                # so that its weights are not rounded to bf16.
                dtype = values.dtype if values.is_floating_point() else torch.get_default_dtype()
                exact = torch.promote_types(dtype, torch.float32)
                weights = torch.tensor([weight for _, weight in column], dtype=torch.float64)
                total = torch.tensordot(weights.to(values.device, exact), values.to(exact), dims=1)
                combined.append(total.to(dtype))
            else:
                combined.append(sum(value if weight == 1.0 else value * weight for value, weight in column))
        self.columns.clear()
        return tree_unflatten(combined, cast(TreeSpec, self.spec))


def _kept(tensor: torch.Tensor | TensorBase) -> torch.Tensor:
    """Return a loss or another number of a result detached, copied if it is a view of a larger storage.

    Kept until the step ends, each micro-batch's loss would otherwise hold all of its
    storage: the CPU's ``mse_loss`` returns its mean in the buffer of the elementwise
    losses, as large as the model's output.
    """
    kept = tensor.detach()
    try:
        larger = kept.untyped_storage().nbytes() > kept.numel() * kept.element_size()
    except (RuntimeError, NotImplementedError):  # a layout or subclass without one storage
        return kept
    return kept.clone() if larger else kept


def _loss_of(result: Any, name: str) -> torch.Tensor:
    """Return the loss in a step's result, or raise the error that says what is missing."""
    if isinstance(result, (tuple, list)):
        loss = result[0] if result else None
    elif isinstance(result, dict):
        loss = result.get("loss")
    else:
        loss = result
    if not isinstance(loss, TensorBase):
        raise TypeError(
            f"{name} returned {_describe(result)}; @koila.accumulate needs the loss: a scalar tensor, a tuple "
            "or list whose first item is one, or a dict with a 'loss' entry"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"{name} returned a loss of shape {tuple(loss.shape)}; it must be a scalar: reduce it with "
            ".mean() or .sum() (and say which with reduction=)"
        )
    return cast(torch.Tensor, loss)


def _count(value: Any, name: str) -> float:
    """Return what ``weight=`` returned as a number of items, or raise the error that says why not."""
    if isinstance(value, TensorBase) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"weight= returned {_describe(value)} for a micro-batch of {name}; it must return how many items "
            "the micro-batch's loss averages over: a number >= 0 (an int, a float or a one-element tensor)"
        )
    return float(value)


def _ignores_labels(split: Split) -> bool:
    """Return whether a dict in the batch holds ``labels`` with ignored entries (-100), as HF's losses skip."""
    for value in (*split.args, *split.kwargs.values()):
        labels = value.get("labels") if isinstance(value, Mapping) else None
        if isinstance(labels, TensorBase) and not labels.is_floating_point() and bool((labels == -100).any()):
            return True
    return False


def _describe(value: Any) -> str:
    if isinstance(value, TensorBase):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        return f"a dict with keys {list(value)}"
    return "None" if value is None else f"{type(value).__name__} {value!r}"[:200]


def _module_with_trainable_parameters(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Name a module the step can reach that has parameters requiring grad, if there is one.

    Looked at: the step itself and what it is bound to, its arguments, the variables
    it closes over and the globals it names. Only asked when the loss needs no grad.
    """
    for label, value in call_references(fn, args, kwargs):
        if isinstance(value, torch.nn.Module) and any(p.requires_grad for p in value.parameters()):
            return f"the module {label} ({type(value).__name__})"
    return None


def _given_ddp(ddp: Any) -> list[Any]:
    """Check ``ddp=``: a ``DistributedDataParallel`` module, or a list or tuple of them."""
    if ddp is None:
        return []
    modules = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
    parallel = torch.nn.parallel.DistributedDataParallel
    for module in modules:
        if not isinstance(module, parallel):
            raise TypeError(
                f"ddp must be a torch.nn.parallel.DistributedDataParallel module (the wrapped model) or a list "
                f"of them, got {type(module).__name__}"
            )
    return modules
