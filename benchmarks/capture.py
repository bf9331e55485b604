"""Capture on Hugging Face models: what fxopt.optimize costs over a bare torch.export, and what its result runs at.

    python benchmarks/capture.py                 # small configs (2 layers, width 64), batch 2: a minute or two
    python benchmarks/capture.py --full          # ResNet-50, MobileNetV2, ConvNeXt-tiny, ViT-base, BERT-base, GPT-2 configs
    python benchmarks/capture.py --models bert,gpt2 --modes inference

Per model and mode, in one process: the seconds of a bare `torch.export.export(model, args,
strict=False)`, of the same with the batch dimension dynamic (`Dim.AUTO`, as fxopt exports), and
of `fxopt.optimize` (capture + default pipeline), with the ratios (target <= ~2 over the bare export);
how many graphs and opaque modules the result has and the share of parameters the captured
graphs read before any pass (target: 1, 0, 100%). In inference also eager vs the result, interleaved round by round, as
medians (target: ratio >= 1).
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


def _configs(full: bool) -> dict:
    t = transformers
    if full:
        return {
            "resnet50": (lambda: t.ResNetModel(t.ResNetConfig()), "image", 224),
            "mobilenet_v2": (lambda: t.MobileNetV2Model(t.MobileNetV2Config()), "image", 224),
            "convnext": (lambda: t.ConvNextModel(t.ConvNextConfig()), "image", 224),
            "vit": (lambda: t.ViTModel(t.ViTConfig()), "image", 224),
            "bert": (lambda: t.BertModel(t.BertConfig()), "tokens", 128),
            "gpt2": (lambda: t.GPT2Model(t.GPT2Config(use_cache=False)), "tokens", 128),
        }
    text = dict(vocab_size=100)
    return {
        "resnet50": (lambda: t.ResNetModel(t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                                          depths=[1, 1, 1, 1])), "image", 64),
        "mobilenet_v2": (lambda: t.MobileNetV2Model(t.MobileNetV2Config(image_size=64, depth_multiplier=0.25)), "image", 64),
        "convnext": (lambda: t.ConvNextModel(t.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)),
                     "image", 64),
        "vit": (lambda: t.ViTModel(t.ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=128)), "image", 64),
        "bert": (lambda: t.BertModel(t.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                  intermediate_size=128, **text)), "tokens", 32),
        "gpt2": (lambda: t.GPT2Model(t.GPT2Config(n_embd=64, n_layer=2, n_head=2, use_cache=False, **text)),
                 "tokens", 32),
    }


def _inputs(kind: str, size: int, batch: int) -> tuple:
    if kind == "image":
        return (torch.randn(batch, 3, size, size),)
    return (torch.randint(0, 100, (batch, size)),)


def _seconds(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _interleaved_medians(callables: list, inputs: tuple, rounds: int) -> list[float]:
    times = [[] for _ in callables]
    with torch.no_grad():
        for fn in callables:
            fn(*inputs)  # warm-up
        for _ in range(rounds):
            for i, fn in enumerate(callables):
                start = time.perf_counter()
                fn(*inputs)
                times[i].append(time.perf_counter() - start)
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
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--modes", default="inference,training")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    configs = _configs(args.full)
    names = args.models.split(",") if args.models else list(configs)
    torch.export.export(torch.nn.Linear(2, 2), (torch.randn(2, 2),), strict=False)  # one-time set-up, not a model's cost
    rows = []
    for name in names:
        make, kind, size = configs[name]
        for mode in args.modes.split(","):
            torch.manual_seed(0)
            model = make().train(mode == "training")
            inputs = _inputs(kind, size, args.batch)
            export_s, _ = _seconds(lambda: torch.export.export(model, inputs, strict=False))
            batch = {name: {0: torch.export.Dim.AUTO} for name in inspect.signature(model.forward).bind(*inputs).arguments}
            dynamic_s, _ = _seconds(lambda: torch.export.export(model, inputs, strict=False, dynamic_shapes=batch))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    optimize_s, result = _seconds(lambda: fxopt.optimize(model, inputs, mode=mode))
            except fxopt.FxoptError as e:
                rows.append([name, mode, f"{export_s:.2f}", f"{dynamic_s:.2f}", f"failed: {str(e).splitlines()[0][:80]}"])
                print(tabulate([rows[-1]], tablefmt="plain"), flush=True)
                continue
            report = result.fxopt_report
            row = [name, mode, f"{export_s:.2f}", f"{dynamic_s:.2f}", f"{optimize_s:.2f}", f"{optimize_s / export_s:.2f}",
                   f"{optimize_s / dynamic_s:.2f}",
                   len(report.graphs), len(report.opaque), f"{100 * _captured_share(model, inputs):.0f}%"]
            if mode == "inference":
                eager_ms, fxopt_ms = (1e3 * t for t in _interleaved_medians([model, result], inputs, args.rounds))
                row += [f"{eager_ms:.2f}", f"{fxopt_ms:.2f}", f"{eager_ms / fxopt_ms:.2f}"]
            else:
                row += ["", "", ""]
            rows.append(row)
            print(tabulate([row], tablefmt="plain"), flush=True)
    print()
    print(tabulate(rows, headers=["model", "mode", "export s", "export dyn. batch s", "optimize s", "optimize/export",
                                  "optimize/export dyn.", "graphs", "opaque",
                                  "params in graphs", "eager ms", "fxopt ms", "speed-up"]))


if __name__ == "__main__":
    main()
