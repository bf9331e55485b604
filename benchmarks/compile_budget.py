"""memory_budget under torch.compile: fxopt's planner beside Inductor's activation_memory_budget.

Per model (a deep MLP, a small CNN with train-mode BatchNorm, a small Hugging Face BERT built
from a config with random weights, wrapped to return `last_hidden_state`) and per budget in
1.0 / 0.5 / 0.25 / 0.1, one training step of:

  fxopt      torch.compile(model, backend=fxopt.backend(inner=INNER, passes=[], memory_budget=b)):
             fxopt's planner tags what the min-cut partitioner recomputes (fxopt.frontends.backend_memory)
  inductor   the same hand-off with torch's `activation_memory_budget=b` and the min-cut partitioner
             as it is (no fxopt tags): INNER "aot_eager" partitions exactly as Inductor does, without
             code generation (fast); "inductor" compiles with Inductor (20-30 s per compile on 2 cores)

saved = bytes autograd keeps for backward after the forward (`fxopt.measure.measure_saved_bytes`,
saved_tensors_hooks, each storage once, parameters excluded); peak = the allocator's live bytes
during one step (`fxopt.measure.measure_allocator_peak`, after a warm-up step). Both as ratios of
the same variant at budget 1.0. Deterministic on CPU (no timing).

    python benchmarks/compile_budget.py [--inner aot_eager|inductor] [--models mlp,cnn,bert]
"""
from __future__ import annotations

import argparse
import copy
import warnings

import torch
from tabulate import tabulate

import fxopt
from checkpoint_vs_peers import LastHiddenState
from fxopt import _torch_private
from fxopt.measure import measure_allocator_peak, measure_saved_bytes

BUDGETS = (1.0, 0.5, 0.25, 0.1)


def _mlp():
    blocks = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.GELU())
              for _ in range(8)]
    return torch.nn.Sequential(*blocks), torch.randn(256, 256)


def _cnn():
    layers, cin = [], 3
    for cout in (16, 16, 32, 32, 64):
        layers += [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout), torch.nn.ReLU()]
        cin = cout
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(64, 10)), torch.randn(8, 3, 32, 32)


def _bert():
    import transformers as hf

    config = hf.BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=256,
                           attn_implementation="eager")
    return LastHiddenState(hf.BertModel(config)), torch.randint(0, 1000, (4, 64))


MODELS = {"mlp": _mlp, "cnn": _cnn, "bert": _bert}


def _inductor_budget_backend(inner: str, budget: float):
    """The min-cut partitioner with torch's own activation_memory_budget, through the same hand-off."""
    def backend(gm, example_inputs):
        with _torch_private.activation_memory_budget(budget):
            if inner == "aot_eager":
                return _torch_private.aot_eager_compile(gm, example_inputs)
            return _torch_private.inductor_compile(gm, example_inputs)
    return backend


def _measure(model: torch.nn.Module, x: torch.Tensor, backend) -> tuple[int, int]:
    """(saved bytes, allocator peak) of one compiled training step; compiles before measuring."""
    _torch_private.reset_dynamo()
    model = copy.deepcopy(model).train()
    compiled = torch.compile(model, backend=backend)
    compiled(x).sum().backward()  # compile (the partitioner runs here), outside every measurement
    saved = measure_saved_bytes(lambda: compiled(x), model)
    peak = measure_allocator_peak(model, (x,), forward=compiled)
    return saved, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", choices=("aot_eager", "inductor"), default="aot_eager")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name in args.models.split(","):
        model, x = MODELS[name]()
        figures = {}
        for budget in BUDGETS:
            fx_backend = fxopt.backend(inner=args.inner, passes=[], memory_budget=budget)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                figures["fxopt", budget] = _measure(model, x, fx_backend)
                figures["inductor", budget] = _measure(model, x, _inductor_budget_backend(args.inner, budget))
            outcome = fx_backend.reports[0]["checkpoint_activations"].figures if fx_backend.reports else {}
            figures["plan", budget] = outcome.get("plan", "?")
        for budget in BUDGETS:
            row = [name, budget]
            for variant in ("fxopt", "inductor"):
                saved, peak = figures[variant, budget]
                base_saved, base_peak = figures[variant, 1.0]
                row += [f"{saved / base_saved:.2f}x ({saved / 1e6:.2f} MB)", f"{peak / base_peak:.2f}x"]
            rows.append(row + [figures["plan", budget]])
    print(f"inner compiler: {args.inner}; ratios of the same variant at budget 1.0")
    print(tabulate(rows, headers=["model", "budget", "fxopt saved", "fxopt peak", "inductor AMB saved",
                                  "inductor AMB peak", "fxopt plan taken"]))


if __name__ == "__main__":
    main()
