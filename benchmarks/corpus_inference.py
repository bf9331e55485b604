"""Inference latency on the corpus (tests/corpus): eager and torch.compile paths of fxopt against
torch.fx `fuse`, `torch.jit.freeze`, Inductor and Inductor + freezing, side by side in one process.

    python benchmarks/corpus_inference.py --models ResNet,BERT --size tiny --batch 2 --rounds 5
    python benchmarks/corpus_inference.py --device cuda --dtype float16 --size real --batch 64 --models ResNet
    python benchmarks/corpus_inference.py --eager-path --models ViT,BERT,GPT-2,ResNet,ConvNeXt,MobileNetV2 --rounds 150

Each variant is built from its own deep copy of one eval-mode model; the table gives the median
latency (CUDA events on CUDA; variants called round-robin), the speed-up over eager, the time to prepare the variant (build +
first call: a compiler's cold start) and the largest output difference relative to the largest
output magnitude. A variant that cannot take a model is listed with its reason.

`--eager-path` times only fxopt's eager path, each model called as users call it (its
ModelOutput returned): eager and the `fxopt.optimize` result (Dynamo's guards + the graph), with
the ratio; it stops if Dynamo compiled again while timing.
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.fx.experimental.optimization import fuse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "corpus")]
import corpus_cli  # noqa: E402
import device as dev  # noqa: E402
from corpus_models import build  # noqa: E402

import fxopt  # noqa: E402
from fxopt.pipeline.verify import flatten_tensors  # noqa: E402


class FirstTensor(nn.Module):
    """The model's first output tensor (a Hugging Face ModelOutput's last hidden state) as a plain tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return flatten_tensors(self.model(x))[0]


def _inductor(freezing: bool):
    def build_variant(model, inputs):
        torch._dynamo.reset()
        compiled = torch.compile(model)
        # freezing is read when the first call compiles (`options={"freezing": True}` would change nothing)
        with torch._inductor.config.patch(freezing=freezing), torch.no_grad():
            compiled(*inputs)
        return compiled
    return build_variant


def _fxopt_backend(model, inputs):
    torch._dynamo.reset()
    return torch.compile(model, backend="fxopt")


def _jit_freeze(model, inputs):
    traced = torch.jit.trace(model, inputs, strict=False)
    return torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval()))


VARIANTS: dict[str, Callable[[nn.Module, tuple], Callable]] = {
    "eager": lambda model, inputs: model,
    "fxopt.optimize": lambda model, inputs: FirstTensor(fxopt.optimize(model.model, inputs, mode="inference")),
    "torch.fx fuse": lambda model, inputs: fuse(model),
    "jit.freeze": _jit_freeze,
    "Inductor": _inductor(freezing=False),
    "Inductor+freezing": _inductor(freezing=True),
    "compile(backend=fxopt)": _fxopt_backend,
}
COMPILED = ("Inductor", "Inductor+freezing", "compile(backend=fxopt)")


def bench_model(name: str, args, device, dtype) -> list[dict]:
    model, inputs = build(name, size=args.size, batch=args.batch, dtype=dtype)
    model, inputs = FirstTensor(model).to(device).eval(), tuple(x.to(device) for x in inputs)
    with torch.inference_mode():
        reference = model(*inputs)
    rows, runs = [], {}
    for variant, make in VARIANTS.items():
        if args.no_compile and variant in COMPILED:
            continue
        row = {"model": name, "variant": variant}
        try:
            start = time.perf_counter()
            with torch.no_grad():
                run = make(copy.deepcopy(model), inputs)
                out = run(*inputs)
            row["prepare s"] = round(time.perf_counter() - start, 2)
            row["rel diff"] = float((out.float() - reference.float()).abs().max() / reference.float().abs().max())
            runs[variant] = lambda run=run: run(*inputs)
        except Exception as e:  # noqa: BLE001 - a variant that cannot take this model is a result too
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        rows.append(row)
        print(f"  {name} {variant}: prepared", file=sys.stderr, flush=True)
    with torch.no_grad():
        medians = dev.round_robin_ms(runs, device, args.rounds)
    for r in rows:
        if r["variant"] in medians:
            r["median ms"] = medians[r["variant"]]
            r["vs eager"] = medians["eager"] / medians[r["variant"]]
    return rows


def rotated_rounds_ms(fns: dict[str, Callable[[], object]], device, rounds: int, warmup: int) -> dict[str, float]:
    """Median ms of each callable over rounds that call every one once, the order rotated each round: the fxopt
    result and its own graph share their tensors, so whichever runs right after the other finds them in cache."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            ms = dev.time_ms(fns[name], device)
            if round_ >= warmup:
                times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_eager_path(name: str, args, device, dtype) -> list[dict]:
    """Eager and the fxopt result on one model called as users call it, interleaved."""
    model, inputs = build(name, size=args.size, batch=args.batch, dtype=dtype)
    model, inputs = model.to(device).eval(), tuple(x.to(device) for x in inputs)
    result = fxopt.optimize(copy.deepcopy(model), inputs, mode="inference")
    runs = {"eager": lambda: model(*inputs), "fxopt": lambda: result(*inputs)}
    with torch.no_grad():
        compiled = len(result.fxopt_reports)
        medians = rotated_rounds_ms(runs, device, args.rounds, warmup=3)
    if len(result.fxopt_reports) != compiled:
        raise SystemExit(f"{name}: Dynamo compiled again during timing: {result.fxopt_report.recompile_reason}")
    eager = medians["eager"]
    return [{"model": name, "eager ms": eager, "fxopt ms": medians["fxopt"], "fxopt vs eager": eager / medians["fxopt"]}]


def main(argv=None) -> list[dict]:
    p = corpus_cli.parser(__doc__, rounds=5, no_compile_help="skip the torch.compile variants")
    p.add_argument("--eager-path", action="store_true",
                   help="only eager and the fxopt.optimize result")
    args = p.parse_args(argv)
    if args.eager_path:
        return corpus_cli.run(args, bench_eager_path, "eager-path inference (result called as the model)")
    return corpus_cli.run(args, bench_model, "inference")


if __name__ == "__main__":
    main()
