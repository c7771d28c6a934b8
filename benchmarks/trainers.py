"""Measure what the trainer integrations cost per step when nothing runs out of memory, next to the plain trainers.

One process, one run, side by side, torch on one thread (``torch.set_num_threads(1)``),
on the CPU. Two trainers, each with its integration, its plain self and its own way of
surviving out-of-memory errors (the peer):

- Hugging Face ``transformers.Trainer`` on a GPT-2 built from a config (nothing is
  downloaded): 2 layers of width 128, 4 heads, a vocabulary of 256, no dropout; 8 rows of
  32 tokens a step (labels are the tokens), SGD at a constant learning rate, the rows in
  order (``train_sampling_strategy="sequential"``), ``use_cpu=True``, ``report_to=[]``,
  ``save_strategy="no"``, ``logging_strategy="no"``, ``disable_tqdm=True``, no data
  loader workers. The candidates: the plain ``Trainer``;
  ``koila_retry.integrations.transformers.adapt(Trainer(...))``, whose ``training_step`` runs
  as the trainer runs it while nothing fails, and through ``koila.accumulate`` after an
  out-of-memory error, and whose ``prediction_step`` runs through ``koila.accumulate``; and
  the peer, the plain trainer with
  ``auto_find_batch_size=True``, which restarts training after an out-of-memory error with
  the batch size multiplied by 0.9 (accelerate 1.15.0's ``find_executable_batch_size``).
  Evaluation: ``evaluate()`` over 8 batches of 8 rows, plain and adapted
  (``auto_find_batch_size`` does not touch evaluation).
- Lightning ``lightning.Trainer`` on an MLP 256 -> 1024 -> 1024 -> 10 (1.3 million
  parameters) with ``cross_entropy`` and ``self.log`` of the loss, 64 rows a step, SGD,
  ``logger=False``, ``enable_checkpointing=False``, ``enable_progress_bar=False``,
  ``enable_model_summary=False``, no validation during ``fit``. The module's data loaders
  read its ``batch_size``; its training set holds four batches (256 rows). The
  candidates: the plain ``Trainer``; ``Trainer(callbacks=[OOMRecovery()])``; and the peer,
  ``Trainer(callbacks=[BatchSizeFinder()])`` (default options), which before every
  ``fit`` runs a search: it doubles the batch size from 2 until a size runs out of memory
  or reaches the length of the data set, and keeps the last size that worked. On a CPU
  with the memory to spare nothing fails, so it ends at the data set's length: another
  batch size, so other steps and other training, which the output says. Its time per step
  is the time of those larger steps, after the search; its time per call includes the
  search. Validation: ``validate()`` over 16 batches of 64 rows, plain and with
  ``OOMRecovery()``.

A step's time comes from the trainer's own callback hooks: from ``on_step_begin`` to
``on_step_end`` (Hugging Face) or from ``on_train_batch_start`` to ``on_train_batch_end``
(Lightning), which covers the forward, the backward, the optimizer step and the zeroing of
the gradients; an evaluation batch's, from one ``on_prediction_step`` to the next (Hugging
Face: the loop's whole iteration, the first batch left out) or from
``on_validation_batch_start`` to ``on_validation_batch_end`` (Lightning). A block is one
call of ``train()``, ``fit()``, ``evaluate()`` or ``validate()`` of some steps (as many
training steps as take about 0.25 s at the plain trainer's fastest; a new Lightning
``Trainer`` each time, the same module, callback and Hugging Face trainer every time):
its time per step is the mean over its steps, and its time per call is the whole call's,
set-up included (Hugging Face's ``train()`` runs a full garbage collection on every call,
``auto_find_batch_size`` a second one). The models go on training from block to block.

Every round times a block of each candidate, in an order rotated from round to round, so
that machine noise falls on all of them alike; the plain trainer runs a second block each
round as a check of the noise. The table gives the median and the minimum over rounds of
the time per step and, paired within each round, the median of the ratio to the plain
trainer; the same for the time per call. The garbage collector stays enabled.

The checks, once per run before the timing: the plain and the adapted trainer (the plain
``Trainer`` and the one with ``OOMRecovery``) train their first steps from the same
weights on the same rows and must end at ``allclose`` parameters, and evaluate to
``allclose`` losses; after every block, the adapted trainer's ``training_step.stats`` and
``prediction_step.stats`` must show no out-of-memory error and the whole batch as the
size, and ``OOMRecovery`` must have reported no out-of-memory error (``on_oom``). The
script stops with an error otherwise.

Peak memory, apart from the timing: after the timed rounds, one more call of every
candidate but the noise check (the same steps as a timed block: ``train()``, ``fit()``,
``evaluate()`` or ``validate()``) runs under ``koila_retry.testing.simulated_device`` with
a limit of 64 GiB, so that nothing fails. The device counts exactly the bytes of every
tensor storage created inside the call while it is alive, and its ``peak`` is the most
alive at once: activations, gradients, optimizer state, batches. What existed before the
call (the weights) does not count. Every such call starts with the gradients released
(``.grad`` None, as PyTorch's ``zero_grad`` leaves them); from its second step on, each
trainer's own order of ``zero_grad`` and backward decides what coexists. The dispatch mode
that counts slows every operator, which is why these calls are not timed. The memory
table gives each candidate's peak and its ratio to the plain trainer's; the peers' rows
say how many rows their steps ran (``BatchSizeFinder``'s call includes its search).

The targets, from issue 40: with nothing failing, the adapted trainers' training step at
most 2% slower than the plain trainer's (a ratio of at most 1.02; the issue that asked for
this benchmark allowed 1.05), and their training call's peak memory at most 1.02 times
the plain trainer's. Evaluation is reported, without a target.

Run it with::

    tox -e bench                            # installs the peers, runs the 8 scripts tox.ini lists
    tox -e bench -- --quick                 # a fast, noisier run
    python benchmarks/trainers.py --rst     # how docs/performance.rst was made
    python benchmarks/trainers.py --clock cpu --no-peers   # on a busy machine
    python benchmarks/trainers.py --only lightning         # one trainer's rows

``--clock cpu`` times the thread that runs the trainers in CPU time, which other jobs on the
machine do not add to. ``--no-peers`` leaves ``auto_find_batch_size`` and ``BatchSizeFinder`` out.
``--only hf`` or ``--only lightning`` runs that trainer's rows alone. Without
transformers or without lightning, that trainer's rows are skipped with a note. The exit
status is 0 whether or not the target is met; the verdict is printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from common import (  # the script's own folder is on sys.path
    add_run_flags,
    duration,
    labelled,
    percent,
    print_load,
    print_summary,
    print_text,
    print_verdict,
    settle_rounds,
    version_of,
)
from torch.nn import functional

import koila_retry as koila
from koila_retry.testing import simulated_device

TARGET = 1.02  # an adapted trainer's training step / the plain trainer's
MEMORY_TARGET = 1.02  # an adapted trainer's peak memory in a training call / the plain trainer's
MEMORY_LIMIT = "64GiB"  # the simulated device's: large enough that nothing fails
BLOCK_SECONDS = 0.25  # about how long the training steps of one block take
CHECK_STEPS = 4  # steps of the plain and the adapted trainer compared once per run
HF_ROWS, HF_TOKENS, HF_VOCABULARY = 8, 32, 256  # rows and tokens a step, and the vocabulary
HF_BATCHES = 16, 8  # batches of the training set and of the evaluation set
PL_ROWS, PL_FEATURES = 64, 256  # rows a step and features a row
PL_BATCHES = 4, 16  # batches of the training set and of the validation set
PLAIN = "Trainer"
AGAIN = "Trainer again (noise check)"


# Timing -----------------------------------------------------------------------------------

# The clock of every timed block: the wall clock, or with ``--clock cpu`` the CPU time of the
# thread that runs the trainers (both run their steps on the calling thread, torch on one
# thread), which the other jobs of a busy machine do not add to.
CLOCK: list[Callable[[], float]] = [time.perf_counter]


class Stopwatch:
    """The durations of a trainer's steps, from its callback hooks: begin to end, or end to end (laps)."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self.rows: set[int] = set()  # the rows of the steps, where the hook sees the batch
        self.started: float | None = None

    def clear(self) -> None:
        self.durations, self.rows, self.started = [], set(), None

    def begin(self) -> None:
        self.started = CLOCK[0]()

    def end(self) -> None:
        now = CLOCK[0]()
        if self.started is not None:
            self.durations.append(now - self.started)
        self.started = None

    def lap(self) -> None:
        now = CLOCK[0]()
        if self.started is not None:
            self.durations.append(now - self.started)
        self.started = now


