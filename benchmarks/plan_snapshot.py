"""A deterministic snapshot of every checkpointing plan fxopt makes on benchmark models, to check that a refactor
gives byte-identical plans.

Per model (checkpoint_vs_peers.py's, wrapped and seeded as there: LastHiddenState, train mode, one torch thread):

  hf_gc_fraction   the library's own checkpointing of every layer (every_n_layers=1): its allocator peak over
                   eager's, rounded to 4 decimals (null where the model does not support it)
  eager            per budget (0.5, and hf_gc_fraction where there is one): what the `checkpoint_activations` pass
                   planned -- its figures (regions, peak estimates, budget, recomputed FLOPs, headline) and its
                   sites (action, node, reason, detail) -- for each graph fxopt compiled. Recomputation is priced
                   by FLOPs (step_profile forced to timed=False), since measured op times vary run to run.
  compile          per Dynamo graph of a training call, `plan_candidates`' candidates: name, cost and
                   tags as sorted [position, policy, region id] (plan_candidates takes no budget)

    python benchmarks/plan_snapshot.py [--models bert,gpt2] [--out plans.json]
    python benchmarks/plan_snapshot.py --compare plans_before.json plans_after.json   # exits 1 on differences
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch

import fxopt
from checkpoint_vs_peers import LastHiddenState, _hf_checkpointing, _loss_step, _models, _peak
from fxopt.passes import PASSES

from fxopt.checkpointing.candidates import plan_candidates

MODELS = "bert,gpt2,vit,convnext_t,resnet50,mobilenet_v2"
FIGURES = ("regions", "peak_estimate_before", "peak_estimate_after", "budget_bytes", "budget_met",
           "recomputed_flops", "headline")


def price_by_flops() -> None:
    """Make the checkpoint_activations pass call `step_profile` with timed=False, wherever the pass's module is."""
    module = sys.modules[PASSES["checkpoint_activations"].__module__]
    original = module.step_profile
    module.step_profile = lambda gm, *args, timed=False, **kwargs: original(gm, *args, timed=False, **kwargs)


def eager_plans(base: torch.nn.Module, x: torch.Tensor, budget: float) -> list[dict]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "NOT met" is recorded as budget_met and headline
        opt = fxopt.optimize(base, (x,), mode="training", passes=["checkpoint_activations"], memory_budget=budget)
    plans = []
    for report in opt.fxopt_reports:
        p = report["checkpoint_activations"]
        plans.append({"skipped": p.skipped, **{k: p.figures.get(k) for k in FIGURES},
                      "sites": [[s.action, s.node, s.reason, s.detail] for s in p.sites]})
    return plans


def compile_plans(base: torch.nn.Module, x: torch.Tensor) -> list[list[dict]]:
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    _loss_step(torch.compile(base, backend=recorder), x)
    torch._dynamo.reset()
    return [[{"name": c.plan.name, "cost": c.plan.recompute_cost,
              "tags": sorted([p, policy.name, region] for p, (policy, region) in c.tags.items())}
             for c in plan_candidates(gm, inputs)] for gm, inputs in graphs]


def snapshot(name: str, factory, x: torch.Tensor) -> dict:
    torch.manual_seed(0)
    base = LastHiddenState(factory()).train()
    fraction = None
    if getattr(base.model, "supports_gradient_checkpointing", False):
        eager_peak = _peak(base, base, x)
        hf = _hf_checkpointing(base, every_n_layers=1)
        fraction = round(_peak(hf, hf, x) / eager_peak, 4)
    budgets = [0.5] + ([fraction] if fraction is not None else [])
    return {"hf_gc_fraction": fraction,
            "eager": {str(b): eager_plans(base, x, b) for b in budgets},
            "compile": compile_plans(base, x)}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    differences = 0
    for model in sorted(a.keys() | b.keys()):
        ma, mb = a.get(model, {}), b.get(model, {})
        keys = [("hf_gc_fraction",), ("compile",)] + [("eager", k) for k in sorted(
            ma.get("eager", {}).keys() | mb.get("eager", {}).keys())]
        for key in keys:
            va, vb = ma, mb
            for k in key:
                va, vb = (va or {}).get(k), (vb or {}).get(k)
            if va != vb:
                differences += 1
                print(f"{model} {'/'.join(key)}:\n  {a_path}: {json.dumps(va)}\n  {b_path}: {json.dumps(vb)}")
    print(f"{differences} difference(s)")
    return 1 if differences else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--out", default="-", help="JSON file (default: stdout)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    torch.set_num_threads(1)
    price_by_flops()
    torch.manual_seed(0)  # _models() draws the example inputs
    models = _models()
    result = {}
    for name in args.models.split(","):
        factory, x, _ = models[name]
        print(f"{name}...", file=sys.stderr, flush=True)
        result[name] = snapshot(name, factory, x)
    text = json.dumps(result, sort_keys=True, indent=1) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
