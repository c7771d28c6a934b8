"""A process forked while another thread is inside a koila call: the child's own calls go on.

Only the forking thread lives on in the child. What the others held at the fork (a step's leaves in
the in-flight registry, a cache's lock while it wrote its file) hung the child's first call that
needed it, for ever (probe 71H). Each case runs in a subprocess, whose child reports a hang by
exiting with faulthandler's traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

_CHILD = """
pid = os.fork()
if pid == 0:
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)  # a hang: the traceback, and exit status 1
    {child}
    os._exit(0)
{parent}
_, status = os.waitpid(pid, 0)
print("child exit status", os.waitstatus_to_exitcode(status), flush=True)
"""


def _run(setup: str, child: str, parent: str) -> str:
    script = textwrap.dedent(setup) + _CHILD.format(child=child, parent=parent)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_fork_while_another_thread_is_inside_a_step_leaves_the_child_its_own_steps() -> None:
    setup = """
        import os, threading, torch
        import torch.nn.functional as F
        import koila_retry as koila

        model = torch.nn.Linear(4, 2)
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        in_backward, may_go_on = threading.Event(), threading.Event()

        class Pause(torch.autograd.Function):  # a long backward, which the fork comes in the middle of
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, g):
                in_backward.set()
                may_go_on.wait()
                return g

        step = koila.accumulate(lambda x, y: F.mse_loss(Pause.apply(model(x)), y))
        thread = threading.Thread(target=step, args=(x, y))
        thread.start()
        in_backward.wait()
    """
    child = """may_go_on.set()
    model.zero_grad(set_to_none=True)
    step(x, y)
    print("child step", model.weight.grad is not None, flush=True)"""
    out = _run(setup, child, "may_go_on.set()\nthread.join()")
    assert "child step True" in out
    assert "child exit status 0" in out


def test_a_fork_while_another_thread_holds_a_caches_lock_leaves_the_child_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    setup = f"""
        import os, subprocess, sys, threading, time
        import koila_retry as koila
        from koila_retry.testing import oom_above

        path = {str(path)!r}
        cache = koila.DiskCache(path)
        fits = oom_above(8)

        @koila.batch(initial=64, cache=cache)
        def work(batch_size):
            fits(batch_size)
            return batch_size

        @koila.batch(initial=64, cache=cache)
        def other_work(batch_size):
            fits(batch_size)
            return batch_size

        # Another process holds the file's lock, as a writer does: the thread's store waits for it holding
        # the cache's own lock, which the fork then copies taken.
        holder = (
            f"import fcntl, time; f = open({{path + '.lock'!r}}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(4)"
        )
        other = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE)
        other.stdout.readline()
        thread = threading.Thread(target=work)
        thread.start()
        time.sleep(1.5)
    """
    child = 'print("child size", other_work(), flush=True)'
    out = _run(setup, child, "thread.join()\nother.wait()")
    assert "child size 8" in out
    assert "child exit status 0" in out


def test_an_owner_freed_in_the_middle_of_a_registration_does_not_hang_it() -> None:
    # The collector runs weakref callbacks wherever it allocates: one ran inside a registration's lock,
    # took the lock again and waited on itself (caches in reference cycles, about 1 in 45,000; probe 72A).
    # Here the last reference to a registered owner goes as the next registration makes its weakref.
    script = """
        import faulthandler, types, weakref
        faulthandler.dump_traceback_later(60, exit=True)  # a hang: the traceback, and exit status 1
        from koila_retry._common import forks

        class Owner:
            pass

        dying = [Owner()]
        gone = id(dying[0])
        forks.renewed_in_child(dying[0], lambda owner: None)

        def ref(value, callback=None):
            made = weakref.ref(value, callback)
            dying.clear()  # its weakref's callback runs now, in the registration
            return made

        forks.weakref = types.SimpleNamespace(ref=ref)
        kept = Owner()
        forks.renewed_in_child(kept, lambda owner: None)
        print("registered", id(kept) in forks._owners, gone in forks._owners)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "registered True False\n"


@pytest.mark.parametrize("held", ["stats", "toma", "own_backward", "growing"])
def test_a_fork_while_another_thread_holds_a_lock_of_koila_s_leaves_the_child_its_calls(held: str) -> None:
    # A wrapper's stats (every OOM takes its lock) and compat.toma's contexts (every toma call) hung the
    # child's first call that took them (probe 75E).
    setup = f"""
        import os, threading
        import koila_retry as koila
        from koila_retry.compat import toma
        from koila_retry._core import growing
        from koila_retry._frontends import own_backward
        from koila_retry.testing import oom_above

        fits = oom_above(8)

        @koila.batch(initial=64, grow=True, cache=koila.NoCache())
        def work(batch_size):
            fits(batch_size)
            return batch_size

        work()
        lock = {{"stats": lambda: work.stats._lock, "toma": lambda: toma._contexts_lock,
                 "own_backward": lambda: own_backward._lock, "growing": lambda: growing._LOCK}}["{held}"]()
        holding, stop = threading.Event(), threading.Event()

        def hold():
            with lock:
                holding.set()
                stop.wait()

        threading.Thread(target=hold, daemon=True).start()
        holding.wait()
    """
    child = 'print("child", work(), toma.simple.batch(lambda batch_size: batch_size, 8), flush=True)'
    out = _run(setup, child, "stop.set()")
    assert "child 8 8" in out
    assert "child exit status 0" in out


