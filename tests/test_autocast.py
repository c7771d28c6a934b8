"""``koila.estimate`` under ``torch.autocast``: the meta run casts as the device would.

The truth for the CPU is a real run under ``torch.autocast("cpu")``: the types its operators
return, and the peak of its storages. CUDA's lists are checked against PyTorch's rules on
meta tensors (a machine without CUDA switches ``torch.autocast("cuda")`` off); the real CUDA
peak under autocast is ``tests/test_cuda_estimate.py``'s, on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _dispatch import cuda_autocast
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._common.tracking import LiveStorageTracker
from koila_retry._estimation import autocast

MiB = 2**20
BF16 = torch.bfloat16

# --------------------------------------------------------------------------- the types a real run takes


def _linear() -> Callable[[torch.Tensor], list[torch.Tensor]]:
    layer = nn.Linear(16, 16)
    return lambda x: [layer(x)]


def _losses() -> Callable[[torch.Tensor], list[torch.Tensor]]:
    layer = nn.Linear(16, 4)

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        y = layer(x)
        target = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return [y, F.cross_entropy(y, target), F.mse_loss(y, torch.zeros_like(y)), F.l1_loss(y, y.detach())]

    return run


def _elementwise() -> Callable[[torch.Tensor], list[torch.Tensor]]:
    layer, norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        y = layer(x)
        return [norm(y), y.softmax(-1), y.exp(), y.sum(), torch.cat([y, x]), torch.stack([y, x]), y @ x.T]

    return run


def _convolution() -> Callable[[torch.Tensor], list[torch.Tensor]]:
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    net(torch.zeros(1, 1, 4, 4))  # the lazy layer takes its shape on the CPU, before any estimate
    return lambda x: [net(x.view(-1, 1, 4, 4))]


def _attention() -> Callable[[torch.Tensor], list[torch.Tensor]]:
    mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        seq = x.view(x.shape[0], 1, 16).expand(-1, 4, -1)
        heads = seq.reshape(x.shape[0], 4, 2, 8).transpose(1, 2)
        return [*mha(seq, seq, seq), F.scaled_dot_product_attention(heads, heads, heads)]

    return run


def _fast_path() -> Callable[[torch.Tensor], list[torch.Tensor]]:
    # Eval and no autograd: the fused fast paths, which the CPU takes under CPU autocast.
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        seq = x.view(x.shape[0], 1, 16).expand(-1, 4, -1).contiguous()
        with torch.no_grad():
            return [layer(seq), mha(seq, seq, seq, need_weights=False)[0]]

    return run


def _lstm() -> Callable[[torch.Tensor], list[torch.Tensor]]:
    lstm = nn.LSTM(16, 8, num_layers=2, batch_first=True)
    return lambda x: list(lstm(x.view(x.shape[0], 1, 16).expand(-1, 3, -1))[0:1])


def _regions() -> Callable[[torch.Tensor], list[torch.Tensor]]:
    layer = nn.Linear(16, 16)

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        inner = layer(x)
        with torch.autocast("cpu", enabled=False):
            outside = layer(x)
            with torch.autocast("cpu", dtype=BF16):
                again = layer(outside)
        return [inner, outside, again]

    return run


CASES: dict[str, Callable[[], Callable[[torch.Tensor], list[torch.Tensor]]]] = {
    "linear": _linear,
    "losses": _losses,
    "elementwise": _elementwise,
    "convolution": _convolution,
    "attention": _attention,
    "fast path": _fast_path,
    "lstm": _lstm,
    "nested regions": _regions,
}


def dtypes_of(make: Callable[[], Callable[[torch.Tensor], list[torch.Tensor]]], *, around: bool) -> tuple[Any, Any]:
    """Return the types of a real CPU autocast run's results and of the estimate's run of it.

    With ``around``, the estimate is made inside the autocast region; else the region is inside ``fn``.
    """
    torch.manual_seed(0)
    run = make()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=BF16):
        real = [tensor.dtype for tensor in run(x)]
    seen: list[list[torch.dtype]] = []

    def fn(x: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=BF16) if not around else contextlib.nullcontext():
            seen.append([tensor.dtype for tensor in run(x)])

    with torch.autocast("cpu", dtype=BF16) if around else contextlib.nullcontext():
        koila.estimate(fn, x)
    assert seen, "the estimate never ran fn"
    return real, seen[-1]


@functools.cache
def onednn_runs_bfloat16_lstms() -> bool:
    """Return whether this CPU's oneDNN has a bfloat16 LSTM (on an AVX2-only CPU it has none, and raises)."""
    lstm = nn.LSTM(16, 8, batch_first=True)
    try:
        with torch.autocast("cpu", dtype=BF16):
            lstm(torch.randn(2, 3, 16))
    except RuntimeError as error:
        if "could not create a primitive" not in str(error):
            raise
        return False
    return True


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("around", [False, True], ids=["region-in-fn", "estimate-in-region"])
def test_meta_run_takes_the_types_a_real_cpu_autocast_run_takes(case: str, around: bool) -> None:
    if case == "lstm" and not onednn_runs_bfloat16_lstms():
        pytest.skip("this CPU's oneDNN has no bfloat16 LSTM: a real run under autocast fails (AVX2 without AVX-512)")
    real, estimated = dtypes_of(CASES[case], around=around)
    assert BF16 in real or case == "losses"  # the case does exercise autocast
    assert estimated == real


