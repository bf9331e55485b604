"""The memory model on Hugging Face models as users run them: default attention (SDPA) and dropout on.

Per model (checkpoint_vs_peers.py's BERT, GPT-2, ViT, Llama and BART, random weights, `last_hidden_state`, loss =
mean of its square), one training step: fxopt's estimate of eager's step peak (checkpoint_activations' figure
`peak_estimate_captured`: the graph as captured, before any pass) beside the allocator's
(`fxopt.measure.measure_allocator_peak`, parameter gradients existing before the step), then the plan at each
budget: its predicted peak (`peak_estimate_after`) beside the measured one, and the measured peak over eager's. The
plan runs after tied_embedding_grads (BART's tied embedding: one dense gradient in flight instead of two), as in
fxopt's training pipeline. A plan's prediction that rests on a guessed op is flagged (`unmeasured_ops`). Peaks are
deterministic on CPU; each model plans in tens of seconds on 2 cores.

    python benchmarks/memory_models.py [--models bert,gpt2,vit,llama,bart] [--budgets 0.5]
"""
from __future__ import annotations

import argparse
import warnings

import torch
from tabulate import tabulate

import fxopt
from checkpoint_vs_peers import LastHiddenState, _models
from fxopt.measure import measure_allocator_peak

MODELS = ("bert", "gpt2", "vit", "llama", "bart")


def _peak(module, x) -> int:
    return measure_allocator_peak(module, (x,), forward=lambda x: (module(x).float() ** 2).mean())


def run(repeats: int = 1, device=torch.device("cpu"), dtype=torch.float32, models=MODELS,
        budgets=(0.5,)) -> list[dict]:
    """One row per model and budget (module docstring); `repeats` unused: peaks do not vary."""
    factories, rows = _models(), []
    for name in models:
        factory, x, _ = factories[name]
        torch.manual_seed(0)
        model = LastHiddenState(factory()).to(device, dtype).train()
        x = x.to(device)
        eager = _peak(model, x)
        for budget in budgets:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt = fxopt.optimize(model, (x,), mode="training",
                                     passes=["tied_embedding_grads", "checkpoint_activations"], memory_budget=budget)
            figures = opt.fxopt_report["checkpoint_activations"].figures
            measured = _peak(opt, x)
            rows.append({"model": name, "eager MB": eager / 1e6,
                         "estimate / eager": figures["peak_estimate_captured"] / eager, "budget": budget,
                         "plan MB": measured / 1e6, "predicted / measured": figures["peak_estimate_after"] / measured,
                         "measured / eager": measured / eager, "regions": len(figures["regions"]),
                         "met": figures["budget_met"], "guessed ops": len(figures.get("unmeasured_ops", [])),
                         "warning": next((str(w.message)[:80] for w in caught if "NOT met" in str(w.message)), "")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default="0.5")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(models=args.models.split(","), budgets=tuple(float(b) for b in args.budgets.split(",")))
    print(tabulate(rows, headers="keys", floatfmt=".3f"))


if __name__ == "__main__":
    main()
