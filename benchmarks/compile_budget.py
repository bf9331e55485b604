"""memory_budget under torch.compile: fxopt's planner beside Inductor's activation_memory_budget.

Per model (a deep MLP, a small CNN with train-mode BatchNorm, a small Hugging Face BERT built
from a config with random weights, wrapped to return `last_hidden_state`) and per budget in
1.0 / 0.5 / 0.25 / 0.1, one training step of:

  fxopt      torch.compile(model, backend=fxopt.backend(inner=INNER, passes=["checkpoint_activations"],
                                                memory_budget=b)):
             fxopt's planner tags what the min-cut partitioner recomputes (fxopt.pipeline.compile_budget)
  inductor   the same hand-off with torch's `activation_memory_budget=b` and the min-cut partitioner
             as it is (no fxopt tags): INNER "aot_eager" partitions exactly as Inductor does, without
             code generation (fast); "inductor" compiles with Inductor (20-30 s per compile on 2 cores)

saved = bytes autograd keeps for backward after the forward (`fxopt.measure.measure_saved_bytes`,
saved_tensors_hooks, each storage once, parameters excluded). peak = the allocator's live bytes
during one step (`fxopt.measure.measure_allocator_peak`, after a warm-up step), two ways:
  peak       gradients None before the step and the `.grad` tensors it leaves not counted
             (`zero_grad(set_to_none=True)`, torch's default): the peak fxopt's budget bounds
  peak(g)    gradients allocated before the step, so the compiled backward's gradient outputs,
             all alive until that graph returns, count as temporaries (the definition of the
             eager benchmarks, checkpoint_vs_peers.py)
predicted = fxopt's predicted step peak of the partition taken (`fxopt.checkpointing._partition_memory`,
in the report). All as ratios of the same variant at budget 1.0 (deterministic on CPU). step =
the compiled training step's time as a ratio to the eager model's, medians of --rounds rounds
interleaving the two, thread CPU time with one torch thread (the other processes of a shared
machine do not inflate it).

    python benchmarks/compile_budget.py [--inner aot_eager|inductor] [--models mlp,cnn,bert] [--rounds 5]

--hf: Hugging Face BERT / ViT / ResNet-50 at the sizes of checkpoint_vs_peers.py (issue #12: BERT and
ViT 6 layers 384 wide, BERT seq 128 batch 8, ViT and ResNet-50 batch 4; random weights, wrapped to
return `last_hidden_state`), budgets 1.0 and 0.5 (--budgets), fxopt's budget beside torch's
`activation_memory_budget`, each: step peak as a ratio of the same variant at 1.0 and of eager's
step peak (both `zero_grad(set_to_none=True)`), step time as a ratio to eager (as above), and the
first compiled step's wall-clock seconds (compile included; wall time, so load inflates it).

    python benchmarks/compile_budget.py --hf [--models bert,vit,resnet50] [--inner aot_eager] [--rounds 3]
"""
from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from tabulate import tabulate

import fxopt
from checkpoint_vs_peers import _models as hf_models
from corpus_models import LastHiddenState
from device import round_robin_ms
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
                           vocab_size=1000)  # BERT's 30522 words: the 15.6 MB
    # embedding gradient (and, decomposed, its zero-filled temporary) would be most of the step peak
    return LastHiddenState(hf.BertModel(config)), torch.randint(0, 1000, (4, 64))


MODELS = {"mlp": _mlp, "cnn": _cnn, "bert": _bert}
HF_MODELS = ("bert", "vit", "resnet50")


def _inductor_budget_backend(inner: str, budget: float):
    """The min-cut partitioner with torch's own activation_memory_budget, through the same hand-off."""
    def backend(gm, example_inputs):
        with _torch_private.activation_memory_budget(budget):
            if inner == "aot_eager":
                return _torch_private.aot_eager_compile(gm, example_inputs)
            return _torch_private.inductor_compile(gm, example_inputs)
    return backend


def _measure(model: torch.nn.Module, x: torch.Tensor, backend, rounds: int) -> dict[str, float]:
    """Saved bytes, both peaks and the median step time of one compiled training step; compiles before measuring."""
    _torch_private.reset_dynamo()
    model = copy.deepcopy(model).train()
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    compiled(x).sum().backward()  # compile (the partitioner runs here), outside every measurement
    compile_s = time.perf_counter() - start

    eager = copy.deepcopy(model)

    def step(forward, module):
        module.zero_grad(set_to_none=True)
        forward(x).sum().backward()

    times = round_robin_ms({"compiled": lambda: step(compiled, model), "eager": lambda: step(eager, eager)},
                           torch.device("cpu"), rounds, warmup=2)
    return {"saved": measure_saved_bytes(lambda: compiled(x), model),
            "peak": measure_allocator_peak(model, (x,), forward=compiled, gradients_before=False),
            "peak(g)": measure_allocator_peak(model, (x,), forward=compiled),
            "step": times["compiled"] / times["eager"], "compile s": compile_s}


