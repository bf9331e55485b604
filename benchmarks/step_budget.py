"""memory_budget across graph breaks: the graphs of one training step share it (fxopt/frontends/step_memory.py).

    python benchmarks/step_budget.py                  # BERT and GPT-2, each split by graph breaks before two layers
    python benchmarks/step_budget.py --models bert --budgets 0.5,half
    python benchmarks/step_budget.py --lowering aot_eager   # through AOTAutograd (fxopt.backend(inner=...))

Each model (default config, SDPA attention, 4 layers 256 wide) gets a graph break before layers 1 and 3 (as a print or
a data-dependent branch in user code would), so one step runs several graphs, one of them twice. Per budget (a
fraction, or `half`: a size budget of half eager's measured step), eager and fxopt train from the same seeds with
`labels=` and `attention_mask=` at three lengths (losses compared), then two steps at the measured length (the first
at a length plans its size class, and under a size budget the step may be shared again after it), then the allocator's
peak of one step at that length against eager's: the ratio, the graphs compiled, and whether any plan was made again
for its share of the step. `--lowering eager` is `fxopt.optimize`'s default path; `aot_eager` and `inductor` compile
with `torch.compile(model, backend=fxopt.backend(inner=..., memory_budget=...))`, whose partitioner may round
differently from eager (the losses' largest difference is shown).
"""
from __future__ import annotations

import argparse
import copy
import warnings

import os
import sys

import torch
from tabulate import tabulate

import fxopt
from fxopt import _torch_private
from fxopt.measure import measure_allocator_peak
from user_loop import _batch, _bert, _gpt2, train_side_by_side

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "corpus"))
from corpus_models import BreakBefore  # noqa: E402


def _split(name: str):
    torch.manual_seed(0)
    model = (_bert(classify=True) if name == "bert" else _gpt2()).train()
    layers = model.bert.encoder.layer if name == "bert" else model.transformer.h
    for i in (1, 3):
        layers[i] = BreakBefore(layers[i])
    return model


def _optimized(model, budget, lowering: str):
    """`model` optimized under `budget` on `lowering`, and where its reports are."""
    if lowering == "eager":
        fast = fxopt.optimize(model, memory_budget=budget)
        return fast, lambda: fast.fxopt_reports
    backend = fxopt.backend(inner=lowering, memory_budget=budget)
    return torch.compile(model, backend=backend), lambda: backend.reports


def run(name: str, budget_text: str, length: int, batch: int, lowering: str) -> list:
    _torch_private.reset_dynamo()  # no compiled code, sizes known dynamic or recompiles counted from an earlier run
    model = _split(name)
    reference = copy.deepcopy(model)
    vocab = 30522 if name == "bert" else 50257
    ids, mask = _batch(length, batch, vocab=vocab, seed=99)
    labels = torch.randint(0, 2, (batch,)) if name == "bert" else ids

    def loss_of(m):
        return lambda i: m(i, attention_mask=mask, labels=labels).loss

    eager = measure_allocator_peak(reference, (ids,), forward=loss_of(reference))
    budget = f"{eager // 2}B" if budget_text == "half" else float(budget_text)
    fast, reports = _optimized(model, budget, lowering)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = train_side_by_side(reference, model, fast, [37, 52, 64], batch, vocab, classify=name == "bert")
        worst = max(abs(a - b) for a, b in losses)
        for _ in range(2):
            loss_of(fast)(ids).backward()
        model.zero_grad()
        peak = measure_allocator_peak(model, (ids,), forward=loss_of(fast))
    shared = any(r.step_budget for r in reports())
    return [name, budget_text if budget_text != "half" else f"'{budget}' (half)",
            "equal" if worst == 0 else f"{worst:.1e}",
            f"{eager / 2**20:.1f}", f"{peak / 2**20:.1f}", f"{peak / eager:.3f}", len(reports()),
            "yes" if shared else "no"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--budgets", default="0.5,half")
    parser.add_argument("--length", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lowering", choices=("eager", "aot_eager", "inductor"), default="eager")
    args = parser.parse_args()
    rows = [run(name, budget, args.length, args.batch, args.lowering)
            for name in args.models.split(",") for budget in args.budgets.split(",")]
    print(f"lowering: {args.lowering}")
    print(tabulate(rows, headers=["model", "memory_budget", "losses vs eager's",
                                  f"eager peak MiB ({args.batch} x {args.length})", "fxopt peak MiB", "ratio",
                                  "graphs", "step shared again"]))


if __name__ == "__main__":
    main()
