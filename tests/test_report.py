"""koila.report: tensors named from the model and optimizer, counted once per storage."""

from __future__ import annotations

import json
import sys
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._common.units import format_bytes
from koila_retry.testing import simulated_device


class Tied(torch.nn.Module):
    """An embedding whose weight the output layer shares, and a normalisation with buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 50)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.embed(tokens)))


def _trained() -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randint(0, 50, (8,))).square().mean().backward()
    optimizer.step()
    return model, optimizer


def _row(found: koila.MemoryReport, name: str) -> koila._report.ReportRow:
    rows = [row for row in found.rows if name in row.names]
    assert len(rows) == 1, f"{name} is in {len(rows)} rows of\n{found}"
    return rows[0]


def _unique_storages(*tensors: torch.Tensor) -> int:
    storages = {tensor.untyped_storage()._cdata: tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


def test_every_name_appears_and_shared_storage_counts_once() -> None:
    model, optimizer = _trained()
    view = model.out.bias[:10]
    plain = torch.ones(333)

    found = koila.report(model, optimizer, top=10_000)

    tied = _row(found, "embed.weight")
    assert tied.names == ("embed.weight", "out.weight")
    assert (tied.kind, tied.shape, tied.dtype, tied.nbytes) == ("parameter", (50, 16), "float32", 50 * 16 * 4)
    assert _row(found, "embed.weight.grad").names == ("embed.weight.grad", "out.weight.grad")
    assert _row(found, "norm.running_mean").kind == "buffer"
    assert _row(found, "norm.num_batches_tracked").dtype == "int64"
    assert _row(found, "out.bias").views == ("float32[10]",)
    for parameter in ("embed.weight", "norm.weight", "norm.bias", "out.bias"):
        for key in ("exp_avg", "exp_avg_sq"):
            assert _row(found, f"optimizer.state[{parameter}].{key}").kind == "optimizer state"
    plain_rows = [row for row in found.rows if row.kind == "tensor" and row.shape == (333,)]
    assert [row.nbytes for row in plain_rows] == [333 * 4]

    named = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    named += [value for state in optimizer.state.values() for value in state.values()]
    # Adam's step counts live on the CPU as tensors too: all of it is on this device.
    assert sum(row.nbytes for row in found.rows if row.kind != "tensor") == _unique_storages(*named)
    assert found.total == sum(row.nbytes for row in found.rows) + found.omitted
    assert found.storages >= len(found.rows)
    del view, plain


def test_totals_equal_the_sum_of_unique_storages_with_nothing_else_alive() -> None:
    model, optimizer = _trained()
    found = koila.report(model, optimizer, top=10_000)
    named = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    named += [value for state in optimizer.state.values() for value in state.values()]
    ours = {row.names for row in found.rows if row.kind != "tensor"}
    assert sum(row.nbytes for row in found.rows if row.names in ours) == _unique_storages(*named)
    assert found.omitted == 0
    assert found.total == sum(row.nbytes for row in found.rows)


def test_rows_are_the_largest_first_and_top_limits_them() -> None:
    model, optimizer = _trained()
    found = koila.report(model, optimizer, top=3)
    assert len(found.rows) == 3
    sizes = [row.nbytes for row in found.rows]
    assert sizes == sorted(sizes, reverse=True)
    everything = koila.report(model, optimizer, top=10_000)
    assert found.total == everything.total
    assert found.omitted == everything.total - sum(sizes)
    assert f"{everything.storages - 3} smaller storages not shown" in str(found)


def test_a_parameter_outside_the_model_is_named_from_the_optimizer() -> None:
    model, _ = _trained()
    extra = torch.nn.Parameter(torch.zeros(7, 3))
    optimizer = torch.optim.SGD([{"params": model.parameters()}, {"params": [extra], "momentum": 0.9}], lr=0.1)
    extra.grad = torch.ones(7, 3)
    optimizer.step()
    found = koila.report(model, optimizer, top=10_000)
    name = "optimizer.param_groups[1]['params'][0]"
    assert _row(found, name).kind == "parameter"
    assert _row(found, f"{name}.grad").kind == "gradient"
    assert _row(found, f"optimizer.state[{name}].momentum_buffer").nbytes == 7 * 3 * 4


def test_optimizer_state_kept_in_lists_is_named_by_its_place() -> None:
    # LBFGS keeps its history in lists: their tensors were rows of a bare "tensor", the largest part.
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.LBFGS(model.parameters(), history_size=2)
    x, y = torch.randn(8, 16), torch.randn(8, 16)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        optimizer.step(closure)
    found = koila.report(model, optimizer, top=10_000)
    assert len(optimizer.state[model.weight]["old_dirs"]) == 2
    for name in ("old_dirs[0]", "old_dirs[1]", "old_stps[0]", "old_stps[1]"):
        assert _row(found, f"optimizer.state[weight].{name}").kind == "optimizer state"
    # A list inside itself is named once, not walked until RecursionError (probe 72I).
    looped: list[Any] = [torch.ones(3)]
    looped.append(looped)
    optimizer.state[model.weight]["looped"] = looped
    assert _row(koila.report(model, optimizer, top=10_000), "optimizer.state[weight].looped[0]").nbytes == 12


def test_a_tensor_that_keeps_its_graph_says_so() -> None:
    model, _ = _trained()
    kept = model(torch.randint(0, 50, (8,)))  # as if appended to a list of outputs
    found = koila.report(model, top=10_000)
    rows = [row for row in found.rows if row.shape == (8, 50) and row.kind == "tensor"]
    assert len(rows) == 1
    assert rows[0].names == ("tensor (AddmmBackward0 keeps its autograd graph)",)
    del kept


def test_unnamed_tensors_sharing_a_storage_make_one_row_under_their_base() -> None:
    base = torch.zeros(1000, 3)
    column = base[:, 1]
    row = base[5]
    found = koila.report(top=10_000)
    rows = [entry for entry in found.rows if entry.shape == (1000, 3) and entry.kind == "tensor"]
    assert len(rows) == 1
    assert sorted(rows[0].views) == ["float32[1000]", "float32[3]"]
    assert rows[0].nbytes == 12_000
    del column, row


def test_tensors_on_another_device_are_not_counted() -> None:
    model = torch.nn.Linear(4, 4).to("meta")
    found = koila.report(model, device="meta")
    assert found.rows == []
    assert found.total == 0
    assert str(found).startswith("Memory on meta: 0 bytes in 0 storages")


def test_storages_no_tensor_holds_are_shown_inside_a_simulated_device() -> None:
    def saved(report: koila.MemoryReport) -> int:
        return sum(row.nbytes for row in report.rows if row.shape == (64, 1))

    with simulated_device("1GiB") as device:
        before = koila.report(device="cpu", top=10_000)  # what the process holds already (other tests')
        source = torch.randn(64, 256, requires_grad=True)
        # Under the device's dispatch mode even the mean and deviation layer_norm saves are tensors.
        out = torch.nn.functional.layer_norm(source, (256,))
        bare = torch.zeros(1000).untyped_storage()
        found = koila.report(device="cpu", top=10_000)
        live = device.live
    (hidden,) = [row for row in found.rows if row.kind == "no tensor"]
    assert (hidden.names, hidden.nbytes) == (("1 storage no Python tensor holds",), 4000)
    assert saved(found) - saved(before) == 2 * 64 * 4
    assert found.simulated == (live, 1024**3)
    assert live == 2 * 64 * 256 * 4 + 2 * 64 * 4 + 4000
    assert "Simulated device: " in str(found)
    del out, bare


def test_a_row_of_several_storages_no_tensor_holds_counts_each_of_them() -> None:
    with simulated_device("1GiB"):
        bare = [torch.zeros(10).untyped_storage() for _ in range(5)]
        found = koila.report(device="cpu", top=10_000_000)
    (hidden,) = [row for row in found.rows if row.kind == "no tensor"]
    assert hidden.names == ("5 storages no Python tensor holds",)
    # Every row shown, one of them for 5 storages: none left out, and each counted in the total.
    assert found.storages == len(found.rows) + 4
    assert "not shown" not in str(found)
    assert f"in {found.storages} storages" in found.summary(top=10_000_000)
    del bare


def test_output_forms_agree() -> None:
    model, optimizer = _trained()
    # Every storage a row: the report covers the process's, and what other tests in this process
    # left alive (a trainer's modules, say) would outrank this small model's in a top five.
    found = koila.report(model, optimizer, top=100_000)
    text = str(found)
    lines = text.splitlines()
    assert lines[0].startswith("Memory on cpu: ")
    header = lines[1]
    assert header.split() == ["name", "kind", "shape", "dtype", "bytes"]
    # Aligned: every table line is as wide as its separator, the byte column right-aligned.
    width = len(lines[2])
    assert all(len(line) == width for line in lines[3:8] if "view of" not in line)
    assert "embed.weight, out.weight" in text
    html = found._repr_html_()
    # A line per row, per view listed, for the base of a row's views and for its views not listed; the header's.
    lines_of = [1 + len(row.views) + (row.base is not None) + (row.more_views > 0) for row in found.rows]
    assert html.count("<tr>") == sum(lines_of) + 1
    assert "embed.weight, out.weight" in html
    data = json.loads(json.dumps(found.to_dict()))
    assert data["total"] == found.total
    assert data["rows"][0]["names"] == list(found.rows[0].names)
    assert data["device"] == "cpu"
    assert repr(found).startswith("MemoryReport(device='cpu', total=")


def test_html_escapes_names() -> None:
    model = torch.nn.ModuleDict({"<b>": torch.nn.Linear(2, 2)})
    html = koila.report(model, top=10_000)._repr_html_()
    assert "&lt;b&gt;.weight" in html
    assert "<b>.weight" not in html


def test_the_report_keeps_no_tensor_alive() -> None:
    tensor = torch.ones(100)
    reference = weakref.ref(tensor)
    found = koila.report(top=10_000)
    del tensor
    assert reference() is None
    assert found.total > 0


def test_the_default_device_is_the_models() -> None:
    model = torch.nn.Linear(3, 3)
    assert koila.report(model).device == torch.device("cpu")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"model": "model"}, TypeError, "model must be a torch.nn.Module or None, got str 'model'"),
        # A tensor is described by its shape: its repr would print its values into the message.
        ({"model": torch.nn.Parameter(torch.zeros(2, 3))}, TypeError, "got Parameter of shape (2, 3)"),
        ({"optimizer": torch.nn.Linear(1, 1)}, TypeError, "optimizer must be a torch.optim.Optimizer or None"),
        ({"top": 0}, ValueError, "top must be >= 1, got 0"),
        ({"top": 2.5}, TypeError, "top must be an int, got float 2.5"),
        ({"device": "nowhere"}, (ValueError, RuntimeError), "nowhere"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        koila.report(**kwargs)  # type: ignore[arg-type]


# --- the report in BatchSizeExhausted's message ----------------------------------------


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))


def test_an_exhausted_step_names_the_largest_parameters_and_the_per_sample_estimate() -> None:
    from koila_retry._estimation import auto

    # 16 MiB of weights, 16 MiB of gradients and the inputs: a sample more does not fit. (At 33 MiB the
    # whole step fits, 32.8 MiB: it gave up only while initial="auto" counted the inputs twice.)
    with simulated_device("32800KiB"):
        model = _mlp()

        @koila.accumulate(initial="auto")
        def step(inputs: torch.Tensor) -> torch.Tensor:
            return model(inputs).square().mean()

        with pytest.raises(koila.BatchSizeExhausted) as caught:
            step(torch.randn(64, 1024))
    message = str(caught.value)
    assert "Largest on cpu (" in message
    assert "0.weight (parameter) 8.00 MiB; 2.weight (parameter) 8.00 MiB;" in message
    memo = auto._memo_of(step.cache_info.__self__)  # initial="auto" keeps its estimates in the step's cache
    (estimates,) = memo.estimates.values()
    found = estimates.split or estimates.whole  # a step that does not fit whole is sized as a split one
    assert found is not None
    per_sample, fixed = found.per_sample, found.fixed
    # One sample's activations: at least the hidden layer's output and the ReLU's, in float32.
    assert per_sample >= 2 * 2048 * 4
    assert (
        f"The estimate (initial='auto') puts one sample at {format_bytes(per_sample)} on top of "
        f"{format_bytes(fixed)} that do not depend on the batch size." in message
    )


def test_an_exhausted_call_names_models_from_the_callers_variables() -> None:
    with simulated_device("20MiB"):
        encoder, decoder = _mlp(), torch.nn.Linear(1024, 8)

        @koila.batch(initial=8)
        def run(batch_size: int, data: torch.Tensor) -> torch.Tensor:
            return decoder(encoder(data[:batch_size].repeat(2000, 1)))

        with pytest.raises(koila.BatchSizeExhausted) as caught:
            run(torch.randn(8, 1024))
    message = str(caught.value)
    assert "encoder.0.weight (parameter) 8.00 MiB; encoder.2.weight (parameter) 8.00 MiB;" in message
    assert "decoder.weight (parameter) 32.00 KiB" in message
    assert "The estimate" not in message  # no initial="auto", no estimate


def test_an_exhausted_block_names_what_its_frame_holds() -> None:
    with simulated_device("20MiB"):
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with pytest.raises(koila.BatchSizeExhausted) as caught:
            for attempt in koila.attempts(initial=4, cache=koila.NoCache()):
                with attempt:
                    model(torch.randn(attempt.batch_size * 4000, 1024)).sum().backward()
                    optimizer.step()
    assert "0.weight (parameter) 8.00 MiB" in str(caught.value)


def test_a_failing_diagnosis_does_not_hide_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from koila_retry._diagnostics import report

    def broken(*_: object, **__: object) -> str:
        raise RuntimeError("the report is broken")

    monkeypatch.setattr(report, "explain", broken)

    @koila.batch(initial=2)
    def run(batch_size: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    with pytest.raises(koila.BatchSizeExhausted, match="out of memory. Every batch size tried failed") as caught:
        run()
    assert "Largest on" not in str(caught.value)
    assert "the report is broken" not in str(caught.value)


def test_gradients_a_step_set_aside_are_named_as_gradients() -> None:
    with simulated_device("45MiB"):  # weights and their gradients: 32 MiB; another 16 MiB does not fit
        model = _mlp()
        model(torch.randn(2, 1024)).sum().backward()

        @koila.accumulate(initial=4)
        def step(inputs: torch.Tensor) -> torch.Tensor:
            return model(inputs).square().mean()

        with pytest.raises(koila.BatchSizeExhausted) as caught:
            step(torch.randn(4, 1024))
        assert model[0].weight.grad is not None  # given back after the failure
    assert "0.weight.grad (gradient) 8.00 MiB" in str(caught.value)
    assert "tensor float32[2048, 1024]" not in str(caught.value)


def test_the_callers_variables_are_not_kept_after_the_error() -> None:
    # Reading a running frame's variables must leave no copy behind that outlives a `del`.
    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int, data: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    big = torch.zeros(1000)
    reference = weakref.ref(big)
    with pytest.raises(koila.BatchSizeExhausted) as caught:
        run(big)
    assert "big float32[1000]" in str(caught.value)
    del caught, big  # the error's traceback holds the wrapper's frame, and through it the arguments
    assert reference() is None


def test_on_an_accelerator_the_allocators_figures_stand_beside_the_total(monkeypatch: pytest.MonkeyPatch) -> None:
    # No accelerator here: the report is told the CPU is one, with the allocator's figures made up.
    from koila_retry._core import memory

    model = torch.nn.Linear(64, 64)
    total = koila.report(model, top=10_000).total
    monkeypatch.setattr(memory, "on_accelerator", lambda device: True)
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda device: total + 3 * 2**20)
    monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda device: total + 10 * 2**20)
    found = koila.report(model, top=10_000)
    assert (found.allocated, found.reserved) == (total + 3 * 2**20, total + 10 * 2**20)
    notes = found.notes()
    assert notes[-2].startswith("PyTorch's allocator: ")
    assert notes[-2].endswith("reserved (7.00 MiB of it cached for reuse).")
    assert notes[-1] == (
        "3.00 MiB allocated are in no tensor Python can reach: tensors autograd saved for backward, "
        "tensors only C++ holds, and each block's rounding up to 512 bytes."
    )
    assert notes[-1] in str(found)
    assert found.to_dict()["allocated"] == total + 3 * 2**20


def test_fake_tensors_left_alive_are_not_memory() -> None:
    # torch.compile leaves fake tensors behind, some with symbolic sizes that cannot be read.
    with FakeTensorMode():
        fake = torch.empty(123, 457)
    found = koila.report(device="cpu", top=10_000)
    assert all(row.shape != (123, 457) for row in found.rows)
    del fake


def test_the_gradients_a_step_holds_apart_are_named_as_the_steps() -> None:
    from koila_retry._diagnostics.report import explain

    model = _mlp()
    model(torch.randn(2, 1024)).sum().backward()  # gradients from before the step, in .grad
    seen: list[str] = []

    @koila.accumulate(initial=2)
    def step(inputs: torch.Tensor) -> torch.Tensor:
        if len(seen) == 0 and inputs.data_ptr() != whole.data_ptr():  # the second micro-batch
            seen.append(explain(torch.device("cpu"), sys._getframe(), top=8))
        return model(inputs).square().mean()

    whole = torch.randn(4, 1024)
    step(whole)
    (message,) = seen
    assert "0.weight.grad (gradient) 8.00 MiB" in message
    assert "the step's 0.weight.grad (gradient) 8.00 MiB" in message


def test_a_nested_tensor_alive_is_left_out_and_the_give_up_still_names_what_holds_memory() -> None:
    """A nested tensor says it is strided but has no sizes: every report raised, and a give-up lost its list."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's note that nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(5)])
    model = torch.nn.Linear(4, 4)
    found = koila.report(model, device="cpu", top=10_000)  # whatever else the process holds
    assert {row.names[0] for row in found.rows if row.kind == "parameter"} >= {"weight", "bias"}
    with simulated_device("64KiB"):
        weights = torch.zeros(1024)

        @koila.batch(initial=64, minimum=64, cache=koila.NoCache())
        def run(batch_size: int) -> torch.Tensor:
            return torch.ones(batch_size, 1024)

        with pytest.raises(koila.BatchSizeExhausted, match="Largest on cpu"):
            run()
    del nested, weights


