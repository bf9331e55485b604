"""The command line the corpus benchmarks share (`corpus_inference.py`, `corpus_training_memory.py`):
which models, what size and batch, how many rounds, the device, and where to write the rows as JSON."""
from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable

import torch
from tabulate import tabulate

import device as dev
from corpus_models import CORPUS


def parser(doc: str, rounds: int, no_compile_help: str) -> argparse.ArgumentParser:
    """The shared options; a benchmark adds its own before parsing."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    dev.add_arguments(p)
    p.set_defaults(threads=1)  # tiny models on a shared CPU: one thread measures the model, not the load
    p.add_argument("--models", default="ResNet,MobileNetV2,BERT,ViT", help=f"any of {','.join(e.name for e in CORPUS)}")
    p.add_argument("--size", choices=["tiny", "real"], default="tiny")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--no-compile", action="store_true", help=no_compile_help)
    p.add_argument("--json", help="also write the rows to this file")
    return p


def run(args, bench_model: Callable, title: str, settings: str = "") -> list[dict]:
    """`bench_model(name, args, device, dtype)` for each model; print the rows as a table (and write the JSON)."""
    device, dtype = dev.from_args(args)
    warnings.filterwarnings("ignore")
    rows = [r for name in args.models.split(",") for r in bench_model(name, args, device, dtype)]
    print(f"{title}, {dev.describe(device, dtype)}, size {args.size}, batch {args.batch}, {settings}"
          f"median of {args.rounds}, torch {torch.__version__}")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=1)
    return rows