class _Chain(nn.Module):
    """Operators of each autocast policy, any of them after any other, on rows of 16 features."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)
        self.weight = nn.Parameter(torch.randn(16, 16))

    def step(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name == "linear":
            return self.linear(x)
        if name == "matmul":
            return x @ self.weight
        if name == "layer_norm":
            return self.norm(x)
        if name == "softmax":
            return x.softmax(-1)
        if name == "exp":
            return x.exp()
        if name == "cat":
            return torch.cat([x, self.weight[:1].expand(x.shape[0], -1)])[: x.shape[0]]
        if name == "mse_loss":
            return x + F.mse_loss(x, torch.zeros_like(x))
        if name == "sum":
            return x + x.sum(-1, keepdim=True)
        return x.relu()


STEPS = ["linear", "matmul", "layer_norm", "softmax", "exp", "cat", "mse_loss", "sum", "relu"]


@settings(max_examples=30)
@given(st.lists(st.sampled_from(STEPS), min_size=1, max_size=6), st.sampled_from([BF16, torch.float16]))
def test_any_chain_of_operators_takes_the_types_of_a_real_run(names: list[str], dtype: torch.dtype) -> None:
    chain = _Chain()

    def run(x: torch.Tensor) -> list[torch.dtype]:
        found = []
        with torch.autocast("cpu", dtype=dtype):
            for name in names:
                x = chain.step(name, x)
                found.append(x.dtype)
        return found

    seen: list[list[torch.dtype]] = []
    x = torch.randn(4, 16)
    koila.estimate(lambda x: seen.append(run(x)), x)
    assert seen[-1] == run(x)


def test_without_autocast_the_meta_run_stays_in_float32() -> None:
    seen: list[torch.dtype] = []
    layer = nn.Linear(16, 16)
    koila.estimate(lambda x: seen.append(layer(x).dtype), torch.randn(4, 16))
    assert seen
    assert set(seen) == {torch.float32}


# --------------------------------------------------------------------------- CUDA's lists


def test_a_cuda_estimate_follows_cudas_lists() -> None:
    layer, norm = nn.Linear(16, 16), nn.LayerNorm(16)
    seen: dict[str, torch.dtype] = {}

    def fn(x: torch.Tensor) -> None:
        with cuda_autocast():
            y = layer(x)
            seen.update(
                linear=y.dtype,
                layer_norm=norm(y).dtype,  # float32 on CUDA, not on the CPU
                softmax=y.softmax(-1).dtype,  # float32 results of CUDA's reductions
                sum=y.sum().dtype,
                sum_given=y.sum(dtype=torch.float16).dtype,  # a dtype given is kept
                exp=y.exp().dtype,
                addcmul=torch.addcmul(y, x, x).dtype,  # promoted to the widest
                relu=y.relu().dtype,  # not listed: as it comes
            )

    koila.estimate(fn, torch.randn(4, 16), device="cuda")
    assert seen == {
        "linear": torch.float16,
        "layer_norm": torch.float32,
        "softmax": torch.float32,
        "sum": torch.float32,
        "sum_given": torch.float16,
        "exp": torch.float32,
        "addcmul": torch.float32,
        "relu": torch.float16,
    }


def test_binary_cross_entropy_under_cuda_autocast_raises_as_pytorch_does() -> None:
    layer = nn.Linear(16, 16)

    def fn(x: torch.Tensor) -> torch.Tensor:
        with cuda_autocast():
            return F.binary_cross_entropy(torch.sigmoid(layer(x)), torch.zeros(x.shape[0], 16))

    with pytest.raises(RuntimeError, match="unsafe to autocast") as raised:
        koila.estimate(fn, torch.randn(4, 16), device="cuda")
    assert "binary_cross_entropy_with_logits" in str(raised.value)


# --------------------------------------------------------------------------- memory against a real run


def true_peak(fn: Callable[[torch.Tensor], object], x: torch.Tensor, held: int) -> int:
    with LiveStorageTracker() as tracker:
        fn(x)
    return held + tracker.peak


def _bytes(*modules: nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for module in modules for p in module.parameters())


def test_parameter_casts_live_until_the_outermost_region_ends() -> None:
    # Inference: PyTorch keeps the bfloat16 copy of each weight until the outermost region
    # ends (without the cache, the peak inside would be lower) and drops it then, before
    # what follows allocates (with the copies kept longer, the peak after would be higher).
    first, second = nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False)

    def inside(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            y = second(first(x))
            with torch.autocast("cpu", dtype=BF16):  # nested: the cache outlives this one
                y = first(y)
            return second(y)  # the cached copy of second's weight, not a new one

    def after(x: torch.Tensor) -> torch.Tensor:
        y = inside(x)
        return torch.empty(2 * MiB, dtype=torch.uint8) if y.numel() else y

    x = torch.randn(8, 512)
    held = _bytes(first, second) + x.untyped_storage().nbytes()
    for fn in (inside, after):
        assert koila.estimate(fn, x).peak(8) == true_peak(fn, x, held), fn.__name__


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("model", ["mlp", "convolution", "transformer"])
def test_peak_under_cpu_autocast_equals_a_real_run(model: str, mode: str) -> None:
    torch.manual_seed(0)
    net: nn.Module
    if model == "mlp":
        net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 10))
        x = torch.randn(64, 256)
    elif model == "convolution":
        net = nn.Sequential(
            nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 30 * 30, 10)
        )
        x = torch.randn(16, 3, 32, 32)
    else:
        net = nn.Sequential(
            nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True), 2),
            nn.Flatten(),
            nn.Linear(64 * 32, 10),
        )
        x = torch.randn(8, 32, 64)
    optimizer = torch.optim.AdamW(net.parameters())
    y = torch.zeros(x.shape[0], dtype=torch.long)

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()

    def infer(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            return net(x)

    step = train if mode == "train" else infer
    if mode == "infer":
        net.eval()
    with only_what_storages_show():
        step(x, y)  # the optimizer's state exists from here on
        optimizer.zero_grad(set_to_none=True)
        found = koila.estimate(step, x, y)
        state = [t for s in optimizer.state.values() for t in s.values() if t.dim()]
        held = _bytes(net) + sum(t.untyped_storage().nbytes() for t in (*state, x, y))
        with LiveStorageTracker() as tracker:
            step(x, y)
    assert found.peak(x.shape[0]) == pytest.approx(held + tracker.peak, rel=0.01)


@contextlib.contextmanager
def only_what_storages_show() -> Iterator[None]:
    """Turn off what allocates where no storage shows it: oneDNN's buffers and the fused attention fast path."""
    onednn, fast_path = torch.backends.mkldnn.enabled, torch.backends.mha.get_fastpath_enabled()
    torch.backends.mkldnn.enabled = False
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = onednn
        torch.backends.mha.set_fastpath_enabled(fast_path)


