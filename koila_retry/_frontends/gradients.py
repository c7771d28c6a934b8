"""The gradients of a step of ``accumulate``, kept so that a step that fails leaves ``.grad`` as it was.

*Direct*: a plain backward into ``.grad``, at a hand loop's cost, with what was there set
aside. *Captured*: ``torch.autograd.grad`` into buffers of the step's own, added into
``.grad`` through autograd once it succeeded. The one rule: no Python assignment to a
``.grad`` that another thread's backward may be adding into (autograd's lock does not
cover it), hence ``IN_FLIGHT``. docs/architecture.rst, "How accumulate keeps a step's
gradients", says which path a step takes and how each works.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointFunction

from koila_retry._common.tensors import set_grads
from koila_retry._frontends import own_backward
from koila_retry._frontends.in_flight import IN_FLIGHT

__all__ = [
    "EARLY_BYTES",
    "HIDDEN",
    "ONE_ROW",
    "ROWS",
    "Backward",
    "Gradients",
    "Scaled",
    "backward_of",
    "made_again",
    "plain_backward",
]
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
# What a graph's batch normalisations say (Gradients.batchnorm, bits): over rows; over one row (InstanceNorm's
# too); or maybe some, inside a graph AOT autograd compiled (torch.compile's), one node the walk cannot see in.
ROWS, ONE_ROW, HIDDEN = 2, 1, 4
# The nodes a walk looks at more closely, by kind: one lookup per node. A compiled graph's backward is a class
# made per graph, told by its name the first time its kind is met (see _watch).
_NORM, _CHECKPOINT, _COMPILED = 1, 2, 3
_WATCHED: dict[type, int] = {**dict.fromkeys(_BatchNormNodes, _NORM), _ReentrantCheckpoint: _CHECKPOINT}
# A leaf's post-accumulate-grad hooks, read in C (see Gradients._expose).
_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")

# The gradients from this size up are added into the step's sums as soon as autograd has
# computed them (see ``Gradients.capture``); smaller ones are held until the end of their
# backward, which costs a little memory (a bias, a norm's weight) and saves a call into
# Python for each (some 20 us each).
EARLY_BYTES = 64 * 1024


# Runs the backward pass of a (weighted) loss; the flag says whether to retain the graph.
Backward = Callable[[torch.Tensor, bool], None]


def backward_of(engine: Callable[..., Any] | None, scaler: Any) -> Backward:
    """Return what runs each backward of a step, chosen once, when it is decorated."""
    if engine is not None:
        try:
            parameters = inspect.signature(engine).parameters.values()
            retains = any(p.name == "retain_graph" or p.kind is p.VAR_KEYWORD for p in parameters)
        except (TypeError, ValueError):  # no signature to read (a builtin): it is called as it is
            retains = True

        def engine_backward(loss: torch.Tensor, retain: bool) -> None:
            # The keyword only when it is needed: the engines pass it on to Tensor.backward.
            if not retain:
                engine(loss)
            elif retains:
                engine(loss, retain_graph=True)
            else:
                raise TypeError(
                    f"backward={engine!r:.200} takes no retain_graph: an argument of this call carries a graph "
                    "from before it (step(encoder(x), y)), which each micro-batch's backward must keep for the "
                    "next. Give backward= a callable that takes retain_graph and passes it on to the backward "
                    "(lambda loss, **options: scaler.scale(loss).backward(**options))"
                )

        return engine_backward
    if scaler is not None:
        return Scaled(scaler)
    return plain_backward


def summed(before: torch.Tensor, written: torch.Tensor | None) -> torch.Tensor:
    """Return a gradient set aside with what a step wrote since added into it, in place where autograd would."""
    if written is None:
        return before
    if written.requires_grad:  # a backward's with create_graph=True: its graph kept, as autograd keeps it
        return before + written
    if not before.requires_grad and before.layout == torch.strided:  # no graph to keep out of
        return before.add_(written)
    # Not torch.no_grad(): its __enter__ and __exit__ run Python, where an interrupt (Ctrl-C) can land and
    # leave grad mode off for good; a C call cannot be cut, and a finally is run.
    mode = torch.is_grad_enabled()
    try:
        torch._C._set_grad_enabled(False)
        if before.layout == torch.strided or written.layout == before.layout:
            return before.add_(written)
        return before + written  # a dense gradient onto a sparse one: as autograd does, a new sum
    finally:
        torch._C._set_grad_enabled(mode)


def _version(tensor: torch.Tensor) -> int:
    """Return the tensor's version counter, which an add in place moves; -2 for one without (an inference tensor)."""
    try:
        return tensor._version
    except RuntimeError:
        return -2