def test_a_give_up_numbers_modules_and_optimizers_of_one_kind_held_in_containers() -> None:
    """Two Linear layers in a dict, and their optimizers in a list, were named alike in what holds memory."""
    with simulated_device("40KiB"):
        nets = {"encode": torch.nn.Linear(32, 32), "decode": torch.nn.Linear(32, 32)}
        optimizers = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) for net in nets.values()]
        for net, optimizer in zip(nets.values(), optimizers, strict=True):
            net(torch.randn(2, 32)).sum().backward()
            optimizer.step()
        del net, optimizer  # held by the containers alone

        @koila.batch(initial=64, minimum=64, cache=koila.NoCache())
        def run(batch_size: int) -> torch.Tensor:
            return nets["decode"](nets["encode"](torch.randn(batch_size, 32)))

        with torch.no_grad(), pytest.raises(koila.BatchSizeExhausted) as info:
            run()
    held = str(info.value).split("Largest on", 1)[1]
    assert "Linear.weight (parameter)" in held
    assert "Linear#2.weight (parameter)" in held


def _cut_from_one_buffer(layers: int) -> tuple[torch.Tensor, torch.nn.ModuleList]:
    """Layers whose parameters are views cut from one flat buffer, as a flat-parameter wrapper makes them."""
    model = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(layers)])
    flat = torch.zeros(sum(parameter.numel() for parameter in model.parameters()))
    offset = 0
    for layer in model:
        for name, parameter in list(layer.named_parameters()):
            size = parameter.numel()
            setattr(layer, name, torch.nn.Parameter(flat[offset : offset + size].view_as(parameter)))
            offset += size
    return flat, model