# --------------------------------------------------------------------------- what it leaves, and what it says


def test_the_run_leaves_dispatch_state_and_real_autocast_as_they_were() -> None:
    layer = nn.Linear(16, 16)

    def fn(x: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=BF16):
            layer(x)
        raise ValueError("fails inside")

    included = torch._C._dispatch_tls_local_include_set()
    excluded = torch._C._dispatch_tls_local_exclude_set()
    with pytest.raises(ValueError, match="fails inside"):
        koila.estimate(fn, torch.randn(4, 16))
    assert torch._C._dispatch_tls_local_include_set() == included
    assert torch._C._dispatch_tls_local_exclude_set() == excluded
    assert autocast.casts_on() is False
    assert layer(torch.randn(2, 16)).dtype == torch.float32
    with torch.autocast("cpu", dtype=BF16):
        assert layer(torch.randn(2, 16)).dtype == BF16


def test_no_cast_outlives_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = nn.Linear(64, 64)
    casts: list[weakref.ref[torch.Tensor]] = []
    original = autocast._Emulation.cast

    def cast(self: autocast._Emulation, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        result = original(self, tensor, dtype)
        casts.append(weakref.ref(result))
        return result

    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            return layer(x)

    monkeypatch.setattr(autocast._Emulation, "cast", cast)
    koila.estimate(fn, torch.randn(4, 64))
    gc.collect()
    assert casts
    assert all(ref() is None for ref in casts)


def test_gru_under_cpu_autocast_is_noted() -> None:
    gru = nn.GRU(8, 8, batch_first=True)

    def fn(x: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=BF16):
            gru(x)

    found = koila.estimate(fn, torch.randn(4, 3, 8))
    assert any(note.startswith("torch.nn.GRU: under autocast") for note in found.notes), found.notes
    assert not koila.estimate(lambda x: gru(x), torch.randn(4, 3, 8)).notes


def test_autocast_on_another_device_is_noted() -> None:
    layer = nn.Linear(4, 4)
    seen: list[torch.dtype] = []

    def fn(x: torch.Tensor, region: bool) -> None:
        enabled = torch.is_autocast_enabled("mps")
        torch.set_autocast_enabled("mps", region)  # torch.autocast("mps") refuses without MPS
        try:
            seen.append(layer(x).dtype)
        finally:
            torch.set_autocast_enabled("mps", enabled)

    assert not koila.estimate(fn, torch.randn(2, 4), False, device="mps").notes
    notes = koila.estimate(fn, torch.randn(2, 4), True, device="mps").notes
    assert [note.split(":")[0] for note in notes] == ["torch.autocast"]
    assert set(seen) == {torch.float32}  # counted in the types it has


_HELD_KEYS = """
import json, sys, torch
held = []
for name in sys.argv[1:]:  # a backend of this process holds these keys
    library = torch.library.Library("_", "IMPL")
    library.fallback(torch.library.fallthrough_kernel, name)
    held.append(library)
import koila_retry as koila
from koila_retry._estimation import autocast
layer = torch.nn.Linear(4, 4)
seen = []
def fn(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen.append(str(layer(x).dtype))
found = koila.estimate(fn, torch.randn(2, 4))
print(json.dumps({"key": str(autocast._REGISTRY.key), "dtype": seen[-1], "notes": list(found.notes)}))
"""


@pytest.mark.parametrize(
    ("held", "key", "dtype"),
    [
        ([], "DispatchKey.AutocastIPU", "torch.bfloat16"),
        (["AutocastIPU"], "DispatchKey.AutocastHPU", "torch.bfloat16"),
        (["AutocastIPU", "AutocastHPU", "AutocastPrivateUse1"], "None", "torch.float32"),
    ],
    ids=["free", "first-held", "all-held"],
)
def test_a_spare_key_a_backend_holds_is_left_to_it(held: list[str], key: str, dtype: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _HELD_KEYS, *held], capture_output=True, text=True, check=False, timeout=600
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert (found["key"], found["dtype"]) == (key, dtype)
    noted = [note for note in found["notes"] if note.startswith("torch.autocast:")]
    assert bool(noted) == (key == "None"), found["notes"]