def timed(call: Callable[[], Any]) -> float:
    """Return the seconds one call takes."""
    start = CLOCK[0]()
    call()
    return CLOCK[0]() - start


@dataclass
class Candidate:
    name: str
    call: Callable[[], float]  # one block: the seconds of its train(), fit(), evaluate() or validate()
    watch: Stopwatch
    rows: Callable[[], int]  # the rows a step of the last block ran
    peer: bool = False
    check: Callable[[], str | None] | None = None  # a problem, or None
    model: torch.nn.Module | None = None  # whose gradients are released before the memory's call
    steps: list[float] = field(default_factory=list)  # seconds per step, one per round
    calls: list[float] = field(default_factory=list)  # seconds per call, one per round
    counts: set[int] = field(default_factory=set)  # steps timed per block
    seen: set[int] = field(default_factory=set)  # rows a step, over every block
    peak: int | None = None  # bytes, from the call under simulated_device; None until weighed
    peak_rows: int = 0  # the rows a step of that call ran

    def block(self) -> None:
        """Run and time one block; the check is outside the timing."""
        self.watch.clear()
        seconds = self.call()
        durations = self.watch.durations
        if not durations:
            raise SystemExit(f"{self.name}: no step was timed")
        self.steps.append(sum(durations) / len(durations))
        self.calls.append(seconds)
        self.counts.add(len(durations))
        self.seen.add(self.rows())
        problem = self.check() if self.check is not None else None
        if problem:
            raise SystemExit(f"{self.name} left its happy path: {problem}")

    def weigh(self) -> None:
        """Run one block under the simulated device, untimed, and keep its peak bytes; then the check."""
        self.watch.clear()
        if self.model is not None:
            # Every candidate starts from the same state: Lightning leaves the last step's gradients alive
            # after fit(), and tensors made before the block would not count.
            self.model.zero_grad(set_to_none=True)
        with simulated_device(MEMORY_LIMIT) as device:
            self.call()
        if not self.watch.durations:
            raise SystemExit(f"{self.name}: no step ran under the simulated device")
        self.peak, self.peak_rows = device.peak, self.rows()
        problem = self.check() if self.check is not None else None
        if problem:
            raise SystemExit(f"{self.name} left its happy path under the simulated device: {problem}")


