"""checkpoint_activations' predicted recompute time against the step time it costs, on real models.

Per model (checkpoint_vs_peers.py's Hugging Face models and sizes) and memory budget: the plan
`fxopt.optimize(..., memory_budget=b)` takes, its regions (whole / selective), its predicted recompute
(the report's `predicted_recompute_s`: measured op times plus the calibrated overhead of each region),
and what it costs: each round times one training step of eager and of every plan (interleaved, thread
CPU time with one torch thread, as checkpoint_vs_peers.py); a plan's cost in a round is its step less
eager's; the median over rounds, with the lowest and highest in brackets, and its ratio to the prediction.
A ratio above 1 is time the planner does not see, and so cannot trade against memory. --steady-heap as in
checkpoint_vs_peers.py (no page faults from malloc: the clock then counts compute alone).

    python benchmarks/plan_prediction.py [--models vit,bert] [--budgets 0.5,0.25] [--rounds 11] [--steady-heap]
"""
from __future__ import annotations

import argparse
import statistics
import warnings

import torch

import fxopt
from checkpoint_vs_peers import LastHiddenState, _timed, add_common_arguments, prepare, print_tables

HEADERS = ["model", "budget", "regions", "predicted ms", "measured ms", "measured / predicted"]


def run_model(factory, x, budgets: list[float], rounds: int) -> list[list]:
    """Per budget: the plan's region counts, predicted and measured recompute (module docstring)."""
    torch.manual_seed(0)
    base = LastHiddenState(factory()).train()
    plans = {}
    for budget in budgets:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unmet budget's warning: the table shows the plan taken
            optimized = fxopt.optimize(base, (x,), mode="training", memory_budget=budget)
        figures = optimized.fxopt_report["checkpoint_activations"].figures
        plans[budget] = (optimized, figures)
    times = {key: [] for key in ["eager", *plans]}
    for round_ in range(rounds + 1):  # the first round warms up
        for key in times:
            module = base if key == "eager" else plans[key][0]
            seconds = _timed(module, module, x)
            if round_:
                times[key].append(seconds)
    rows = []
    for budget, (optimized, figures) in plans.items():
        regions = [site.detail for site in optimized.fxopt_report["checkpoint_activations"].sites
                   if site.action == "checkpointed"]
        selective = sum(", selective" in detail for detail in regions)
        extra = [(t - e) * 1e3 for t, e in zip(times[budget], times["eager"])]
        measured = statistics.median(extra)
        predicted = (figures.get("predicted_recompute_s") or 0) * 1e3
        rows.append([budget, f"{len(regions)} ({selective} selective)", f"{predicted:.1f}",
                     f"{measured:.1f} [{min(extra):.1f}, {max(extra):.1f}]",
                     f"{measured / predicted:.2f}" if predicted else "-"])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, "bert,gpt2,vit", rounds=11)
    parser.add_argument("--budgets", default="0.5")
    args = parser.parse_args()
    models, budgets = prepare(args), [float(b) for b in args.budgets.split(",")]

    def rows_of(name: str) -> list[list]:
        factory, x, _blocks = models[name]
        return [[name, *row] for row in run_model(factory, x, budgets, args.rounds)]

    print_tables(args.models.split(","), rows_of, HEADERS)


if __name__ == "__main__":
    main()
