"""One run of the call on meta tensors at one batch size, and the sizes an estimate runs at.

A run changes nothing the user owns: modules and optimizers are lent meta copies for
its duration (``lending``), and a random generator the call seeds anew is put back.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from koila_retry._common.batches import Split
from koila_retry._common.collector import collector_paused
from koila_retry._common.dynamo import compiled_code_runs_eagerly
from koila_retry._estimation.attention import device_kernels
from koila_retry._estimation.autocast import autocast_like
from koila_retry._estimation.fit import Run
from koila_retry._estimation.lending import Owned, ThreadTracker
from koila_retry._estimation.recorder import META, Recorder, Workspace
from koila_retry._estimation.recurrent import recurrent_kernels
from koila_retry._estimation.sharding import Sharding
from koila_retry._estimation.steps import follow_steps

__all__ = ["run_at_sizes", "run_on_meta"]

# Fake runs cost the same at any batch size; this keeps shapes far from 32-bit limits.
_LARGEST_RUN = 1 << 20


def run_at_sizes(run: Callable[[int], Run], rows: int, chosen: list[int] | None) -> list[Run]:
    """Run the call at the sizes chosen, or at those the default finds (see ``koila.estimate``'s ``sizes``)."""
    # A collection during a run was seen to fire the weak-reference callbacks of meta
    # storages still in use (PyTorch keeps their Python objects alive for them, and a
    # collection of an earlier run's garbage can clear the references): none runs. The
    # collector is the process's: other threads' garbage waits for the estimate too.
    with collector_paused():
        if chosen is None:
            base = max(rows, 2)
            runs = [run(base), run(2 * base)]
            if not runs[0].aligned(runs[1]):
                # The call takes another path at another size (a loop over chunks of its
                # own, say): the peak is measured at 1, and far out too, where it grows
                # at its final rate. At 2 where 1 fails: a training BatchNorm's chunk of
                # one row has one value per channel, an error the call never meets itself.
                try:
                    one = run(1)
                except Exception:
                    if base <= 2:
                        raise
                    one = run(2)
                large = _large_size(one, runs[0])
                runs = [one, *runs, run(large), run(2 * large)]
        else:
            runs = [run(size) for size in chosen]
    return runs


def _large_size(one: Run, base: Run) -> int:
    """Return a power of two at which the bytes that grow with the batch dwarf the rest."""
    fixed = max(moment.total for moment in one.moments)
    low, high = one.phase_peaks(), base.phase_peaks()
    growth = max(high[phase].total - low[phase].total for phase in low if phase in high) / (
        base.batch_size - one.batch_size
    )
    wanted = 8 * fixed / growth if growth > 0 else 0
    large = 1 << max(math.ceil(math.log2(max(wanted, 1))), 0)
    return min(max(large, 4 * base.batch_size), max(_LARGEST_RUN, 4 * base.batch_size))


class _Tracker(ThreadTracker):
    """The run's module tracker; a forward inside backward (a checkpointed region's recomputation) hooks no gradient."""

    # A recomputed module is recorded while its forward runs, as before, and hooks no gradient: the
    # names recorded in backward stay those of the graph the first forward made.

    def _hooks_gradients(self) -> bool:
        return torch._C._current_graph_task_id() == -1


_SPARSE = "counted as the dense tensor it stands for, not by its non-zeros: give initial= a size, not 'auto'"


def _on_meta_device(tensor: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return torch.empty(shape, dtype=tensor.dtype, device=META, requires_grad=tensor.requires_grad)


def _put_back_a_reseeded_rng(seed: int, state: torch.Tensor) -> None:
    """Put the global random number generator back to ``state`` if the run seeded it anew."""
    # Meta operators draw no random numbers: what changed the generator is the call seeding it
    # (put back) or another thread drawing from it (left alone: it would draw the same numbers again).
    if torch.initial_seed() == seed:
        # Compared as the CPU tensors they are, past the modes of an estimate this one may run inside.
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            now = torch.get_rng_state()
            seeded = torch.Generator().manual_seed(seed).get_state()
            if torch.equal(now, state) or not torch.equal(now, seeded):
                return  # unchanged, or drawn from: not seeded anew
    torch.set_rng_state(state)


def run_on_meta(
    fn: Callable[..., Any],
    batch: Split,
    owned: Owned,
    batch_size: int,
    round_bytes: Callable[[int], int] | None,
    workspace: Workspace | None,
    inexact: Mapping[Any, str] | None = None,
    target: torch.device = META,
    sharding: Sharding | None = None,
) -> Run:
    """Run ``fn`` once on meta tensors, on ``batch`` resized to ``batch_size`` rows, and return its moments."""
    recorder = Recorder(round_bytes, workspace, inexact, batch_size)
    seed, rng = torch.initial_seed(), torch.get_rng_state()
    handles: list[Any] = []
    undo: Callable[[], None] | None = None
    try:
        with compiled_code_runs_eagerly(), META, recorder:
            try:
                undo = owned.lend(recorder, sharding, target)
                recorder.category = "inputs"
                args, kwargs = batch.resized(batch_size, _on_meta_device)
                if any(tensor.layout is not torch.strided for tensor in batch.tensors):
                    # Meta has no kernels for sparse operands (addmm, mm): their dense size is counted.
                    recorder.note_inexact("a sparse input", _SPARSE)
                recorder.mark(owned.gradients_and_state())

                def reclassify() -> None:
                    recorder.mark(owned.gradients_and_state())

                recorder.reclassify = reclassify
                handles += follow_steps(recorder, owned.optimizers, reclassify)
                with _Tracker() as modules:
                    recorder.modules = modules
                    modules.on_enter = recorder.entered_module
                    recorder.start()
                    try:
                        # The attention and recurrent kernels the target runs, and its autocast; the
                        # kernels' modes stay on in backward, where checkpointing recomputes.
                        recurrent = recurrent_kernels(target, owned.modules, recorder.note_inexact)
                        with (
                            device_kernels(target, owned.modules, recorder.note_inexact, later=[recurrent]),
                            recurrent,
                            autocast_like(target, recorder.note_inexact),
                        ):
                            fn(*args, **kwargs)
                    except Exception as error:
                        if sys.version_info >= (3, 11):
                            error.add_note(
                                f"(raised while koila.estimate ran the call on meta tensors, which have shapes and "
                                f"no values, with a batch of {batch_size})"
                            )
                        raise
                    finally:
                        recorder.modules = None
                reclassify()
                del args, kwargs
                moments = recorder.moments()
            finally:
                for handle in handles:
                    handle.remove()
                handles.clear()
                if undo is not None:
                    undo()
                recorder.reclassify = None
    finally:
        _put_back_a_reseeded_rng(seed, rng)
    return Run(batch_size, moments, tuple(recorder.notes))
