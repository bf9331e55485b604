"""Inference latency: eager vs torch.fx `fuse` vs TorchScript freeze vs fxopt, side by side.

    python benchmarks/inference.py           # batch 8, 224x224: ResNet-50 and MobileNetV2, hand-written + Hugging Face
    python benchmarks/inference.py --quick   # batch 2, 96x96, ResNet-18 and MobileNetV2, few rounds
    python benchmarks/inference.py --clock cpu   # one thread, CPU time of the calling thread
    python benchmarks/inference.py --batch 4 --models resnet50 mobilenet_v2   # another batch, some models

Every variant is prepared from its own deep copy of one calibrated eval-mode model and timed in
this process, round-robin (each round calls every variant once, starting one variant further
along each round, so load from other processes hits all of them alike and none always follows the
same neighbour). The table shows the median latency, the speed-up over eager (the median over
rounds of eager's time over the variant's in the same round), the time
to prepare the variant (build + first call: the cold compile time of a compiler) and the largest
difference of its output from eager's, relative to the largest output magnitude. A variant that
cannot handle a model is listed with the reason.

`--clock wall` (default) is latency with torch's default threads. On a machine shared with other
jobs wall time measures the load more than the model; `--clock cpu` runs torch on one thread and
times each call with that thread's CPU time, which other processes do not inflate.

Adding a variant is one row in VARIANTS: a name and a function (model, example_inputs) -> callable.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import functools
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
from tabulate import tabulate
from torch.fx.experimental.optimization import fuse

sys.path.insert(0, os.path.dirname(__file__))
import device as dev  # noqa: E402
import vision_models  # noqa: E402

import fxopt  # noqa: E402


def eager(model: nn.Module, inputs: tuple) -> Callable:
    return model


def fx_fuse(model: nn.Module, inputs: tuple) -> Callable:
    return fuse(model)  # symbolic_trace + Conv-BN folding; fails on models symbolic_trace rejects


def jit_freeze(model: nn.Module, inputs: tuple) -> Callable:
    traced = torch.jit.trace(model, inputs)  # torch.jit.script rejects the Hugging Face models
    return torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval()))


def fxopt_inference(model: nn.Module, inputs: tuple) -> Callable:
    return fxopt.optimize(model, inputs, mode="inference")


VARIANTS: dict[str, Callable[[nn.Module, tuple], Callable]] = {
    "eager": eager,
    "torch.fx fuse": fx_fuse,
    "jit.freeze + optimize_for_inference": jit_freeze,
    "fxopt.optimize (inference)": fxopt_inference,
}


class HiddenState(nn.Module):
    """A Hugging Face vision model returning its last hidden state as a plain tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values, return_dict=False)[0]


def hf_resnet50() -> nn.Module:
    from transformers import ResNetConfig, ResNetModel

    return HiddenState(ResNetModel(ResNetConfig()))


def hf_mobilenet_v2() -> nn.Module:
    from transformers import MobileNetV2Config, MobileNetV2Model

    return HiddenState(MobileNetV2Model(MobileNetV2Config()))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": vision_models.resnet18,
    "resnet50": vision_models.resnet50,
    "mobilenet_v2": vision_models.mobilenet_v2,
    "hf_resnet50": hf_resnet50,
    "hf_mobilenet_v2": hf_mobilenet_v2,
}
CLOCKS = ("wall", "cpu")  # cpu: one torch thread, timed by its CPU time (device.time_ms)


@dataclasses.dataclass
class Settings:
    models: tuple[str, ...]
    batch: int
    size: int
    rounds: int
    warmup: int
    clock: str = "wall"
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32


FULL = Settings(("resnet50", "mobilenet_v2", "hf_resnet50", "hf_mobilenet_v2"), batch=8, size=224, rounds=7, warmup=2)
QUICK = Settings(("resnet18", "mobilenet_v2"), batch=2, size=96, rounds=3, warmup=1)


@dataclasses.dataclass
class Prepared:
    run: Callable
    prepare_s: float
    rel_diff: float


def prepare(builder: Callable, model: nn.Module, inputs: tuple, reference: torch.Tensor) -> Prepared:
    start = time.perf_counter()
    with torch.no_grad():
        run = builder(copy.deepcopy(model), inputs)
        out = run(*inputs)
    seconds = time.perf_counter() - start
    rel_diff = float((out - reference).abs().max() / reference.abs().max())  # in the benchmark's dtype
    return Prepared(run, seconds, rel_diff)


def bench_model(name: str, settings: Settings) -> list[list]:
    torch.manual_seed(0)
    inputs = (torch.randn(settings.batch, 3, settings.size, settings.size),)
    model = vision_models.calibrate(MODELS[name](), inputs[0].shape)
    model, inputs = dev.place(model, inputs, settings.device, settings.dtype)
    with torch.no_grad():
        reference = model(*inputs)
    prepared, failed = {}, {}
    for variant, builder in VARIANTS.items():
        try:
            prepared[variant] = prepare(builder, model, inputs, reference)
        except Exception as e:  # noqa: BLE001 - a variant that cannot take this model is a result too
            failed[variant] = f"{type(e).__name__}: {str(e).splitlines()[0][:70] if str(e) else ''}"
    calls = {variant: functools.partial(p.run, *inputs) for variant, p in prepared.items()}
    with torch.inference_mode():
        times = dev.round_robin_times(calls, settings.device, settings.rounds, settings.warmup)
    rows = []
    for variant in VARIANTS:
        if variant in failed:
            rows.append([name, variant, "n/a", "n/a", "n/a", failed[variant]])
            continue
        p = prepared[variant]
        ratio = dev.paired_ratio(times, "eager", variant)
        rows.append([name, variant, f"{statistics.median(times[variant]):.1f}", f"{ratio:.2f}x",
                     f"{p.prepare_s:.2f}", f"{p.rel_diff:.1e}"])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small inputs and models, few rounds")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="models to run (default: see --quick)")
    parser.add_argument("--rounds", type=int, help="timed calls per variant (median reported)")
    parser.add_argument("--batch", type=int, help="images per call (default: see --quick)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall", help="wall latency or one-thread CPU time")
    dev.add_arguments(parser)
    args = parser.parse_args(argv)
    device, dtype = dev.from_args(args)
    settings = dataclasses.replace(QUICK if args.quick else FULL, clock=args.clock, device=device, dtype=dtype)
    settings.models = tuple(args.models or settings.models)
    settings.rounds = args.rounds or settings.rounds
    settings.batch = args.batch or settings.batch
    if settings.clock == "cpu":
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {settings.clock} clock, "
          f"batch {settings.batch}, {settings.size}x{settings.size}, {dev.describe(device, dtype)}, median of {settings.rounds} rounds "
          f"after {settings.warmup} warm-up; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    rows = [row for name in settings.models for row in bench_model(name, settings)]
    print(tabulate(rows, headers=["model", "variant", f"median ms ({settings.clock})", "vs eager", "prepare s",
                                  "max rel diff"]))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