def plain_backward(loss: torch.Tensor, retain: bool) -> None:
    """Run ``loss.backward()``: the step's backward without a scaler or an engine, and the estimate's."""
    loss.backward(retain_graph=retain)  # type: ignore[no-untyped-call]


class Scaled:
    """Run the backward of a gradient scaler's ``scale(loss)``."""

    __slots__ = ("scale", "scaler")

    def __init__(self, scaler: Any) -> None:
        self.scaler, self.scale = scaler, scaler.scale

    def __call__(self, loss: torch.Tensor, retain: bool) -> None:
        self.scaled(loss).backward(retain_graph=retain)  # type: ignore[no-untyped-call]

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``scale(loss)``."""
        made_again(self.scaler)
        return cast(torch.Tensor, self.scale(loss))


def made_again(scaler: Any) -> None:
    """Let a GradScaler that ran out of memory while it made its state make it again at this ``scale()``."""
    # It makes its scale, then its growth tracker, on first use: an error between the two (in a step's
    # backward, or in a trainer's own) left a scale without a tracker, which no later scale() made, and
    # scaler.step() asserted on it (probes 77I, 77L).
    if getattr(scaler, "_scale", None) is not None and getattr(scaler, "_growth_tracker", 0) is None:
        scaler._scale = None


class Gradients:
    """The gradients of one step: written into ``.grad`` directly, or captured until the step succeeded."""

    __slots__ = (
        "adding",
        "aside",
        "batchnorm",
        "committing",
        "direct",
        "exposed",
        "faint",
        "grad_mode",
        "hidden",
        "leaves",
        "lock",
        "owned",
        "root",
        "sums",
        "task",
        "thread",
    )

    def __init__(self, direct: bool = False) -> None:
        self.sums: dict[int, torch.Tensor] = {}  # the step's captured gradient of each leaf, by id of the leaf
        self.leaves: dict[int, torch.Tensor] = {}  # the leaf of each sum
        # The sums that are tensors of this object's own, safe to add into in place; the
        # others are as autograd returned them, possibly views or shared between leaves.
        self.owned: set[int] = set()
        # The leaves whose ``.grad`` a plain backward may write (the direct path's, or the
        # fallback's), and the gradients they had before it.
        self.exposed: dict[int, torch.Tensor] = {}
        self.aside: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Leaves other than parameters that a backward inside a node writes: held weakly, the node's
        # own (the input it recomputes from) dying with it.
        self.faint: dict[int, weakref.ref[torch.Tensor]] = {}
        self.hidden = False  # whether a backward may have written leaves the walk cannot find
        self.batchnorm = 0  # what batch normalisations in training mode the graphs hold: ROWS, ONE_ROW, HIDDEN bits
        self.direct = direct  # on the direct path: until a leaf cannot be taken (see _expose)
        self.committing = False  # the step's gradients are being given to .grad: see discard()
        # The caller's grad mode, which says whether a backward is wanted: not a step's own, which a step that
        # turns grad on inside itself (a saliency map) under torch.no_grad() leaves on, or changes for good.
        self.grad_mode = torch.is_grad_enabled()
        # The gradient restore() is adding into, its version before, and the sum once made: an
        # interrupt (Ctrl-C) after an add in place must not make the restore that goes on add twice.
        self.adding: tuple[torch.Tensor, int, torch.Tensor | None] | None = None
        self.thread = threading.get_ident()
        self.root: Any = None  # the node this step's backward starts from, while it runs
        self.task = -1  # the autograd graph task that runs it, once a backward inside one of its nodes was seen
        # Autograd runs the nodes of each device on a thread of its own; hooks that add into
        # the sums (see ``_taker``) may run on two at once.
        self.lock = threading.Lock()

    def backward(self, run: Backward, loss: torch.Tensor, retain: bool) -> None:
        """Run ``run(loss, retain)``: into ``.grad`` on the direct path, else with its backward passes captured."""
        self.root = loss.grad_fn  # which nodes are this step's: see nested()
        tell, told = self.nested, own_backward.BACKWARDS
        try:
            told.append(tell)
            self._backward(run, loss, retain)
        finally:  # stores, then C calls: a Ctrl-C cannot land before all of them ran
            self.root, self.task = None, -1
            if tell in told:
                told.remove(tell)

    def _backward(self, run: Backward, loss: torch.Tensor, retain: bool) -> None:
        # Known backward passes run without the function mode (direct into .grad, or captured),
        # which would send every call the backward makes through Python.
        if run is plain_backward or type(run) is Scaled:
            if run is not plain_backward:
                loss = cast(Scaled, run).scaled(loss)
            if self.direct and self._expose(loss):
                torch.autograd.backward(loss, retain_graph=retain)
                return

            def plain() -> None:
                torch.autograd.backward(loss, retain_graph=retain)

            self.capture(BackwardCall((loss,), None, retain, False, None), plain)
            return
        thread = own_backward.THREAD
        outer = thread.engine
        with Capture(self):
            try:  # set and restored by stores alone: a Ctrl-C cannot leave the flag set
                thread.engine = True
                run(loss, retain)
            finally:
                thread.engine = outer

    def started(self, call: BackwardCall, plain: Callable[[], None]) -> None:
        """Run a backward that an engine's ``backward=`` started (``plain()`` runs it as asked): direct or captured."""
        # Only the plain form writes exactly the leaves a walk of its outputs finds; the
        # others (some inputs only, a graph of the gradients) are captured as before.
        if (
            self.direct
            and not call.create_graph
            and call.inputs is None
            and all(isinstance(output, torch.Tensor) for output in call.outputs)
            and all(self._expose(output) for output in call.outputs)
        ):
            own_backward.seen(plain)
            return
        self.capture(call, functools.partial(own_backward.seen, plain))

    def nested(self, outputs: Any) -> None:
        """Take the leaves a backward run inside this step's writes (a custom Function's) before it writes them."""
        # As a plain backward's: set aside, and dropped with a failed attempt. Where another step holds
        # them, the two cannot share them: warned of.
        # Only inside a node of this step's graph: another thread's training, koila's or not, runs its own
        # graph task. The first such backward finds its node in the graph; the others compare tasks. One
        # deeper (inside a node of such a backward: a recomputation in a recomputation) runs in a task of
        # its own, on this step's thread, which runs the CPU nodes of the backward it started.
        task = _graph_task()
        if task != self.task:
            if self.task < 0 and _reaches(self.root, _current_node()):
                self.task = task
            elif self.task < 0 or threading.get_ident() != self.thread:
                return
        found = self._walk(tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,))[0]
        exposed = self.exposed
        new = [leaf for leaf in found if id(leaf) not in exposed and not self._is_faint(leaf)]
        if self.direct and new and not IN_FLIGHT.take(self, [id(leaf) for leaf in new]):
            self.hidden = True
            return
        self._hold(new)  # a leaf of the Function's own (the input it recomputes from) dies with the node

    def _expose(self, loss: torch.Tensor) -> bool:
        """Hold the leaves a backward of ``loss`` writes first and set their gradients aside; False: go on captured."""
        exposed, faint = self.exposed, self.faint
        leaves = self.reached(loss)
        if exposed or faint:  # a faint leaf by identity: one that died may have left its id to a new one
            new = [leaf for leaf in leaves if id(leaf) not in exposed and not (faint and self._is_faint(leaf))]
        else:
            new = leaves
        if not new:
            return True
        # Post-accumulate-grad hooks must run once per step, when the step's gradient is delivered.
        # Looked for in C, through map: a generator would be a call into Python per leaf.
        if any(map(_HOOKS, new)) or not IN_FLIGHT.take(self, list(map(id, new))):
            self._captured_from_now()
            return False
        self._hold(new)
        return True

    def _hold(self, new: list[torch.Tensor]) -> None:
        """Hold ``new`` leaves, taken already, and set their gradients aside."""
        exposed, aside = self.exposed, self.aside
        weak = None
        for leaf in new:
            # Leaves other than parameters are held weakly: one a micro-batch makes (x.requires_grad_()
            # for a gradient penalty) dies with its gradient when the micro-batch ends, as in a hand loop.
            if isinstance(leaf, torch.nn.Parameter):
                exposed[id(leaf)] = leaf
            else:
                if weak is None:
                    weak = {}
                weak[id(leaf)] = weakref.ref(leaf)
            before = leaf.grad
            if before is not None:
                aside.append((leaf, before))
                leaf.grad = None
        if weak is not None:
            self.faint.update(weak)
            if self.direct:
                IN_FLIGHT.weakly(weak)  # another thread's leaf may take the id of one that died

    def _captured_from_now(self) -> None:
        """Leave the direct path: move what the step wrote into :attr:`sums`, give back what was set aside."""
        for leaf in [*self.exposed.values(), *self._faint()]:
            written = leaf.grad
            if written is not None:
                leaf.grad = None
                self._add(leaf, written, private=True)  # AccumulateGrad's: nothing else holds it
        self.restore()
        self.direct = False

    def capture(self, call: BackwardCall, plain: Callable[[], None]) -> None:
        """Run one backward as ``torch.autograd.grad`` into :attr:`sums`, or, when it cannot, as ``plain()``."""
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
        """Return a node's post hook that adds its gradients of ``taken``'s ``(output, leaf)`` into their sums."""

        def take(grad_inputs: tuple[torch.Tensor | None, ...], _: Any) -> tuple[torch.Tensor | None, ...]:
            replaced = list(grad_inputs)
            for slot, leaf in taken:
                gradient = replaced[slot]
                if gradient is not None:
                    replaced[slot] = None  # nothing is left for autograd.grad to capture
                    self._add(leaf, gradient)  # on autograd's thread for the node's device: _add locks
            return tuple(replaced)

        return take

    def _add(self, leaf: torch.Tensor, gradient: torch.Tensor, private: bool = False) -> None:
        """Add one backward's gradient of ``leaf`` into its sum; ``private``: nothing but this call holds it."""
        key = id(leaf)
        with self.lock:
            total = self.sums.get(key)
            if total is None:
                # As AccumulateGrad does: a private gradient becomes the sum, in the leaf's layout (copied
                # if it is not); one that others may see is kept as it is, and added into out of place.
                if private and gradient.layout == torch.strided:
                    if gradient.stride() != leaf.stride():
                        gradient = torch.empty_like(leaf, dtype=gradient.dtype).copy_(gradient)
                    self.owned.add(key)
                self.sums[key] = gradient
                self.leaves[key] = leaf
                return
            if gradient.requires_grad:  # a fallback's with create_graph=True: its graph kept, as autograd keeps it
                self.sums[key] = total + gradient if total.layout == torch.strided else gradient + total
                return
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
        """Return the leaves a backward of ``outputs`` writes, whether it runs a reentrant checkpoint, and ``early``."""
        found: dict[int, torch.Tensor] = {}
        sums = self.sums
        early: dict[Any, list[tuple[int, Any]]] = {}  # by node: the (output, leaf) whose sum takes it early
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
                    # Taken early by the node that computes it, unless tensor hooks must see the gradient.
                    if key in sums and not leaf._backward_hooks and leaf.numel() * leaf.element_size() >= EARLY_BYTES:
                        early.setdefault(parent, []).append((slot, leaf))
                    continue
                if node in seen:
                    continue
                seen.add(node)
                try:
                    watched = _WATCHED[kind]
                except KeyError:
                    watched = _watch(kind)
                if watched == _CHECKPOINT:
                    reentrant = True
                    for parameter in self._checkpointed(node):
                        found[id(parameter)] = parameter
                elif watched:
                    self.batchnorm |= _statistics(node) if watched == _NORM else HIDDEN
                stack.append(node)
        del seen, stack, parent
        return list(found.values()), reentrant, early

    def reached(self, loss: torch.Tensor) -> list[torch.Tensor]:
        """Return the leaves a backward of ``loss`` writes: :meth:`_walk`'s first result, for the direct path."""
        # Each micro-batch's backward pays for this walk (some 0.2 us a node): each node is
        # visited once, AccumulateGrad included, and nothing is taken early (no sums here).
        root = loss.grad_fn
        if root is None:  # the loss is itself a leaf
            return [loss] if loss.requires_grad else []
        # One AccumulateGrad node per leaf while the graph holds it: no leaf is found twice
        # but through a reentrant checkpoint.
        found: list[torch.Tensor] = []
        keep = found.append
        stack: list[Any] = [root]
        # None among them: the edges of inputs that need no gradient are skipped by the same test.
        seen: set[Any] = {root, None}
        add, push, pop = seen.add, stack.append, stack.pop
        watching = _WATCHED
        checkpointed = False
        while stack:
            for node, _ in pop().next_functions:
                if node in seen:
                    continue
                add(node)
                kind = type(node)
                if kind is _AccumulateGrad:
                    keep(node.variable)
                    continue
                try:
                    watched = watching[kind]
                except KeyError:
                    watched = _watch(kind)
                if watched:
                    if watched == _CHECKPOINT:
                        checkpointed = True
                        found.extend(self._checkpointed(node))
                    else:
                        self.batchnorm |= _statistics(node) if watched == _NORM else HIDDEN
                push(node)
        del seen, stack
        # Turned off since the forward: autograd writes nothing.
        leaves = [leaf for leaf in found if leaf.requires_grad]
        return list({id(leaf): leaf for leaf in leaves}.values()) if checkpointed else leaves

    def _checkpointed(self, node: Any) -> list[torch.Tensor]:
        """Return the parameters a reentrant checkpoint's own backward writes, when it can tell."""
        owner = _owner(getattr(node, "run_function", None))
        if isinstance(owner, torch.nn.Module):
            return [parameter for parameter in owner.parameters() if parameter.requires_grad]
        self.hidden = True
        return []

    def _plain(self, found: list[torch.Tensor], run: Callable[[], None]) -> None:
        """Run a backward that ``autograd.grad`` cannot, writing ``.grad``; move what it wrote into :attr:`sums`."""
        # Not safe while another thread trains the model: .grad is set from Python, outside autograd's lock.
        exposed, aside, sums = self.exposed, self.aside, self.sums
        for leaf in found:
            key = id(leaf)
            if key not in exposed:
                exposed[key] = leaf
                if self.faint and self._is_faint(leaf):  # written in a node already (see _expose)
                    del self.faint[key]
                elif leaf.grad is not None:
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
        """Make a sum (leaf ``id`` ``key``'s, or every one) a tensor of this object's own, to write in place."""
        for each in list(self.sums) if key is None else [key]:
            if each not in self.owned:
                total = self.sums[each]
                if total.layout == torch.strided:
                    self.sums[each] = torch.empty_like(self.leaves[each], dtype=total.dtype).copy_(total)
                else:
                    self.sums[each] = total.clone()
                self.owned.add(each)

    def gradients_aside(self) -> dict[int, torch.Tensor]:
        """Return the gradients set aside while the step runs, by ``id`` of their leaf (for ``koila.report``)."""
        return {id(leaf): gradient for leaf, gradient in self.aside}

    def gradients_of_step(self) -> dict[int, torch.Tensor]:
        """Return the step's own gradients so far, by ``id`` of their leaf (for ``koila.report``)."""
        if not self.direct:
            return dict(self.sums)
        written = {id(leaf): leaf.grad for leaf in [*self.exposed.values(), *self._faint()] if leaf.grad is not None}
        return {**self.sums, **written}

    def written_bytes(self) -> int:
        """Return the bytes of the step's gradients so far, sums and what the direct path wrote, each storage once."""
        storages = {}
        for total in self.gradients_of_step().values():
            if total.layout == torch.strided:
                storage = total.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
        return sum(storages.values())

    def discard(self) -> None:
        """Forget every gradient the step computed, and what a plain backward left in ``.grad``."""
        self.sums, self.leaves, self.owned = {}, {}, set()
        if self.committing:  # interrupted (Ctrl-C) as it began: restore() finishes, or none is given
            return
        set_grads((leaf, None) for leaf in [*self.exposed.values(), *self._faint()])

    def restore(self) -> None:
        """Give back the gradients set aside, what the step wrote since added into them, and let go of the leaves."""
        aside, failed = self.aside, None
        try:
            while aside:  # each pair dropped once given back: a restore an interrupt cut short goes on
                leaf, before = aside[-1]
                adding = self.adding
                if (
                    adding is not None
                    and adding[0] is before
                    and (adding[2] is not None or _version(before) != adding[1])
                ):
                    # Cut short after the sum was made, or after the add into ``before`` in place: given as it is.
                    leaf.grad = before if adding[2] is None else adding[2]
                    aside.pop()
                    continue
                # leaf.grad is None, unless a backward wrote leaves the walk could not find; ``before``
                # itself where a restore cut short gave it back already.
                written = leaf.grad
                if written is not before:
                    try:
                        self.adding = (before, _version(before), None)
                        total = summed(before, written)
                        self.adding = (before, -1, total)
                        leaf.grad = total
                    except Exception as error:  # a .grad that cannot be added into (an expanded one): as it was
                        failed = failed or error
                        with contextlib.suppress(Exception):  # unless the leaf cannot take it (another dtype now)
                            leaf.grad = before
                aside.pop()
            self.adding = None
        finally:
            if not aside:  # nothing of the step's is apart from .grad: nothing for a discard to drop
                self.exposed.clear()
                self.faint.clear()
                if self.direct:
                    IN_FLIGHT.release(self)
        if failed is not None:  # after the others were given back, and the leaves let go
            raise failed

    def abandon(self) -> None:
        """Drop the step's gradients, give back those set aside, and let go of the leaves, even if interrupted."""
        try:
            self.discard()
            self.restore()
        finally:  # a second interrupt (Ctrl-C) in the restore: never leave another thread waiting for the leaves
            if self.direct:
                IN_FLIGHT.release(self)

    def _faint(self) -> list[torch.Tensor]:
        return [leaf for leaf in (ref() for ref in self.faint.values()) if leaf is not None]

    def _is_faint(self, leaf: torch.Tensor) -> bool:
        ref = self.faint.get(id(leaf))
        return ref is not None and ref() is leaf

    def deliver(self) -> None:
        """Add the step's gradients into ``.grad`` through autograd, and forget them."""
        if not self.sums:
            return
        keys = list(self.sums)
        IN_FLIGHT.enter(keys, self.thread)  # a direct step of another thread sets .grad from Python: wait for it
        try:
            self._hand_over()
        finally:
            IN_FLIGHT.leave(keys)

    def _hand_over(self) -> None:
        """Add the sums into ``.grad`` through autograd, and forget them (see :meth:`deliver`)."""
        sums, leaves = self.sums, self.leaves
        self.sums, self.leaves, self.owned = {}, {}, set()
        plain: list[torch.Tensor] = []
        box = Box()
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
            # A fallback's backward with create_graph=True gave gradients with a graph: kept, as autograd keeps it.
            graph = any(gradient.requires_grad for gradient in box.gradients)
            with torch.enable_grad():
                done = Deliver.apply(box, *plain)  # type: ignore[no-untyped-call]
            del plain
            torch.autograd.backward(done, create_graph=graph)
        if hooked:  # their tensor hooks saw each backward's gradient: to AccumulateGrad, which runs none
            with torch.set_grad_enabled(any(total.requires_grad for _, total in hooked)):  # a graph kept, as above
                for leaf, total in hooked:
                    accumulate = torch.autograd.graph.get_gradient_edge(leaf).node
                    cast(Any, accumulate)(total)


