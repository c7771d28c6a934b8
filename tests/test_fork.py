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
