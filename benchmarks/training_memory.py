"""Training-memory benchmarks of every memory pass, side by side, in one process.

Each pass keeps its scenarios in benchmarks/memory_<pass>.py, exposing `run(repeats) -> rows`
(dicts with the same keys per file); `models` (benchmarks/memory_models.py) is the memory model on Hugging Face
BERT, GPT-2, ViT, Llama and BART as users run them (SDPA, dropout on): estimate against the allocator, and
checkpoint_activations' plan at budget 0.5. This script runs the ones asked for and prints one table each. Peak
bytes come from fxopt.measure (deterministic on CPU); times are medians of `--repeats` runs.

    python benchmarks/training_memory.py                 # every pass, and the models
    python benchmarks/training_memory.py inplace_relu    # one pass
    python benchmarks/training_memory.py models          # the Hugging Face models (slow: minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

from tabulate import tabulate

PASSES = ("inplace_relu", "checkpoint_activations", "prune_dead_grads", "models")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("passes", nargs="*", metavar="PASS", help=f"any of {', '.join(PASSES)} (default: all)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median is shown)")
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import device as dev
    dev.add_arguments(parser)
    args = parser.parse_args()
    device, dtype = dev.from_args(args)
    unknown = sorted(set(args.passes) - set(PASSES))
    if unknown:
        parser.error(f"unknown pass {unknown[0]!r}; choose from {', '.join(PASSES)}")
    for name in args.passes or PASSES:
        rows = importlib.import_module(f"memory_{name}").run(args.repeats, device=device, dtype=dtype)
        print(f"\n== {name} ==")
        print(tabulate(rows, headers="keys", floatfmt=".3g"))


if __name__ == "__main__":
    main()
