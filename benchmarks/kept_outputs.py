"""One checkpoint plan, two ways of keeping its selective regions' matmul outputs.

A selective region keeps the outputs of its matrix products (and convolutions) itself where it can
(`fxopt.passes._kept_outputs`: an autograd Function per kept op), else through torch's selective checkpoint
policy, whose Python dispatch mode sees every op of the region's forward and recomputation. Per model
(checkpoint_vs_peers.py's Hugging Face models and sizes): `fxopt.optimize(..., memory_budget=b)`'s plan as it is
("kept by region"), and a copy of the same plan whose regions keep the same outputs through torch's policy ("SAC
policy"); each round times one training step of eager and of both (interleaved, thread CPU time with one torch
thread, as checkpoint_vs_peers.py). Printed: each variant's peak and step over eager's (median of per-round ratios),
and the median of per-round differences between the two plans' steps, with the lowest and highest in brackets.
--steady-heap as in checkpoint_vs_peers.py.

    python benchmarks/kept_outputs.py [--models vit,gpt2] [--budget 0.5] [--rounds 15] [--steady-heap]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import warnings

import torch

import fxopt
from checkpoint_vs_peers import LastHiddenState, _peak, _timed, add_common_arguments, prepare, print_tables
from fxopt.passes._checkpoint_region import CheckpointedRegion, _save_counted_ops
from fxopt.passes._kept_outputs import product_once

HEADERS = ["model", "variant", "selective regions", "peak", "step", "SAC policy - kept by region, ms"]


def under_torch_policy(graph_module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `graph_module` whose regions keep their products' outputs through torch's selective checkpoint
    policy: each `product_once` call made the op it stands for again, the region given the policy."""
    twin = copy.deepcopy(graph_module)
    for region in twin.modules():
        if not isinstance(region, CheckpointedRegion):
            continue
        graph = region.body.graph
        calls = [n for n in graph.nodes if n.op == "call_function" and n.target is product_once]
        for call in calls:
            target, args, kwargs = call.args[4]  # the op as the graph wrote it (product_once's `original`)
            with graph.inserting_before(call):
                op = graph.call_function(target, args, kwargs)
            op.meta.update(call.meta)
            call.replace_all_uses_with(op)
            graph.erase_node(call)
        if calls:
            region.policy = _save_counted_ops
            region.body.recompile()
    return twin


def run_model(factory, x, budget: float, rounds: int) -> list[list]:
    torch.manual_seed(0)
    base = LastHiddenState(factory()).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unmet budget's warning: the table shows the plan taken
        optimized = fxopt.optimize(base, (x,), mode="training", memory_budget=budget)
    ours = optimized.graph_module
    variants = {"eager": base, "kept by region": ours, "SAC policy": under_torch_policy(ours)}
    eager_peak = _peak(base, base, x)
    times = {k: [] for k in variants}
    for round_ in range(rounds + 1):  # the first round warms up
        for key, module in variants.items():
            seconds = _timed(module, module, x)
            if round_:
                times[key].append(seconds)
    diff = [(a - b) * 1e3 for a, b in zip(times["SAC policy"], times["kept by region"])]
    difference = f"{statistics.median(diff):.1f} [{min(diff):.1f}, {max(diff):.1f}]"
    rows = []
    for key, module in variants.items():
        regions = [m for m in module.modules() if isinstance(m, CheckpointedRegion)]
        ratio = statistics.median(t / e for t, e in zip(times[key], times["eager"]))
        rows.append([key, f"{sum(r.kind != 'whole' for r in regions)} of {len(regions)}" if regions else "-",
                     f"{_peak(module, module, x) / eager_peak:.3f}x", f"{ratio:.3f}x",
                     difference if key == "SAC policy" else ""])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, "bert,gpt2,vit,convnext_t", rounds=15)
    parser.add_argument("--budget", type=float, default=0.5)
    args = parser.parse_args()
    models = prepare(args)

    def rows_of(name: str) -> list[list]:
        factory, x, _blocks = models[name]
        return [[name, *row] for row in run_model(factory, x, args.budget, args.rounds)]

    print_tables(args.models.split(","), rows_of, HEADERS)


if __name__ == "__main__":
    main()