def test_a_storage_thousands_of_names_share_shows_a_few_and_counts_the_rest() -> None:
    """4,000 parameters cut from one buffer made one row 45,818 characters wide, and a message of 46,000."""
    flat, model = _cut_from_one_buffer(2000)
    every = [name for name, _ in model.named_parameters()]
    joined = ", ".join(every)
    found = koila.report(model, top=5)
    (row,) = [row for row in found.rows if row.kind == "parameter"]
    assert row.names == tuple(every[: len(row.names)])
    assert len(row.names) + row.more_names == len(every) == 4000
    assert f"{row.names[-1]} and {row.more_names} more names" in str(found)
    # The buffer the parameters view spans the storage: its base, not a view of the first parameter.
    assert row.base == f"float32[{flat.numel()}]"
    assert f"base of {every[0]}: float32[{flat.numel()}]" in str(found)
    assert f"view of {every[0]}: float32[{flat.numel()}]" not in str(found)
    assert max(len(line) for line in str(found).splitlines()) < 2_000 < len(joined)
    assert len(found.summary()) < 2_000


def test_a_give_up_over_a_storage_thousands_of_names_share_stays_short() -> None:
    with simulated_device("2MiB"):
        flat, model = _cut_from_one_buffer(2000)
        every = [name for name, _ in model.named_parameters()]

        @koila.batch(initial=64, minimum=8, cache=koila.NoCache())
        def run(batch_size: int) -> int:
            return torch.ones(batch_size, 64, 1024).shape[0]  # 256 KiB a row

        with pytest.raises(koila.BatchSizeExhausted) as caught:
            run()
    message = str(caught.value)
    held = message.split("Largest on", 1)[1]
    # The buffer is a variable here: named as what the parameters view.
    assert f"{every[4]} and {len(every) - 5} more names (parameter, views of flat)" in held
    assert len(held) < 2_000 < len(", ".join(every))
    del flat