def _hf_table(args) -> None:
    """fxopt's budget vs torch's activation_memory_budget under torch.compile on the issue's HF models."""
    budgets = [float(b) for b in args.budgets.split(",")]
    factories = hf_models()
    for name in args.models.split(","):
        factory, x, _ = factories[name]
        torch.manual_seed(0)
        model = LastHiddenState(factory()).train()
        eager_peak = measure_allocator_peak(model, (x,), gradients_before=False)
        figures, plans = {}, {}
        for budget in budgets:
            fx_backend = fxopt.backend(inner=args.inner, passes=["checkpoint_activations"], memory_budget=budget)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                figures["fxopt", budget] = _measure(model, x, fx_backend, args.rounds)
                figures["AMB", budget] = _measure(model, x, _inductor_budget_backend(args.inner, budget), args.rounds)
            outcome = fx_backend.reports[0]["checkpoint_activations"].figures
            plans[budget] = outcome["plan"] + ("" if outcome["budget_met"] else " (not met)")
        rows = []
        for budget in budgets:
            row = [name, budget]
            for variant in ("fxopt", "AMB"):
                f = figures[variant, budget]
                row += [f"{f['peak'] / figures[variant, budgets[0]]['peak']:.2f}x", f"{f['peak'] / eager_peak:.2f}x",
                        f"{f['step']:.2f}x", f"{f['compile s']:.0f}"]
            rows.append(row + [f"{eager_peak / 1e6:.1f}", plans[budget]])
        print(tabulate(rows, headers=[
            "model", "budget", "fxopt peak/1.0", "peak/eager", "step", "compile s", "AMB peak/1.0", "peak/eager",
            "step", "compile s", "eager peak MB", "fxopt plan taken"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", choices=("aot_eager", "inductor"), default="aot_eager")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hf", action="store_true", help="HF BERT / ViT / ResNet-50 at the issue's sizes")
    parser.add_argument("--budgets", default="1.0,0.5", help="with --hf: budgets, the first the reference")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"inner compiler: {args.inner}; memory: ratios of the same variant at budget 1.0; step: ratio to eager "
          f"(medians of {args.rounds} interleaved rounds of thread CPU time, 1 torch thread)")
    if args.hf:
        if args.models == ",".join(MODELS):
            args.models = ",".join(HF_MODELS)
        _hf_table(args)
        return
    for name in args.models.split(","):
        model, x = MODELS[name]()
        figures = {}
        for budget in BUDGETS:
            fx_backend = fxopt.backend(inner=args.inner, passes=["checkpoint_activations"], memory_budget=budget)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                figures["fxopt", budget] = _measure(model, x, fx_backend, args.rounds)
                figures["inductor", budget] = _measure(model, x, _inductor_budget_backend(args.inner, budget),
                                                       args.rounds)
            outcome = fx_backend.reports[0]["checkpoint_activations"].figures
            figures["fxopt", budget]["predicted"] = outcome["peak_bytes_after"]
            figures["plan", budget] = outcome["plan"] + ("" if outcome["budget_met"] else " (not met)")
        rows = []
        for budget in BUDGETS:
            row = [name, budget]
            for variant, columns in (("fxopt", ("saved", "peak", "predicted", "peak(g)")),
                                     ("inductor", ("saved", "peak", "peak(g)"))):
                row += [f"{figures[variant, budget][c] / figures[variant, 1.0][c]:.2f}x" for c in columns]
                row.append(f"{figures[variant, budget]['step']:.2f}x")
            rows.append(row + [f"{figures['fxopt', 1.0]['peak'] / 1e6:.2f} / {figures['inductor', 1.0]['peak'] / 1e6:.2f}",
                               f"{figures['fxopt', 1.0]['predicted'] / 1e6:.2f}", figures["plan", budget]])
        print(tabulate(rows, headers=["model", "budget", "fxopt saved", "peak", "predicted", "peak(g)", "step",
                                      "AMB saved", "peak", "peak(g)", "step", "peak at 1.0 MB (fxopt/AMB)",
                                      "predicted at 1.0 MB", "fxopt plan taken"]), flush=True)


if __name__ == "__main__":
    main()
