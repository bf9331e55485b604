"""fxopt.measure counts what torch really allocates: checked on steps whose memory is known by hand."""
import sys

import torch
import torch.nn as nn

from fxopt.measure import measure_allocator_peak, measure_peak, measure_saved_bytes, measure_training_step

MB = 1 << 20


def test_peak_counts_live_storages_once():
    """Two 1 MiB temporaries alive together, plus a view and an in-place op on them, peak at 2 MiB."""
    module = nn.Module()

    def step():
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(MB, dtype=torch.uint8)
        a.view(2, -1).zero_()  # a view and an in-place op allocate nothing
        b.add_(1)
        del a, b
        c = torch.empty(MB, dtype=torch.uint8)
        return c

    assert measure_peak(step, module) == 2 * MB


def test_peak_excludes_parameters_inputs_and_grads():
    """A Linear's weight, the input and the weight's gradient are not activation memory."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 256, bias=False)
    x = torch.randn(64, 256)
    peak = measure_training_step(lin, (x,)).peak_bytes
    out_bytes = 64 * 256 * 4
    # output + ones-like gradient of the sum; the weight gradient (256 KiB) is excluded.
    assert out_bytes <= peak <= 3 * out_bytes
    assert lin.weight.grad is None  # grads cleared after measuring


def test_saved_bytes_match_what_autograd_keeps():
    """ReLU keeps its output; Linear keeps its input; parameters are excluded with `module`."""
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    x = torch.randn(32, 128)
    act = 32 * 128 * 4
    # x (first linear's input) and the relu output (shared by relu and the second linear).
    assert measure_saved_bytes(lambda: model(x), model) == 2 * act


def test_flops_of_a_matmul():
    """FLOPs come from FlopCounterMode: 2*M*N*K forward, twice that backward for input and weight."""
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    assert measure_training_step(lin, (x,)).flops == 3 * 2 * 16 * 64 * 32


def test_allocator_peak_takes_a_compiled_forward():
    """A torch.compile'd forward (which has no truth value) is measured, not rejected."""
    model = nn.Linear(16, 4)  # not a container: its compiled wrapper raises on len()
    compiled = torch.compile(model, backend="eager")
    assert measure_allocator_peak(model, (torch.randn(8, 16),), compiled) > 0


def test_allocator_profile_prints_nothing_of_its_own(capfd):
    """Measuring with the profiler leaves stderr to the model: kineto's start/stop lines are not shown."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())

    class Noisy(nn.Module):
        def forward(self, x):
            print("the model's own line", file=sys.stderr, flush=True)
            return model(x)

    measure_allocator_peak(Noisy(), (torch.randn(2, 3, 8, 8),))
    assert capfd.readouterr().err == "the model's own line\n" * 2  # warm-up step and measured step
