"""One checkpoint plan, two ways of keeping its selective regions' matmul outputs.

A selective region keeps the outputs of its matrix products (and convolutions) itself where it can
(`fxopt.checkpointing._kept_outputs_run`: an autograd Function per kept op), else through torch's selective checkpoint
policy, whose Python dispatch mode sees every op of the region's forward and recomputation. Per model
(checkpoint_vs_peers.py's Hugging Face models and sizes): `fxopt.optimize(..., memory_budget=b)`'s plan as it is
("kept by region"), and a copy of the same plan whose regions keep the same outputs through torch's policy ("SAC
policy"); each round times one training step of eager and of both (interleaved, thread CPU time with one torch
thread, as checkpoint_vs_peers.py). Printed: each variant's peak and step over eager's (median of per-round ratios),
and the median of per-round differences between the two plans' steps, with the lowest and highest in brackets.
--block: instead of the model, its first block alone (on the hidden states the model hands it), all of it one
selective region: the mechanism's own cost, which a whole step's noise (several percent a round on a shared
machine) hides. --steady-heap as in checkpoint_vs_peers.py.

    python benchmarks/kept_outputs.py [--models vit,gpt2] [--budget 0.5] [--rounds 15] [--block] [--steady-heap]
"""
from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import warnings

import torch

import fxopt
from checkpoint_vs_peers import LastHiddenState, _peak, _timed, add_common_arguments, prepare, print_tables
from fxopt.checkpointing.profile import step_profile
from fxopt.graph_functions import import_by_name
from fxopt.checkpointing.eager_region import CheckpointedRegion, _save_counted_ops, extract_region
from fxopt.checkpointing._kept_outputs_run import product_once

_PRODUCT_ONCE = inspect.signature(product_once)

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
            target, args, kwargs = _PRODUCT_ONCE.bind(*call.args, **call.kwargs).arguments["original"]  # as written
            with graph.inserting_before(call):
                op = graph.call_function(import_by_name(target) if isinstance(target, str) else target, args, kwargs)
            op.meta.update(call.meta)
            call.replace_all_uses_with(op)
            graph.erase_node(call)
        if calls:
            region.policy = _save_counted_ops
            region.body.recompile()
    return twin


class _Block(torch.nn.Module):
    """A block called as its model calls it (`kwargs`: the other arguments it was given), returning its first
    output."""

    def __init__(self, block: torch.nn.Module, kwargs: dict):
        super().__init__()
        self.block, self.kwargs = block, kwargs

    def forward(self, hidden):
        out = self.block(hidden, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


def first_block_in_one_region(model: torch.nn.Module, x, blocks_path: str) -> tuple:
    """(the model's first block as its model calls it, the hidden states it gets, that block captured with all of
    it one selective region)."""
    block, seen = model.get_submodule(f"model.{blocks_path}")[0], {}
    hook = block.register_forward_pre_hook(lambda m, args, kwargs: seen.update(args=args, kwargs=kwargs),
                                           with_kwargs=True)
    with torch.no_grad():
        model(x)
    hook.remove()
    wrapped, hidden = _Block(block, seen["kwargs"]), seen["args"][0].detach().requires_grad_()
    graph_module = fxopt.optimize(wrapped, (hidden,), mode="training", passes=[]).graph_module
    profile = step_profile(graph_module)
    nodes = [step.node for step in profile.steps]
    extract_region(graph_module, nodes, "checkpointed_block", save_compute_intensive=True,
                   compute_intensive=[step.node for step in profile.steps if step.compute_intensive])
    graph_module.recompile()
    return wrapped, hidden, graph_module


def run_model(factory, x, blocks_path: str, budget: float, rounds: int, block: bool) -> list[list]:
    torch.manual_seed(0)
    base = LastHiddenState(factory()).train()
    if block:
        base, x, ours = first_block_in_one_region(base, x, blocks_path)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unmet budget's warning: the table shows the plan taken
            ours = fxopt.optimize(base, (x,), mode="training", memory_budget=budget).graph_module
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
    parser.add_argument("--block", action="store_true", help="the first block alone, one region (module docstring)")
    args = parser.parse_args()
    models = prepare(args)

    def rows_of(name: str) -> list[list]:
        factory, x, blocks_path = models[name]
        return [[name, *row] for row in run_model(factory, x, blocks_path, args.budget, args.rounds, args.block)]

    print_tables(args.models.split(","), rows_of, HEADERS)


if __name__ == "__main__":
    main()