def test_a_give_up_shortens_the_keys_that_name_what_is_held() -> None:
    """A cache keyed by prompts printed each prompt whole: a give-up's message of about 10 KB."""
    prompt = "Summarise the following document carefully. " * 40
    with simulated_device("256KiB"):
        cache = {f"{prompt}{index}{prompt}": torch.ones(4096) for index in range(8)}  # 16 KiB each, alike at both ends

        @koila.batch(initial=8, cache=koila.NoCache())
        def run(batch_size: int) -> int:
            return torch.ones(batch_size, 65536).shape[0]  # 256 KiB a row

        with pytest.raises(koila.BatchSizeExhausted) as caught:
            run()
    message = str(caught.value)
    assert "cache['Summarise" in message  # still named, by the start of its key
    assert prompt not in message
    assert len(message) < 2_000
    # Keys that read alike once cut short are numbered, as two modules of one class are.
    held = message.split("Largest on", 1)[1].split("; ")
    names = [part.rsplit(" float32[", 1)[0] for part in held if " float32[" in part]
    assert len(names) > 1, held
    assert len(set(names)) == len(names), names
    del cache


def test_a_lazy_modules_parameters_hold_nothing_and_stop_nothing() -> None:
    """An uninitialised parameter refused to name its storage: report raised, a give-up lost its list."""
    lazy = torch.nn.LazyLinear(4)  # anywhere in the process: report walks every object
    model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.Linear(8, 2))
    found = koila.report(model, top=10_000)
    assert _row(found, "1.weight").kind == "parameter"
    assert not [row for row in found.rows if any(name.startswith("0.") for name in row.names)]
    with simulated_device("64KiB"):
        weights = torch.nn.Linear(64, 64)

        @koila.batch(initial=8, cache=koila.NoCache())
        def run(batch_size: int) -> int:
            return torch.ones(batch_size, 16384).shape[0]

        with pytest.raises(koila.BatchSizeExhausted) as caught:
            run()
    assert "weights.weight" in str(caught.value).split("Largest on", 1)[1]
    del lazy, weights