class Box:
    """The gradients that a :class:`Deliver` hands over, held nowhere else until it does."""

    __slots__ = ("gradients",)

    def __init__(self) -> None:
        self.gradients: list[torch.Tensor] = []

    def take(self) -> list[torch.Tensor]:
        gradients, self.gradients = self.gradients, []
        return gradients


class Deliver(torch.autograd.Function):
    """A function of the leaves whose backward returns the step's gradients of them (see ``Gradients.deliver``)."""

    @staticmethod
    def forward(ctx: Any, box: Box, *leaves: torch.Tensor) -> torch.Tensor:
        ctx.box = box
        return torch.empty((), device=leaves[0].device)

    @staticmethod
    def backward(ctx: Any, *_: Any) -> tuple[Any, ...]:
        return (None, *ctx.box.take())


class BackwardCall:
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
) -> BackwardCall:
    return BackwardCall((self,), gradient, retain_graph, create_graph, inputs)


def _autograd_backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
) -> BackwardCall:
    outputs = (tensors,) if not isinstance(tensors, Sequence) else tuple(tensors)
    given = grad_variables if grad_tensors is None else grad_tensors
    return BackwardCall(outputs, given, retain_graph, create_graph, inputs)


def _statistics(node: Any) -> int:
    """Return ROWS for a batch normalisation in training mode over several rows, ONE_ROW over one row, 0 out of it."""
    if not getattr(node, "_saved_training", True):
        return 0
    # InstanceNorm normalises through one: each row alone, folded into the channels of a
    # batch of one row. So does BatchNorm on a micro-batch of one row, which the caller tells.
    try:
        saved = getattr(node, "_saved_input", None)
    except RuntimeError:  # freed by a backward that already ran through it: say rows, to warn
        return ROWS
    return ONE_ROW if saved is not None and saved.dim() > 0 and saved.shape[0] == 1 else ROWS