@dataclass
class Setting:
    label: str  # the trainer and its call
    rows: int  # the rows of a step, as configured
    agreement: str  # what the integration was checked to agree with the plain trainer on
    target: bool  # whether the target applies: training steps
    candidates: list[Candidate] = field(default_factory=list)  # plain, integration, peer..., plain again


def check_close(what: str, found: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Stop the run unless the integration's tensors are allclose to the plain trainer's."""
    if all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(found, expected, strict=True)):
        return
    worst = max((a - b).abs().max().item() for a, b in zip(found, expected, strict=True))
    raise SystemExit(f"{what} differ from the plain trainer's by up to {worst:.2e}")


def warmed(settings: list[Setting]) -> list[Setting]:
    """Run a block of every candidate once, untimed, and forget what it measured."""
    for setting in settings:
        for candidate in setting.candidates:
            candidate.block()
            candidate.steps, candidate.calls, candidate.counts, candidate.seen = [], [], set(), set()
    return settings


def block_steps(watch: Stopwatch) -> int:
    """Steps a block takes to last about ``BLOCK_SECONDS``, from the fastest step ``watch`` timed after the first."""
    return max(2, round(BLOCK_SECONDS / min(watch.durations[1:] or watch.durations)))


# Hugging Face -----------------------------------------------------------------------------


def hugging_face(args: argparse.Namespace, folder: str, notes: list[str]) -> list[Setting]:
    """Build, check and warm the Hugging Face candidates; none if transformers is missing."""
    try:
        import transformers

        from koila_retry.integrations.transformers import adapt
    except ImportError as error:
        notes.append(f"transformers not installed: its rows skipped ({error}; pip install transformers==5.23.0)")
        return []
    transformers.logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        """Rows of random tokens, all of one length; the labels are the tokens."""

        def __init__(self, batches: int, seed: int) -> None:
            generator = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, HF_VOCABULARY, (batches * HF_ROWS, HF_TOKENS), generator=generator)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[index], "labels": self.ids[index]}

    class Watch(transformers.TrainerCallback):  # type: ignore[misc]
        def __init__(self, watch: Stopwatch) -> None:
            self.watch = watch

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.watch.begin()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.watch.end()

        def on_prediction_step(self, *args: Any, **kwargs: Any) -> None:
            self.watch.lap()

    def make(**arguments: Any) -> tuple[Any, Stopwatch]:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2,
            n_head=4,
            n_embd=128,
            vocab_size=HF_VOCABULARY,
            n_positions=HF_TOKENS,
            bos_token_id=0,
            eos_token_id=0,
        )
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        settings = transformers.TrainingArguments(
            output_dir=folder,
            per_device_train_batch_size=HF_ROWS,
            per_device_eval_batch_size=HF_ROWS,
            max_steps=CHECK_STEPS,
            learning_rate=1e-3,
            optim="sgd",
            lr_scheduler_type="constant",
            train_sampling_strategy="sequential",
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            **arguments,
        )
        watch = Stopwatch()
        trainer = transformers.Trainer(
            model=transformers.GPT2LMHeadModel(config),
            args=settings,
            train_dataset=Tokens(HF_BATCHES[0], seed=1),
            eval_dataset=Tokens(HF_BATCHES[1], seed=2),
            callbacks=[Watch(watch)],
        )
        trainer.remove_callback(transformers.PrinterCallback)  # what disable_tqdm puts in place of the bar
        return trainer, watch

    plain, plain_watch = make()
    adapted, adapted_watch = make()
    adapt(adapted)

    def adapted_check() -> str | None:
        for stats in (adapted.training_step.stats, adapted.prediction_step.stats):
            if stats.ooms or stats.batch_size != HF_ROWS:
                return repr(stats)
        return None

    # The check: the same first steps from the same weights, then the same evaluation.
    plain.train()
    steps = block_steps(plain_watch)
    adapted.train()
    check_close(
        "adapt(Trainer)'s parameters after the first steps",
        list(adapted.model.parameters()),
        list(plain.model.parameters()),
    )
    losses = [torch.tensor(trainer.evaluate()["eval_loss"]) for trainer in (adapted, plain)]
    check_close("adapt(Trainer)'s evaluation loss", losses[:1], losses[1:])
    problem = adapted_check()
    if problem:
        raise SystemExit(f"adapt(Trainer) is not on its happy path: {problem}")

    def rows(trainer: Any) -> Callable[[], int]:
        return lambda: int(trainer.state.train_batch_size)

    def training(trainer: Any, watch: Stopwatch, name: str, **extra: Any) -> Candidate:
        trainer.args.max_steps = steps
        return Candidate(name, lambda: timed(trainer.train), watch, rows(trainer), model=trainer.model, **extra)

    def evaluation(trainer: Any, watch: Stopwatch, name: str, **extra: Any) -> Candidate:
        return Candidate(name, lambda: timed(trainer.evaluate), watch, lambda: HF_ROWS, model=trainer.model, **extra)

    fit = Setting("HF Trainer.train()", HF_ROWS, "parameters", True)
    fit.candidates = [
        training(plain, plain_watch, PLAIN),
        training(adapted, adapted_watch, "adapt(Trainer)", check=adapted_check),
    ]
    if not args.no_peers:
        finder, finder_watch = make(auto_find_batch_size=True)
        fit.candidates.append(training(finder, finder_watch, "Trainer(auto_find_batch_size=True)", peer=True))
    fit.candidates.append(training(plain, plain_watch, AGAIN))
    evaluate = Setting("HF Trainer.evaluate()", HF_ROWS, "evaluation loss", False)
    evaluate.candidates = [
        evaluation(plain, plain_watch, PLAIN),
        evaluation(adapted, adapted_watch, "adapt(Trainer)", check=adapted_check),
        evaluation(plain, plain_watch, AGAIN),
    ]
    return warmed([fit, evaluate])


# Lightning --------------------------------------------------------------------------------


def lightning(args: argparse.Namespace, folder: str, notes: list[str]) -> list[Setting]:
    """Build, check and warm the Lightning candidates; none if lightning is missing."""
    try:
        import lightning as L
        from lightning.fabric.utilities.warnings import PossibleUserWarning  # lightning.pytorch's only re-exports it
        from lightning.pytorch.callbacks import BatchSizeFinder, Callback

        from koila_retry.integrations.lightning import OOMRecovery
    except ImportError as error:
        notes.append(f"lightning not installed: its rows skipped ({error}; pip install lightning==2.6.6)")
        return []
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # "The dataloader does not have many workers": the rows are in memory, and every candidate reads them alike.
    warnings.filterwarnings("ignore", category=PossibleUserWarning)
    # lightning 2.6.6 builds a LeafSpec, which torch 2.13 deprecates: nothing this script can change.
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.batch_size = PL_ROWS  # what BatchSizeFinder changes
            self.net = torch.nn.Sequential(
                torch.nn.Linear(PL_FEATURES, 1024),
                torch.nn.ReLU(),
                torch.nn.Linear(1024, 1024),
                torch.nn.ReLU(),
                torch.nn.Linear(1024, 10),
            )
            generator = torch.Generator().manual_seed(1)
            self.data = [
                torch.utils.data.TensorDataset(
                    torch.randn(batches * PL_ROWS, PL_FEATURES, generator=generator),
                    torch.randint(0, 10, (batches * PL_ROWS,), generator=generator),
                )
                for batches in PL_BATCHES
            ]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = functional.cross_entropy(self.net(x), y)
            self.log("val_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(self.data[0], batch_size=self.batch_size)

        def val_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(self.data[1], batch_size=self.batch_size)

    class Watch(Callback):
        def __init__(self, watch: Stopwatch) -> None:
            self.watch = watch

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.watch.rows.add(len(batch[0]))
            self.watch.begin()

        def on_train_batch_end(self, *args: Any) -> None:
            self.watch.end()

        def on_validation_batch_start(self, trainer: Any, module: Any, batch: Any, *args: Any) -> None:
            self.watch.rows.add(len(batch[0]))
            self.watch.begin()

        def on_validation_batch_end(self, *args: Any) -> None:
            self.watch.end()

    def trainer(watch: Stopwatch, callbacks: list[Any], steps: int | None = None) -> Any:
        """A new Trainer: for ``fit`` of ``steps`` steps without validation, or, with no steps, for ``validate``."""
        return L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=-1 if steps is None else steps,
            limit_val_batches=1.0 if steps is None else 0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=folder,  # where BatchSizeFinder keeps the weights while it searches
            callbacks=[Watch(watch), *callbacks],
        )

    def rows(watch: Stopwatch) -> int:
        if len(watch.rows) != 1:
            raise SystemExit(f"steps of {sorted(watch.rows)} rows in one block")
        return next(iter(watch.rows))

    events: list[koila.OOMEvent] = []
    recovery = OOMRecovery(on_oom=events.append)

    def recovery_check() -> str | None:
        return f"{len(events)} out-of-memory errors: {events[:3]}" if events else None

    # The check: the same first steps from the same weights, then the same validation.
    plain, adapted = Classifier(), Classifier()
    plain_watch, adapted_watch = Stopwatch(), Stopwatch()
    trainer(plain_watch, [], CHECK_STEPS).fit(plain)
    steps = block_steps(plain_watch)
    trainer(adapted_watch, [recovery], CHECK_STEPS).fit(adapted)
    check_close("OOMRecovery's parameters after the first steps", list(adapted.parameters()), list(plain.parameters()))
    losses = [
        torch.tensor(trainer(Stopwatch(), callbacks).validate(module, verbose=False)[0]["val_loss"])
        for module, callbacks in ((adapted, [recovery]), (plain, []))
    ]
    check_close("OOMRecovery's validation loss", losses[:1], losses[1:])
    problem = recovery_check()
    if problem:
        raise SystemExit(f"OOMRecovery is not on its happy path: {problem}")

    def training(module: Any, watch: Stopwatch, callbacks: list[Any], name: str, **extra: Any) -> Candidate:
        def call() -> float:
            run = trainer(watch, callbacks, steps)
            return timed(lambda: run.fit(module))

        return Candidate(name, call, watch, lambda: rows(watch), model=module, **extra)

    def validation(module: Any, watch: Stopwatch, callbacks: list[Any], name: str, **extra: Any) -> Candidate:
        def call() -> float:
            run = trainer(watch, callbacks)
            return timed(lambda: run.validate(module, verbose=False))

        return Candidate(name, call, watch, lambda: rows(watch), model=module, **extra)

    recovery_name = "Trainer(callbacks=[OOMRecovery()])"
    fit = Setting("Lightning Trainer.fit()", PL_ROWS, "parameters", True)
    fit.candidates = [
        training(plain, plain_watch, [], PLAIN),
        training(adapted, adapted_watch, [recovery], recovery_name, check=recovery_check),
    ]
    if not args.no_peers:
        found, found_watch = Classifier(), Stopwatch()
        finder = BatchSizeFinder()
        fit.candidates.append(
            training(found, found_watch, [finder], "Trainer(callbacks=[BatchSizeFinder()])", peer=True)
        )
    fit.candidates.append(training(plain, plain_watch, [], AGAIN))
    validate = Setting("Lightning Trainer.validate()", PL_ROWS, "validation loss", False)
    validate.candidates = [
        validation(plain, plain_watch, [], PLAIN),
        validation(adapted, adapted_watch, [recovery], recovery_name, check=recovery_check),
        validation(plain, plain_watch, [], AGAIN),
    ]
    return warmed([fit, validate])


# The run and the tables -------------------------------------------------------------------


def run(settings: list[Setting], rounds: int) -> None:
    """Time a block of every candidate of every setting per round, in an order rotated from round to round."""
    blocks = [candidate for setting in settings for candidate in setting.candidates]
    for number in range(rounds):
        shift = number % len(blocks)
        for candidate in blocks[shift:] + blocks[:shift]:
            candidate.block()
        if (number + 1) % 10 == 0:
            print(f"  {number + 1} of {rounds} rounds done", file=sys.stderr, flush=True)


def weigh(settings: list[Setting]) -> None:
    """Measure the peak memory of one call of every candidate but the noise check, in the order of the tables."""
    for setting in settings:
        for candidate in setting.candidates[:-1]:  # the last is the plain trainer again
            candidate.weigh()


def ratio(times: list[float], base: list[float]) -> float:
    """The median over rounds of a candidate's time over the plain trainer's in the same round."""
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def shown(value: float) -> str:
    return f"{value:.3f} ({percent(value)})"


def table_rows(settings: list[Setting]) -> tuple[list[str], list[list[str]]]:
    header = [
        "setting",
        "candidate",
        "rows",
        "steps x rounds",
        "per step (median)",
        "per step (min)",
        "vs plain",
        "per call (median)",
        "call vs plain",
    ]
    table = []
    for setting in settings:
        base = setting.candidates[0]
        table += labelled(setting.label, [cells(candidate, base) for candidate in setting.candidates])
    return header, table


def cells(candidate: Candidate, base: Candidate) -> list[str]:
    """A candidate's row of the table, but its setting: its ratios are to ``base``, the plain trainer."""
    other = candidate is not base
    return [
        candidate.name + (" (peer)" if candidate.peer else ""),
        ", ".join(map(str, sorted(candidate.seen))),
        f"{'/'.join(map(str, sorted(candidate.counts)))} x {len(candidate.steps)}",
        duration(statistics.median(candidate.steps)),
        duration(min(candidate.steps)),
        shown(ratio(candidate.steps, base.steps)) if other else "",
        duration(statistics.median(candidate.calls)),
        shown(ratio(candidate.calls, base.calls)) if other else "",
    ]


def mebibytes(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def peak_of(candidate: Candidate) -> int:
    if candidate.peak is None:
        raise SystemExit(f"{candidate.name}: its peak memory was not measured")
    return candidate.peak


def memory_ratio(candidate: Candidate, base: Candidate) -> float:
    """A candidate's peak over the plain trainer's; 1.0 when neither holds anything."""
    peak, plain = peak_of(candidate), peak_of(base)
    return peak / plain if plain else (1.0 if peak == 0 else float("inf"))


def memory_rows(settings: list[Setting]) -> tuple[list[str], list[list[str]]]:
    header = ["setting", "candidate", "rows", "peak", "peak (bytes)", "vs plain"]
    table = []
    for setting in settings:
        base = setting.candidates[0]
        rows = [
            [
                candidate.name + (" (peer)" if candidate.peer else ""),
                str(candidate.peak_rows),
                mebibytes(peak_of(candidate)),
                f"{peak_of(candidate):,}",
                shown(memory_ratio(candidate, base)) if candidate is not base else "",
            ]
            for candidate in setting.candidates[:-1]
        ]
        table += labelled(setting.label, rows)
    return header, table


def verdicts(settings: list[Setting]) -> tuple[list[str], list[list[str]]]:
    header = [
        "setting",
        "plain per step",
        "integration vs plain",
        "noise check",
        "agrees with plain",
        "target",
        "met",
        "plain peak",
        "peak vs plain",
        "memory target",
        "memory met",
    ]
    table = []
    for setting in settings:
        base, integration, again = setting.candidates[0], setting.candidates[1], setting.candidates[-1]
        measured = ratio(integration.steps, base.steps)
        memory = memory_ratio(integration, base)
        table.append(
            [
                setting.label,
                duration(statistics.median(base.steps)),
                shown(measured),
                shown(ratio(again.steps, base.steps)),
                f"{setting.agreement}: allclose",
                f"<= {TARGET}" if setting.target else "none (reported)",
                ("yes" if measured <= TARGET else "NO") if setting.target else "-",
                mebibytes(peak_of(base)),
                shown(memory),
                f"<= {MEMORY_TARGET}" if setting.target else "none (reported)",
                ("yes" if memory <= MEMORY_TARGET else "NO") if setting.target else "-",
            ]
        )
    return header, table


def peer_notes(settings: list[Setting]) -> list[str]:
    """What the peers did to the batch size: BatchSizeFinder's known flaw, when it changes it."""
    notes = []
    for setting in settings:
        for candidate in setting.candidates:
            if not candidate.peer:
                continue
            if candidate.seen == {setting.rows}:
                notes.append(f"{candidate.name} kept the batch of {setting.rows} rows")
            else:
                sizes = ", ".join(map(str, sorted(candidate.seen)))
                notes.append(
                    f"{candidate.name} changed the batch size from {setting.rows} to {sizes} rows: its steps, and "
                    "so its training, are not the plain trainer's (its per-step time is of those larger steps)"
                )
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="rounds (default 30; 4 with --quick)")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="wall clock, or this thread's CPU time"
    )
    parser.add_argument(
        "--only", choices=("hf", "lightning"), help="run one trainer's rows: Hugging Face's or Lightning's"
    )
    add_run_flags(parser, no_peers="leave auto_find_batch_size and BatchSizeFinder out")
    args = parser.parse_args(argv)
    settle_rounds(parser, args)
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter

    began = time.perf_counter()
    torch.set_num_threads(1)
    notes: list[str] = ["peers skipped (--no-peers)"] if args.no_peers else []
    if args.only:
        notes.append(f"only {'Hugging Face' if args.only == 'hf' else 'Lightning'}'s rows (--only {args.only})")
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} thread), koila-retry {koila.__version__}, "
        f"transformers {version_of('transformers')}, lightning {version_of('lightning')}"
    )
    print_load("before")
    print(f"clock: {'CPU time of this thread' if args.clock == 'cpu' else 'wall clock'}")
    print(
        f"HF: GPT-2, 2 layers of width 128, {HF_ROWS} rows of {HF_TOKENS} tokens a step; Lightning: MLP "
        f"{PL_FEATURES}-1024-1024-10, {PL_ROWS} rows a step; {args.rounds} rounds ...",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as folder:
        settings = (hugging_face(args, folder, notes) if args.only != "lightning" else []) + (
            lightning(args, folder, notes) if args.only != "hf" else []
        )
        for setting in settings:
            print(f"  {setting.label}: the integration's {setting.agreement} allclose to the plain trainer's")
        for note in notes:
            print(f"note: {note}")
        if not settings:
            print("Nothing to measure: neither transformers nor lightning is installed.")
            return 0
        run(settings, args.rounds)
        print(f"  peak memory: one more call of each under simulated_device({MEMORY_LIMIT!r}) ...", flush=True)
        weigh(settings)

    header, table = table_rows(settings)
    print()
    print_text(header, table)
    print(
        "rows: rows a step; per step: the mean of a block's steps (evaluation: batches), from the trainer's callback\n"
        "hooks; per call: the whole train(), fit(), evaluate() or validate() of the block; vs plain: median over\n"
        "rounds of the ratio to the plain trainer's time in the same round"
    )
    for note in peer_notes(settings):
        print(f"note: {note}")
    memory_header, memory_table = memory_rows(settings)
    print()
    print_text(memory_header, memory_table)
    print(
        f"peak: the most bytes of tensor storages alive at once during one call (the same steps as a timed block),\n"
        f"counted exactly under koila_retry.testing.simulated_device({MEMORY_LIMIT!r}), not timed; the weights,\n"
        "made before the call, do not count; every call starts with .grad None; rows: rows a step in that call"
    )
    summary_header, summary = verdicts(settings)
    rst = [
        ("The trainers with their integrations and peers, per step and per call", header, table),
        ("Peak memory of one call, on the simulated device", memory_header, memory_table),
        ("The integrations against the targets", summary_header, summary),
    ]
    print_summary(summary_header, summary, rst if args.rst else [])
    print()
    print_load("after")
    print(f"the run took {time.perf_counter() - began:.0f} s")
    print_verdict(
        f"with nothing failing, the adapted trainers' training step at most {percent(TARGET)} over the plain "
        f"trainer's (a ratio of at most {TARGET}).",
        "the integrations' training step",
        [row[0] for row in summary if row[6] == "NO"],
    )
    print_verdict(
        f"with nothing failing, the adapted trainers' training call at most {MEMORY_TARGET} times the plain "
        "trainer's peak memory.",
        "the integrations' peak memory",
        [row[0] for row in summary if row[-1] == "NO"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
