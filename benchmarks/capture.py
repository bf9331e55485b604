"""Capture on Hugging Face models: what fxopt.optimize costs over a bare torch.export, and what its result runs at.

    python benchmarks/capture.py                 # small configs (2 layers, width 64), batch 2: a minute or two
    python benchmarks/capture.py --full          # ResNet-50, MobileNetV2, ConvNeXt-tiny, ViT-base, BERT-base, GPT-2 configs
    python benchmarks/capture.py --medium        # issue #12's sizes: 6-layer 384-wide BERT/GPT-2 (seq 128, batch 8),
                                                 # ViT (6 layers, 384, batch 4), ResNet-50 / MobileNetV2 (batch 4), ConvNeXt-T (batch 2)
    python benchmarks/capture.py --models bert,gpt2 --modes inference
    python benchmarks/capture.py --models bert,vit --layers 4 --repeat 3   # medians of 3 interleaved runs

Per model and mode, in one process: the seconds of a bare (static) `torch.export.export(model,
args, strict=False)`, of the same with the batch dimension dynamic (`Dim.AUTO`, what fxopt exports
when a call brings another batch size), of `fxopt.optimize` (capture + default pipeline) and of its
passes alone (from the report), with the ratio optimize / static export (target <= ~2); with
--repeat, medians of interleaved runs. How many graphs and opaque modules the result has and the
share of parameters the captured graphs read before any pass (target: 1, 0, 100%). In inference
also eager vs the result, interleaved round by round, as medians (target: ratio >= 1). In training
also `fxopt.optimize(..., memory_budget=0.5)` and its ratio to the median eager training step of
the same model (loss = mean of the square of the first output; target <= ~10).

All times are CPU time of the benchmark's thread (`time.thread_time()`, torch limited to one thread),
so that load from other processes on a shared machine does not inflate them.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import time
import warnings

import torch
import transformers
from tabulate import tabulate

import fxopt
from fxopt.capture import capture


def _configs(full: bool, layers: int = 2, medium: bool = False) -> dict:
    """name -> (model factory, input kind, input size[, batch])."""
    t = transformers
    if medium:
        text = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536)
        return {
            "resnet50": (lambda: t.ResNetModel(t.ResNetConfig()), "image", 224, 4),
            "mobilenet_v2": (lambda: t.MobileNetV2Model(t.MobileNetV2Config()), "image", 224, 4),
            "convnext": (lambda: t.ConvNextModel(t.ConvNextConfig()), "image", 224, 2),
            "vit": (lambda: t.ViTModel(t.ViTConfig(**text)), "image", 224, 4),
            "bert": (lambda: t.BertModel(t.BertConfig(**text)), "tokens", 128, 8),
            "gpt2": (lambda: t.GPT2Model(t.GPT2Config(n_embd=384, n_layer=6, n_head=6)),
                     "tokens", 128, 8),
        }
    if full:
        return {
            "resnet50": (lambda: t.ResNetModel(t.ResNetConfig()), "image", 224),
            "mobilenet_v2": (lambda: t.MobileNetV2Model(t.MobileNetV2Config()), "image", 224),
            "convnext": (lambda: t.ConvNextModel(t.ConvNextConfig()), "image", 224),
            "vit": (lambda: t.ViTModel(t.ViTConfig()), "image", 224),
            "bert": (lambda: t.BertModel(t.BertConfig()), "tokens", 128),
            "gpt2": (lambda: t.GPT2Model(t.GPT2Config()), "tokens", 128),
        }
    text = dict(vocab_size=100)
    return {
        "resnet50": (lambda: t.ResNetModel(t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                                          depths=[1, 1, 1, 1])), "image", 64),
        "mobilenet_v2": (lambda: t.MobileNetV2Model(t.MobileNetV2Config(image_size=64, depth_multiplier=0.25)), "image", 64),
        "convnext": (lambda: t.ConvNextModel(t.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)),
                     "image", 64),
        "vit": (lambda: t.ViTModel(t.ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=layers,
                                               num_attention_heads=2, intermediate_size=128)), "image", 64),
        "bert": (lambda: t.BertModel(t.BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=2,
                                                  intermediate_size=128, **text)), "tokens", 32),
        "gpt2": (lambda: t.GPT2Model(t.GPT2Config(n_embd=64, n_layer=layers, n_head=2, **text)),
                 "tokens", 32),
    }


def _inputs(kind: str, size: int, batch: int) -> tuple:
    if kind == "image":
        return (torch.randn(batch, 3, size, size),)
    return (torch.randint(0, 100, (batch, size)),)  # ids < 100: within every config's vocabulary


def _seconds(fn) -> tuple[float, object]:
    start = time.thread_time()
    result = fn()
    return time.thread_time() - start, result


def _quietly(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _training_step_seconds(model, inputs, rounds: int) -> float:
    """Median CPU seconds of one eager training step (forward, loss, backward)."""
    def step():
        model.zero_grad(set_to_none=True)
        model(*inputs)[0].float().pow(2).mean().backward()

    step()  # warm-up
    return statistics.median(_seconds(step)[0] for _ in range(rounds))


def _interleaved_medians(callables: list, inputs: tuple, rounds: int) -> list[float]:
    times = [[] for _ in callables]
    with torch.no_grad():
        for fn in callables:
            fn(*inputs)  # warm-up
        for _ in range(rounds):
            for i, fn in enumerate(callables):
                times[i].append(_seconds(lambda: fn(*inputs))[0])
    return [statistics.median(t) for t in times]


def _captured_share(model, inputs) -> float:
    """Share of the model's parameters (by count) that the captured graphs read, before any pass."""
    captured = capture(model, inputs)
    read = {id(p) for g in captured.graphs for name, p in g.gm.named_parameters()
            if any(n.op == "get_attr" and n.target == name for n in g.gm.graph.nodes)}
    return sum(p.numel() for p in model.parameters() if id(p) in read) / sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the models' default (full-size) configs")
    parser.add_argument("--medium", action="store_true", help="issue #12's sizes (see module docstring), each its own batch")
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--modes", default="inference,training")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2, help="transformer layers of the small configs")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved runs of each timing; medians")
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = _configs(args.full, args.layers, args.medium)
    names = args.models.split(",") if args.models else list(configs)
    torch.export.export(torch.nn.Linear(2, 2), (torch.randn(2, 2),), strict=False)  # one-time set-up, not a model's cost
    rows = []
    for name in names:
        make, kind, size, *batch_size = configs[name]
        for mode in args.modes.split(","):
            torch.manual_seed(0)
            model = make().train(mode == "training")
            inputs = _inputs(kind, size, batch_size[0] if batch_size else args.batch)
            batch = {name: {0: torch.export.Dim.AUTO} for name in inspect.signature(model.forward).bind(*inputs).arguments}
            timings = {"export": [], "dynamic": [], "optimize": [], "passes": [], "budget": []}
            try:
                for _ in range(args.repeat):
                    timings["export"].append(_seconds(lambda: torch.export.export(model, inputs, strict=False))[0])
                    timings["dynamic"].append(_seconds(lambda: torch.export.export(model, inputs, strict=False,
                                                                                   dynamic_shapes=batch))[0])
                    seconds, result = _seconds(lambda: _quietly(lambda: fxopt.optimize(model, inputs, mode=mode)))
                    timings["optimize"].append(seconds)
                    timings["passes"].append(sum(p.seconds for p in result.fxopt_report.passes))
                    if mode == "training":
                        timings["budget"].append(_seconds(lambda: _quietly(
                            lambda: fxopt.optimize(model, inputs, mode=mode, memory_budget=0.5)))[0])
            except fxopt.FxoptError as e:
                rows.append([name, mode, f"failed: {str(e).splitlines()[0][:80]}"])
                print(tabulate([rows[-1]], tablefmt="plain"), flush=True)
                continue
            export_s, dynamic_s, optimize_s, passes_s = (statistics.median(timings[k])
                                                         for k in ("export", "dynamic", "optimize", "passes"))
            report = result.fxopt_report
            row = [name, mode, f"{export_s:.2f}", f"{dynamic_s:.2f}", f"{optimize_s:.2f}", f"{passes_s:.2f}",
                   f"{optimize_s / export_s:.2f}",
                   f"{optimize_s / dynamic_s:.2f}",
                   len(report.graphs), len(report.opaque), f"{100 * _captured_share(model, inputs):.0f}%"]
            if mode == "inference":
                eager_ms, fxopt_ms = (1e3 * t for t in _interleaved_medians([model, result], inputs, args.rounds))
                row += [f"{eager_ms:.2f}", f"{fxopt_ms:.2f}", f"{eager_ms / fxopt_ms:.2f}", "", "", ""]
            else:
                budget_s = statistics.median(timings["budget"])
                step_s = _training_step_seconds(model, inputs, args.rounds)
                row += ["", "", "", f"{budget_s:.2f}", f"{1e3 * step_s:.1f}", f"{budget_s / step_s:.1f}"]
            rows.append(row)
            print(tabulate([row], tablefmt="plain"), flush=True)
    print()
    print(tabulate(rows, headers=["model", "mode", "export s", "export dyn. batch s", "optimize s", "passes s (wall)",
                                  "optimize/export",
                                  "optimize/export dyn.", "graphs", "opaque",
                                  "params in graphs", "eager ms", "fxopt ms", "speed-up",
                                  "optimize budget 0.5 s", "eager step ms", "budget optimize/step"]))


if __name__ == "__main__":
    main()
