"""inplace_relu: peak memory of one step, eager vs hand-written `inplace=True` vs fxopt, side by side.

Two networks written with `inplace=False` everywhere: a ResNet-style CNN (conv-BN-ReLU, residual
blocks, max-pool stem) and an MLP-style classifier (Linear-ReLU-Dropout, the VGG/AlexNet head).
Each runs in inference (`no_grad`, eval mode) and training (forward + backward). Variants:

    eager               the model as written (inplace=False)
    inplace=True        the same model written by hand with ReLU(inplace=True), same weights
    fxopt               fxopt.optimize(eager model, passes=["inplace_relu"])
    fxopt (no mask)     the same with relu_mask=False (training only: in place alone)
    fxopt (+fold BN)    passes=["fold_conv_bn", "inplace_relu"], the default pipeline (inference only)

Peak bytes come from fxopt.measure.measure_peak (live storages while the step runs; parameters,
buffers, inputs and gradients excluded). It keys storages by `id()`, which Python reuses: when a
gradient's storage reuses the id of an activation freed earlier in the step, that activation is
dropped from the count and the peak reads low (seen here: up to 15 MiB low when the garbage
collector runs mid-step, 1 MiB with it paused). So each figure is the largest of `repeats`
measurements with the collector paused; an under-count is the only error this can make.
`saved MiB` is what autograd keeps for backward at the end of forward. No times: in-place
activations are about memory, and a shared CPU makes step times here meaningless.

    python benchmarks/memory_inplace_relu.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import gc

import torch
import torch.nn as nn
from tabulate import tabulate

import device as dev
import fxopt
from fxopt.measure import measure_peak, measure_saved_bytes

MIB = 2 ** 20


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, inplace: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu2 = nn.ReLU(inplace=inplace)
        self.down = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(out)) + self.down(x))


class ResNetStyle(nn.Module):
    def __init__(self, inplace: bool = False, widths=(32, 64, 128)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=inplace), nn.MaxPool2d(2))
        blocks, c_in = [], widths[0]
        for i, width in enumerate(widths):
            blocks += [BasicBlock(c_in, width, 1 if i == 0 else 2, inplace), BasicBlock(width, width, 1, inplace)]
            c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


class MLPStyle(nn.Module):
    def __init__(self, inplace: bool = False, sizes=(1024, 4096, 1024, 10), p: float = 0.5):
        super().__init__()
        layers = []
        for a, b in zip(sizes[:-2], sizes[1:-1]):
            layers += [nn.Linear(a, b), nn.ReLU(inplace=inplace), nn.Dropout(p)]
        layers.append(nn.Linear(sizes[-2], sizes[-1]))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


NETWORKS = {
    "ResNet-style": (ResNetStyle, lambda: (torch.randn(8, 3, 64, 64),)),
    "MLP-style": (MLPStyle, lambda: (torch.randn(256, 1024),)),
}


@contextlib.contextmanager
def _gc_paused():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _peak(step, model: nn.Module, inputs: tuple, tries: int) -> int:
    """The largest measure_peak of `step` over `tries` runs, collector paused, same RNG seed each time."""
    peaks = []
    for _ in range(tries):
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        with _gc_paused():
            peaks.append(measure_peak(step, model, inputs))
    model.zero_grad(set_to_none=True)
    return max(peaks)


def _inference(model: nn.Module, inputs: tuple, repeats: int) -> dict:
    with torch.no_grad():
        peak = _peak(lambda: model(*inputs), model, inputs, repeats)
    return {"peak MiB": peak / MIB, "saved MiB": None}


def _training(model: nn.Module, inputs: tuple, repeats: int) -> dict:
    peak = _peak(lambda: model(*inputs).sum().backward(), model, inputs, repeats)
    torch.manual_seed(0)
    saved = measure_saved_bytes(lambda: model(*inputs), model)
    return {"peak MiB": peak / MIB, "saved MiB": saved / MIB}


def _what_fxopt_did(model: nn.Module) -> str:
    return "; ".join(f"{p.name}: " + ", ".join(f"{k} {v}" for k, v in sorted(p.stats.items()))
                     for p in model.fxopt_report.passes if p.stats)


def run(repeats: int, device=torch.device("cpu"), dtype=torch.float32) -> list[dict]:
    rows = []
    for name, (network, make_inputs) in NETWORKS.items():
        torch.manual_seed(0)
        eager = network(inplace=False)
        by_hand = network(inplace=True)
        by_hand.load_state_dict(eager.state_dict())
        eager, inputs = dev.place(eager, make_inputs(), device, dtype)
        by_hand.to(device, dtype)
        for mode in ("inference", "training"):
            measure = _inference if mode == "inference" else _training
            variants = {"eager": eager, "inplace=True": by_hand}
            for model in variants.values():
                model.train(mode == "training")
            variants["fxopt"] = fxopt.optimize(eager, inputs, mode=mode, passes=["inplace_relu"])
            if mode == "training":
                variants["fxopt (no mask)"] = fxopt.optimize(eager, inputs, mode=mode, passes=["inplace_relu"],
                                                             relu_mask=False)
            else:
                variants["fxopt (+fold BN)"] = fxopt.optimize(eager, inputs, mode=mode,
                                                              passes=["fold_conv_bn", "inplace_relu"])
            baseline = None
            for variant, model in variants.items():
                row = {"network": name, "mode": mode, "variant": variant, **measure(model, inputs, repeats)}
                baseline = baseline or row["peak MiB"]
                row["peak vs eager"] = row["peak MiB"] / baseline
                row["fxopt report"] = _what_fxopt_did(model) if variant.startswith("fxopt") else ""
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="peak measurements per variant (largest is shown)")
    dev.add_arguments(parser)
    args = parser.parse_args()
    print(tabulate(run(args.repeats, *dev.from_args(args)), headers="keys", floatfmt=".3f"))


if __name__ == "__main__":
    main()