def _watch(kind: type) -> int:
    """Return what a walk does at a node of ``kind`` met for the first time, and remember it."""
    watched = _COMPILED if kind.__name__ == "CompiledFunctionBackward" else 0
    if len(_WATCHED) < 4096:  # a kind per compiled graph: bounded, however often code recompiles
        _WATCHED[kind] = watched
    return watched


def _is_leaf(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.grad_fn is None


_TENSOR_BACKWARD = torch.Tensor.backward
_AUTOGRAD_BACKWARD = torch.autograd.backward


class Capture(TorchFunctionMode):
    """On this thread, while a backward of the step runs: hand each backward pass it starts to ``Gradients.started``."""

    def __init__(self, gradients: Gradients) -> None:
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
        self.gradients.started(call, lambda: func(*args, **kwargs))
        return None


# The graph task the autograd engine runs on this thread now (-1 outside one), and the node it runs.
_graph_task: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_current_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)


def _reaches(root: Any, node: Any) -> bool:
    """Return whether ``node`` is ``root`` or one of the nodes the graph from it leads to."""
    if root is None or node is None:
        return False
    stack, seen = [root], {root}
    while stack:
        current = stack.pop()
        if current is node:
            return True
        for child, _ in current.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return False


def _owner(function: Any) -> Any:
    """Return the module whose forward a checkpointed function runs, or what stands in its place."""
    # Hugging Face checkpoints a layer as partial(forward, layer, **kwargs) (transformers 5), or as
    # partial(super().__call__, **kwargs) (transformers 4).
    while isinstance(function, functools.partial):
        first = function.args[0] if function.args else None
        if isinstance(first, torch.nn.Module) and getattr(function.func, "__self__", None) is None:
            return first
        function = function.func
    return function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
