"""PyTorch's memory snapshot of a call that runs out of memory, on request (issue 31, part 4).

The recording and the snapshot are the CUDA caching allocator's; here, without a GPU, a CUDA device
made of numbers (``tests/_fake_cuda.py``) stands in, with PyTorch's recording functions replaced by
ones that log what they are asked. On the CPU and the simulated device there is nothing to record,
and the call says so.
"""

from __future__ import annotations

import logging
import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _fake_cuda import FakeCuda

import koila_retry as koila
from koila_retry._core import memory, snapshot
from koila_retry.testing import make_oom, oom_above, simulated_device


class Allocator:
    """What the fake CUDA device's allocator was asked: recording on and off, and snapshots."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, recording: bool = False) -> None:
        self.log: list[str] = []
        self.recording = recording
        self.taken = 0
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: self.recording, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self.snapshot)
        # Nothing to give back on a device made of numbers.
        monkeypatch.setattr(memory, "release", lambda device=None: None)
        monkeypatch.setattr(memory, "release_young", lambda device=None: None)

    def record(self, enabled: str | None = "all", max_entries: int = 0, **kwargs: Any) -> None:
        self.recording = enabled is not None
        self.log.append("start" if self.recording else "stop")

    def snapshot(self, device: Any = None) -> dict[str, Any]:
        self.taken += 1
        self.log.append(f"snapshot {self.taken}")
        return {"segments": [], "device_traces": [[{"action": "oom", "n": self.taken}]]}


@pytest.fixture
def allocator(fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> Allocator:
    return Allocator(monkeypatch)


def _failing(**options: Any) -> Any:
    def run(batch_size: int, log: list[str]) -> int:
        log.append(f"attempt {batch_size}")
        oom_above(1, kind="cuda")(batch_size)
        return batch_size

    return koila.batch(initial=8, device="cuda", cache=koila.NoCache(), **options)(run)


def test_a_call_that_gives_up_writes_one_snapshot(allocator: Allocator, tmp_path: Path) -> None:
    run = _failing(minimum=2, snapshot=str(tmp_path / "oom-{rank}-{attempt}.pickle"))
    with pytest.raises(koila.BatchSizeExhausted):
        run(allocator.log)
    # Recorded from the first error on, so that the retries are in the history; written at the give-up,
    # while the failed attempt's memory is held; stopped when the call ends.
    assert allocator.log == ["attempt 8", "start", "attempt 4", "attempt 2", "snapshot 1", "stop"]
    (written,) = tmp_path.iterdir()
    assert written.name == "oom-0-3.pickle"
    assert pickle.loads(written.read_bytes())["device_traces"] == [[{"action": "oom", "n": 1}]]


def test_each_oom_writes_one_and_a_callable_is_given_the_snapshot(allocator: Allocator) -> None:
    got: list[dict[str, Any]] = []
    run = _failing(minimum=2, snapshot=got.append, snapshot_each_oom=True)
    with pytest.raises(koila.BatchSizeExhausted):
        run(allocator.log)
    assert [entry["device_traces"][0][0]["n"] for entry in got] == [1, 2, 3]
    assert allocator.log[-1] == "stop"


def test_a_call_that_recovers_stops_recording_and_writes_nothing(allocator: Allocator, tmp_path: Path) -> None:
    run = _failing(snapshot=str(tmp_path / "never.pickle"))
    assert run(allocator.log) == 1
    assert allocator.log == ["attempt 8", "start", "attempt 4", "attempt 2", "attempt 1", "stop"]
    assert list(tmp_path.iterdir()) == []


def test_a_history_recorded_already_is_left_running(fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    allocator = Allocator(monkeypatch, recording=True)
    got: list[dict[str, Any]] = []
    with pytest.raises(koila.BatchSizeExhausted):
        _failing(minimum=4, snapshot=got.append)(allocator.log)
    assert "start" not in allocator.log
    assert "stop" not in allocator.log
    assert allocator.recording
    assert len(got) == 1


def test_calls_that_record_at_once_share_the_history(allocator: Allocator) -> None:
    history = snapshot._History()
    history.join()
    history.join()
    history.leave()
    assert allocator.log == ["start"]  # another call still records
    history.leave()
    assert allocator.log == ["start", "stop"]


def test_the_history_is_shared_between_threads(allocator: Allocator) -> None:
    barrier = threading.Barrier(4)
    history = snapshot._History()

    def use() -> None:
        barrier.wait()
        for _ in range(50):
            history.join()
            history.leave()

    threads = [threading.Thread(target=use) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert history.users == 0
    assert not allocator.recording
    assert allocator.log.count("start") == allocator.log.count("stop") >= 1


def test_a_snapshot_that_cannot_be_written_warns_and_the_call_still_gives_up(
    allocator: Allocator, tmp_path: Path
) -> None:
    run = _failing(minimum=4, snapshot=str(tmp_path / "no-such-folder" / "oom.pickle"))
    with pytest.warns(UserWarning, match="snapshot= could not be taken"), pytest.raises(koila.BatchSizeExhausted):
        run(allocator.log)
    assert allocator.log[-1] == "stop"


def test_on_the_simulated_device_there_is_nothing_to_record(tmp_path: Path) -> None:
    @koila.batch(initial=8, minimum=4, snapshot=str(tmp_path / "oom.pickle"))
    def run(batch_size: int) -> torch.Tensor:
        return torch.ones(batch_size, 1024, 1024)

    with (
        simulated_device("1MiB"),
        pytest.warns(UserWarning, match=r"has none \(a simulated device\): nothing was recorded for .*run") as seen,
        pytest.raises(koila.BatchSizeExhausted),
    ):
        run()
    assert len(seen) == 1  # once a call, not once an attempt
    assert seen[0].filename == __file__  # the caller's line, for the filters and the message's place
    assert list(tmp_path.iterdir()) == []


def test_on_the_cpu_there_is_nothing_to_record(tmp_path: Path) -> None:
    @koila.batch(initial=2, minimum=1, device="cpu", snapshot=str(tmp_path / "oom.pickle"))
    def run(batch_size: int) -> None:
        raise make_oom("cpu")

    with pytest.warns(UserWarning, match="cpu has none: nothing was recorded"), pytest.raises(koila.BatchSizeExhausted):
        run()
    assert list(tmp_path.iterdir()) == []


# --- where warnings are errors (pytest -W error, PYTHONWARNINGS=error): the recovery goes on (issue 39)


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "koila_retry" and text in record.getMessage()]


def test_warnings_as_errors_cannot_stop_the_recovery(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Warned while the out-of-memory error was handled, "nothing to record" became the call's
    # error under an "error" filter, and the call was never retried.
    @koila.batch(initial=8, snapshot=str(tmp_path / "oom.pickle"))
    def run(batch_size: int) -> int:
        torch.ones(batch_size, 256, 1024)  # 1 MiB a row
        return batch_size

    with simulated_device("3MiB"), warnings.catch_warnings(), caplog.at_level(logging.WARNING, "koila_retry"):
        warnings.simplefilter("error")
        assert run() == 2
    assert run.stats.ooms == 2
    # What the filter would have raised is logged instead, once a call, as the warning is shown.
    (record,) = _logged(caplog, "nothing was recorded for")
    assert record.levelno == logging.WARNING
    assert "has none (a simulated device)" in record.getMessage()
    assert "a warnings filter made this warning an error" in record.getMessage()
    assert list(tmp_path.iterdir()) == []


def test_warnings_as_errors_never_hide_the_out_of_memory_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    @koila.batch(initial=8, minimum=4, snapshot=str(tmp_path / "oom.pickle"))
    def run(batch_size: int) -> torch.Tensor:
        return torch.ones(batch_size, 1024, 1024)

    with simulated_device("1MiB"), warnings.catch_warnings(), caplog.at_level(logging.WARNING, "koila_retry"):
        warnings.simplefilter("error")
        with pytest.raises(koila.BatchSizeExhausted):
            run()
    assert len(_logged(caplog, "nothing was recorded for")) == 1


def test_a_snapshot_that_cannot_be_written_under_warnings_as_errors_is_logged_and_the_call_recovers(
    allocator: Allocator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _failing(snapshot=str(tmp_path / "no-such-folder" / "oom-{attempt}.pickle"), snapshot_each_oom=True)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "koila_retry"):
        warnings.simplefilter("error")
        assert run(allocator.log) == 1
    assert allocator.log == [
        "attempt 8", "start", "snapshot 1", "attempt 4", "snapshot 2", "attempt 2", "snapshot 3", "attempt 1", "stop"
    ]  # fmt: skip
    assert len(_logged(caplog, "snapshot= could not be taken")) == 3  # one for each snapshot


def test_without_snapshot_nothing_is_recorded(allocator: Allocator) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(koila.BatchSizeExhausted):
            _failing(minimum=4)(allocator.log)
    assert allocator.log == ["attempt 8", "attempt 4"]


@pytest.mark.parametrize(
    ("options", "error", "shown"),
    [
        ({"snapshot": 3}, TypeError, "snapshot must be a path like 'oom/{rank}.pickle' or a callable"),
        ({"snapshot": "oom/{step}.pickle"}, ValueError, "may name {rank} and {attempt} and no other field"),
        ({"snapshot": "oom/{}.pickle"}, ValueError, "no other field"),
        ({"snapshot": "oom.pickle", "snapshot_each_oom": 1}, TypeError, "snapshot_each_oom must be a bool"),
    ],
)
def test_bad_snapshot_options_are_refused_when_the_front_end_is_made(
    options: dict[str, Any], error: type[Exception], shown: str
) -> None:
    with pytest.raises(error, match=shown.replace("(", r"\(").replace("{", r"\{").replace("}", r"\}")):
        koila.batch(**options)(lambda batch_size: None)


def test_good_snapshot_options_are_taken(tmp_path: Path) -> None:
    for target in ("oom/{rank}.pickle", tmp_path / "oom.pickle", "oom-{{literal}}.pickle", print, None):
        koila.batch(snapshot=target)(lambda batch_size: None)


# --- a path template or a combination no call could use: refused when the front end is made (issue 39)


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ({"snapshot": "oom/{attempt[0]}.pickle"}, "snapshot='oom/{attempt[0]}.pickle': the path may name {rank}"),
        ({"snapshot": "oom/{rank.foo}.pickle"}, "snapshot='oom/{rank.foo}.pickle': the path may name {rank}"),
        ({"snapshot": "oom/{rank:%Y}.pickle"}, "snapshot='oom/{rank:%Y}.pickle': the path may name {rank}"),
        ({"snapshot": ""}, "snapshot='' names no file: give a path like 'oom/rank{rank}.pickle'"),
        ({"snapshot": "", "snapshot_each_oom": True}, "snapshot='' names no file"),
        (
            {"snapshot_each_oom": True},
            "snapshot_each_oom=True writes a snapshot at every out-of-memory error, and snapshot= says where: "
            "give snapshot= a path like 'oom/rank{rank}-{attempt}.pickle' or a callable",
        ),
    ],
    ids=["subscript", "attribute", "format-spec", "empty", "empty-each", "each-without-snapshot"],
)
def test_a_snapshot_option_no_call_could_use_is_a_value_error(options: dict[str, Any], shown: str) -> None:
    with pytest.raises(ValueError) as caught:
        koila.batch(**options)(lambda batch_size: None)
    assert type(caught.value) is ValueError
    assert shown in str(caught.value)


def test_a_path_template_with_format_specs_of_the_fields_is_taken(tmp_path: Path) -> None:
    for target in ("oom/{rank:02d}-{attempt:>3}.pickle", "{rank}{attempt}", str(tmp_path / "{{rank}}.pickle")):
        koila.batch(snapshot=target, snapshot_each_oom=True)(lambda batch_size: None)


# --- every way a call ends stops its recording ---------------------------------------------


class HookFailed(Exception):
    pass


@pytest.mark.parametrize("raised", [HookFailed, KeyboardInterrupt], ids=["error", "keyboard interrupt"])
def test_an_on_oom_hook_that_raises_ends_the_recording(allocator: Allocator, raised: type[BaseException]) -> None:
    def hook(event: koila.OOMEvent) -> None:
        raise raised("the hook failed")

    run = _failing(snapshot=lambda data: None, on_oom=hook)
    with pytest.raises(raised):
        run(allocator.log)
    # As a call that gives up: recorded from the error on, and stopped as the call ended.
    assert allocator.log == ["attempt 8", "start", "stop"]
    assert not allocator.recording
    assert snapshot._history.users == 0
    # The next call that records starts the history again, and stops it.
    with pytest.raises(koila.BatchSizeExhausted):
        _failing(minimum=4, snapshot=lambda data: None)(allocator.log)
    assert allocator.log[-2:] == ["snapshot 1", "stop"]
    assert not allocator.recording


def test_a_loop_of_attempts_left_after_an_oom_ends_the_recording(allocator: Allocator) -> None:
    tried: list[int] = []

    def leave() -> None:
        for attempt in koila.attempts(initial=8, device="cuda", snapshot=lambda data: None, cache=koila.NoCache()):
            with attempt:
                tried.append(attempt.batch_size)
                raise make_oom()
            break  # the out-of-memory error is not retried

    with pytest.warns(RuntimeWarning, match="the loop over koila.attempts\\(\\) was left"):
        leave()
    assert tried == [8]
    assert allocator.log == ["start", "stop"]
    assert not allocator.recording
    assert snapshot._history.users == 0


def test_a_schedule_that_raises_ends_the_recording(allocator: Allocator) -> None:
    def refusing(failed: int) -> int:
        raise ValueError(f"no size after {failed}")

    with pytest.raises(ValueError, match="no size after 8"):
        _failing(snapshot=lambda data: None, schedule=refusing)(allocator.log)
    assert allocator.log == ["attempt 8", "start", "snapshot 1", "stop"]  # the error ends the call: its snapshot
    assert snapshot._history.users == 0


def test_an_undo_that_raises_after_an_oom_ends_the_recording(allocator: Allocator) -> None:
    """The engine's loop (what accumulate drives, with an undo of each failed attempt) ends the call too."""
    from koila_retry._core.engine import Call, Controller, run
    from koila_retry._core.policy import Policy

    policy = Policy.of("koila.batch", 8, {"snapshot": lambda data: None, "cache": koila.NoCache()})
    controller = Controller("step", policy)
    attempt = controller.start(Call(_failing, None, torch.device("cuda")))

    def undo() -> None:
        raise HookFailed("could not undo the attempt")

    with pytest.raises(HookFailed):
        run(attempt, lambda size: oom_above(1, kind="cuda")(size), undo=undo)
    assert allocator.log == ["start", "stop"]
    assert snapshot._history.users == 0
