"""Inference under torch.compile: Inductor, Inductor with freezing and backend="fxopt", against eager.

Batch 8, 3x224x224 (`--device`, `--dtype`: float32 on CPU by default), on Hugging Face ResNet-18/50 and MobileNetV2 built from their
configs (random weights, BN statistics randomised so folding is not trivial; no download).

Two traps that silently invalidate such a comparison are avoided:
- freezing is switched on with `torch._inductor.config.freezing = True` before the first call
  compiles (`torch.compile(m, options={"freezing": True})` changes nothing);
- each compiled variant runs in its own interpreter, with its own empty Inductor cache
  directory, so no variant reuses code compiled for another and "cold compile" is really cold.
Within each interpreter, eager and compiled calls alternate, so the latency ratio is measured
under the same machine load (this machine's cores are shared).

Because load from other processes moves between interpreters, the variants are also compared
side by side (`--side-by-side`): one interpreter per model compiles all three, each with its
own backend object (Dynamo reuses compiled code only for an equal backend), freezing switched on
only while its variant's first call compiles, and then calls eager and the three compiled
models round-robin, each round starting one variant further along. Ratios are medians of the
per-round ratios (`device.paired_ratio`), which cancel load that drifts between rounds.

    python benchmarks/compile_inference.py                  # cold compile + latency, one interpreter per variant
    python benchmarks/compile_inference.py --side-by-side   # latency of all variants in one interpreter per model
    python benchmarks/compile_inference.py --quick          # resnet18 only, fewer repeats
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ("resnet18", "resnet50", "mobilenet_v2")
VARIANTS = ("inductor", "inductor+freezing", "fxopt")
BATCH, SIZE = 8, 224


def build(name: str):
    import torch
    import transformers as hf

    configs = {
        "resnet18": lambda: hf.ResNetForImageClassification(hf.ResNetConfig(
            depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], layer_type="basic")),
        "resnet50": lambda: hf.ResNetForImageClassification(hf.ResNetConfig()),
        "mobilenet_v2": lambda: hf.MobileNetV2ForImageClassification(hf.MobileNetV2Config()),
    }
    torch.manual_seed(0)
    model = configs[name]()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, pixel_values):
            return self.net(pixel_values=pixel_values).logits

    return Logits().eval()


def compile_variant(model, variant: str, reports: list):
    import torch

    if variant == "inductor":
        return torch.compile(model, backend="inductor")
    if variant == "inductor+freezing":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # read while the first call compiles
        return torch.compile(model, backend="inductor")
    if variant == "fxopt":
        return torch.compile(model, backend="fxopt", options={"report": reports.append})
    raise ValueError(variant)


def _placed(name: str, device, dtype):
    """The model and its input batch on `device` in `dtype`."""
    import torch

    import device as dev

    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    model, (x,) = dev.place(build(name), (x,), device, dtype)
    return model, x, dev


def measure(name: str, variant: str, repeats: int, device, dtype) -> dict:
    """Run in a fresh interpreter: cold compile time, then alternating eager/compiled latencies."""
    import torch

    model, x, dev = _placed(name, device, dtype)
    reports: list = []
    with torch.no_grad():
        expected = model(x)
        compiled = compile_variant(model, variant, reports)
        start = time.perf_counter()
        got = compiled(x)
        dev.synchronize(device)
        cold = time.perf_counter() - start
        for _ in range(2):
            model(x), compiled(x)
        eager_s, compiled_s = [], []
        for _ in range(repeats):
            for fn, times in ((model, eager_s), (compiled, compiled_s)):
                times.append(dev.time_ms(lambda fn=fn: fn(x), device))
    eager_ms, compiled_ms = statistics.median(eager_s), statistics.median(compiled_s)
    return {
        "model": name, "variant": variant, "eager ms": eager_ms, "compiled ms": compiled_ms,
        "speedup vs eager": eager_ms / compiled_ms, "cold compile s": cold,
        "max |diff|": float((got - expected).abs().max()),
        "BN folded": sum(r["fold_conv_bn"].stats["folded"] for r in reports) if reports else "",
    }


def side_by_side(name: str, repeats: int, device, dtype) -> list[dict]:
    """Run in a fresh interpreter: all variants of one model, called round-robin with eager."""
    import copy

    import torch
    import torch._inductor.config as inductor_config

    from fxopt import _torch_private

    model, x, dev = _placed(name, device, dtype)
    calls = {"eager": model}
    with torch.no_grad():
        expected = model(x)
        calls["inductor"] = torch.compile(copy.deepcopy(model), backend="inductor")
        inductor_config.freezing = True  # Dynamo and Inductor read it while the first call compiles
        calls["inductor+freezing"] = torch.compile(copy.deepcopy(model),
                                                   backend=lambda gm, inputs: _torch_private.inductor_compile(
                                                       gm, inputs, freezing=True))
        calls["inductor+freezing"](x)
        inductor_config.freezing = False
        calls["fxopt"] = torch.compile(copy.deepcopy(model), backend="fxopt")
        diffs = {v: float((fn(x) - expected).abs().max()) for v, fn in calls.items()}
        times = dev.round_robin_times({v: lambda fn=fn: fn(x) for v, fn in calls.items()}, device, repeats, warmup=2)
    return [{"model": name, "variant": v, "median ms": statistics.median(t),
             "speedup vs eager": dev.paired_ratio(times, "eager", v),
             "vs inductor+freezing": dev.paired_ratio(times, "inductor+freezing", v), "max |diff|": diffs[v]}
            for v, t in times.items()]


def run_side_by_side(models=MODELS, repeats: int = 10, device_args=()) -> list[dict]:
    rows = []
    for name in models:
        with tempfile.TemporaryDirectory(prefix="inductor_cache_") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            cmd = [sys.executable, __file__, "--side-by-side-child", name, "--repeats", str(repeats), *device_args]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{name} side by side failed:\n{done.stderr[-3000:]}")
        rows += json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  done: {name} side by side", file=sys.stderr, flush=True)
    return rows


def run(models=MODELS, repeats: int = 10, device_args=()) -> list[dict]:
    rows = []
    for name in models:
        for variant in VARIANTS:
            with tempfile.TemporaryDirectory(prefix="inductor_cache_") as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
                cmd = [sys.executable, __file__, "--child", name, variant, "--repeats", str(repeats), *device_args]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{name} / {variant} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  done: {name} / {variant}", file=sys.stderr, flush=True)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per model: fxopt against Inductor with freezing (latency ratio > 1 means fxopt is faster)."""
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        by = {r["variant"]: r for r in rows if r["model"] == name}
        if {"fxopt", "inductor+freezing"} <= set(by):
            fx, fr = by["fxopt"], by["inductor+freezing"]
            out.append({"model": name, "fxopt speedup / freezing speedup": fx["speedup vs eager"] / fr["speedup vs eager"],
                        "fxopt cold / freezing cold": fx["cold compile s"] / fr["cold compile s"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="resnet18 only, 5 repeats")
    parser.add_argument("--models", nargs="*", choices=MODELS, help="models to run (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (median shown)")
    parser.add_argument("--side-by-side", action="store_true", help="all variants in one interpreter per model")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--side-by-side-child", metavar="MODEL", help=argparse.SUPPRESS)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import device as dev

    dev.add_arguments(parser)
    args = parser.parse_args()
    device, dtype = dev.from_args(args)
    device_args = ["--device", args.device, "--dtype", args.dtype, *(["--threads", str(args.threads)] if args.threads else [])]
    if args.child:
        print(json.dumps(measure(*args.child, args.repeats, device, dtype)))
        return
    if args.side_by_side_child:
        print(json.dumps(side_by_side(args.side_by_side_child, args.repeats, device, dtype)))
        return
    from tabulate import tabulate

    models = ("resnet18",) if args.quick and not args.models else tuple(args.models or MODELS)
    repeats = args.repeats or (5 if args.quick else 10)
    if args.side_by_side:
        print(f"batch {BATCH}, 3x{SIZE}x{SIZE}, {dev.describe(device, dtype)}, median of {repeats} round-robin rounds, "
              "one interpreter")
        print(tabulate(run_side_by_side(models, repeats, device_args), headers="keys", floatfmt=".3g"))
        return
    rows = run(models, repeats, device_args)
    print(f"batch {BATCH}, 3x{SIZE}x{SIZE}, {dev.describe(device, dtype)}, median of {repeats} alternating calls")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    print()
    print(tabulate(summary(rows), headers="keys", floatfmt=".3g"))


if __name__ == "__main__":
    main()