def test_the_table_escapes_control_characters_in_names() -> None:
    """A module named with a newline broke the table's line in two."""
    model = torch.nn.Module()
    model._modules["x\ny|z"] = torch.nn.Linear(3, 3)
    found = koila.report(model, top=10_000)
    assert _row(found, "x\ny|z.weight").kind == "parameter"  # the data keeps the name as it is
    lines = str(found).splitlines()
    (line,) = [line for line in lines if "y|z.weight" in line]
    assert line.split()[:2] == ["x\\ny|z.weight", "parameter"]
    assert not any(line.startswith("y|z") for line in lines)
    assert "x\\ny|z.weight" in found._repr_html_()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_process_lacks_is_refused_as_free_memory_refuses_it() -> None:
    """koila.report and koila.profile on "cuda" without CUDA gave empty results."""
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="this process has no cuda device") as free:
        koila.free_memory("cuda")
    assert "cuda:0" in str(free.value)
    with pytest.raises(ValueError, match="cannot report on cuda:0: this process has no cuda device"):
        koila.report(model, device="cuda")
    with pytest.raises(ValueError, match="cannot profile on cuda:0: this process has no cuda device"):
        koila.profile(model, torch.zeros(1, 4), device="cuda")
    # On meta tensors every tensor counts, whatever its device: the device is a label.
    assert koila.profile(model, torch.zeros(1, 4), device="cuda", fake=True).device == torch.device("cuda", 0)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")  # torch's, once per process
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_tensor_is_counted_by_its_indices_and_values() -> None:
    # A sparse embedding's gradient (8 MiB here) was left out of the rows and the total: not strided.
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(1000, 64, sparse=True)
    embedding(torch.randint(0, 1000, (512,))).sum().backward()  # type: ignore[no-untyped-call]
    grad = embedding.weight.grad
    assert grad is not None
    assert grad.layout == torch.sparse_coo
    loose = torch.sparse_coo_tensor(torch.arange(8).view(1, -1), torch.ones(8, 4), (100, 4))  # named by nobody
    found = koila.report(embedding, device="cpu", top=10**6)  # other tests leave tensors alive in this process
    held = {row.names[0]: row for row in found.rows}
    assert held["weight.grad (values)"].nbytes == grad._values().untyped_storage().nbytes()
    assert held["weight.grad (indices)"].nbytes == grad._indices().untyped_storage().nbytes()
    assert held["weight.grad (values)"].kind == "gradient"
    assert held["weight.grad (values)"].views == ()  # the sparse tensor itself is no other view of it
    loose_bytes = loose._values().untyped_storage().nbytes()
    assert any(row.nbytes == loose_bytes and row.names == ("sparse tensor (values)",) for row in found.rows)
    # An unnamed sparse tensor that keeps a graph is marked by its own grad_fn (its parts have none, or one of
    # their own: a compressed layout's values() is differentiable), probe 74L.
    weight = torch.randn(30, 30, requires_grad=True)
    kept, csr = (weight * 2).to_sparse(), torch.nn.Parameter(torch.eye(40).to_sparse_csr())
    names = [name for row in koila.report(device="cpu", top=10**6).rows for name in row.names]
    assert "sparse tensor (values) (ToSparseBackward1 keeps its autograd graph)" in names
    assert "sparse tensor (indices) (ToSparseBackward1 keeps its autograd graph)" in names
    assert not any("ValuesBackward" in name for name in names)
    assert kept.grad_fn is not None
    assert csr.grad_fn is None