def test_a_fork_while_another_thread_estimates_leaves_the_child_its_estimates() -> None:
    # The child inherited the estimate half done: the collector paused for good, a forward hook on every
    # module, and its next estimate waited for ever on the lock the estimating thread held (probe 75E).
    setup = """
        import gc, os, threading
        import torch
        import torch.nn.functional as F
        import koila_retry as koila

        model = torch.nn.Linear(4, 2)
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        in_estimate, may_go_on = threading.Event(), threading.Event()

        def loss(x, y):
            if x.is_meta and not may_go_on.is_set():  # the estimate's run, which the fork comes in the middle of
                in_estimate.set()
                may_go_on.wait()
            return F.mse_loss(model(x), y)

        step = koila.accumulate(loss, initial="auto")
        other = koila.accumulate(lambda x, y: F.mse_loss(model(x), y), initial="auto")
        thread = threading.Thread(target=step, args=(x, y))
        thread.start()
        in_estimate.wait()
    """
    child = """
    hooks = len(torch.nn.modules.module._global_forward_hooks)
    print("child", gc.isenabled(), hooks, model(x).device, flush=True)
    may_go_on.set()
    print("child steps", float(step(x, y)) > 0, float(other(x, y)) > 0, flush=True)
    """
    out = _run(setup, child, "may_go_on.set()\nthread.join()")
    assert "child True 0 cpu" in out
    assert "child steps True True" in out
    assert "child exit status 0" in out


@pytest.mark.parametrize("how", ["estimate", "auto"])
def test_a_pool_whose_own_thread_forks_runs_inside_an_estimate(how: str) -> None:
    # A fork waited for any estimate another thread ran (cc16352): a multiprocessing pool inside the step,
    # whose own thread forks a worker anew after each task, waited for the estimate that waited for it,
    # for ever (probe 75H).
    script = textwrap.dedent(
        f"""
        import faulthandler, multiprocessing, torch
        import torch.nn.functional as F
        import koila_retry as koila

        faulthandler.dump_traceback_later(120, exit=True)
        model = torch.nn.Linear(4, 2)

        def square(i):
            return i * i

        def loss(x, y):
            with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
                extra = sum(pool.map(square, range(4), chunksize=1))
            return F.mse_loss(model(x), y) + 0 * extra

        x, y = torch.randn(8, 4), torch.randn(8, 2)
        if "{how}" == "estimate":
            print("done", koila.estimate(loss, x, y).peak(8) > 0)
        else:
            print("done", float(koila.accumulate(loss, initial="auto")(x, y)) > 0)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "done True" in done.stdout


@pytest.mark.parametrize("case", ["nested", "a tracker kept alive"])
def test_a_child_forked_after_an_estimate_of_its_own_kind_starts_clean(case: str) -> None:
    # An estimate inside an estimate dropped the outer one's record of the paused collector, so a child
    # forked meanwhile kept it off; a failed estimate's tracker kept alive by its traceback had its hooks
    # dropped again in every later child, which then warned of global hooks under -W error (probe 75L).
    setup = f"""
        import concurrent.futures, gc, os, threading, warnings
        import torch
        import torch.nn.functional as F
        import koila_retry as koila

        model = torch.nn.Linear(4, 2)
        compiled = torch.compile(model)
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        inner_done, may_go_on = threading.Event(), threading.Event()

        def inner(x, y):
            return F.mse_loss(model(x), y)

        def outer(x, y):
            if not inner_done.is_set():
                koila.estimate(inner, x, y)
                inner_done.set()
                may_go_on.wait()
            return F.mse_loss(model(x), y)

        def bad(x, y):
            raise ValueError("the step's own error")

        kept = None
        if "{case}" == "nested":
            thread = threading.Thread(target=lambda: koila.estimate(outer, x, y))
            thread.start()
            inner_done.wait()
        else:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                kept = pool.submit(koila.estimate, bad, x, y).exception()  # its traceback keeps its tracker
            may_go_on.set()
            thread = threading.Thread(target=lambda: None)
            thread.start()
    """
    child = """
    warnings.simplefilter("error")
    peak = koila.estimate(lambda x, y: F.mse_loss(compiled(x), y), x, y).peak(8)
    print("child", gc.isenabled(), peak > 0, flush=True)
    """
    out = _run(setup, child, "may_go_on.set()\nthread.join()")
    assert "child True True" in out
    assert "child exit status 0" in out


def test_a_fork_while_another_thread_holds_a_simulated_device_s_lock_leaves_the_child_its_tensors() -> None:
    # The device's lock was not made anew in the child: a tensor of the parent's freed there waited for ever
    # on the lock another thread held at the fork (probe 77D).
    setup = """
        import os, threading, torch
        from koila_retry.testing import simulated_device

        held, may_go_on = threading.Event(), threading.Event()
        device = simulated_device("1GiB")
        device.__enter__()
        kept = [torch.ones(16)]  # counted by the device, freed in the child

        def hold():
            with device._tracker._lock:  # as a storage that dies in this thread takes it
                held.set()
                may_go_on.wait()

        thread = threading.Thread(target=hold)
        thread.start()
        assert held.wait(60)
    """
    child = """kept.clear()
    print("child freed", flush=True)"""
    out = _run(setup, child, "may_go_on.set()\nthread.join()\ndevice.__exit__(None, None, None)")
    assert "child freed" in out
    assert "child exit status 0" in out
