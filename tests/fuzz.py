"""Fuzzing: random networks through fxopt's whole default pipeline, compared with eager in float64.

    python -m tests.fuzz --count 1000 --workers 2          # a CI run: the base seed is printed
    python -m tests.fuzz --seed 1234 --count 1 --show      # replay one network (its code and the failure)

Network `i` of a run with base seed `S` is built from seed `S + i` alone, so a failure prints the
command that replays it. Each network is a small program over a pool of 4-D values (batch, channels,
5, 5): conv / conv-transpose / linear (on the last axis) / BatchNorm (module or functional; train or
eval mode; `momentum=None`, `affine=False`, `track_running_stats=False`), the ReLU family and other
activations (module or functional, sometimes `inplace=True`; one a custom autograd Function with its own
backward, which capture records as an op: fxopt.capture.autograd_functions), dropout, add / mul / cat, views and
reshapes whose result is used later, zero-width pads, modules called at two sites, values with several
users, in-place writes (`add_`, `mul_`) after the ops that would be checkpointed, several outputs,
values nobody reads (dead code) and a flatten-linear head. In training some parameters are frozen,
some BatchNorms are in eval mode, and the pipeline runs with or without a memory budget and
`differentiable_outputs`.

Everything is compared through the public API only (`fxopt.optimize`, the result's behaviour, the
report's `to_dict()`), so the fuzzer keeps working whatever the capture underneath is:
- the optimized model's outputs, every gradient (parameters and input) and every buffer equal
  eager's in float64 (a quarter of the inference networks in float32, to 1e-4: oneDNN's prepacked
  convolutions take no float64) (same RNG seed, so dropout draws the same masks), and in training a step leaves
  the global RNG where eager's leaves it (a recompute must replay, not draw again);
- the caller's model is untouched: its state, and no `.grad` on its parameters;
- in training, a second `optimize()` of the result computes the same again.

A network eager itself rejects (an in-place write on a tensor autograd saved) is regenerated
from the next draw of the same seed; it is not a finding.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import sys
import time
import traceback
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.program_net import ProgramNet

SIZE = 5  # spatial size; every layer keeps it (kernel 3 / padding 1, or kernel 1)
BATCH = 4
TOLERANCE = 1e-7  # float64: folding reorders a few products, anything larger is a bug
# A quarter of the inference networks run in float32, where prepack_conv_weights runs oneDNN's convolution (it takes
# no float64): float32's rounding of the same reordered products, relative to the outputs' size
FLOAT32_SHARE, FLOAT32_TOLERANCE = 0.25, 1e-4

class HalfSlopeTanh(torch.autograd.Function):
    """tanh, keeping its output, whose own backward gives half tanh's derivative (a gradient eager's autograd of
    the forward would not give)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y) * 0.5


FUNCTION_SHARE = 0.1  # of the activations: HalfSlopeTanh instead


ACTIVATIONS = {  # name -> (module factory taking inplace, functional form or None)
    "relu": (lambda ip: nn.ReLU(inplace=ip), F.relu),
    "relu6": (lambda ip: nn.ReLU6(inplace=ip), F.relu6),
    "leaky_relu": (lambda ip: nn.LeakyReLU(0.1, inplace=ip), lambda x: F.leaky_relu(x, 0.1)),
    "elu": (lambda ip: nn.ELU(inplace=ip), F.elu),
    "hardtanh": (lambda ip: nn.Hardtanh(-1.0, 1.0, inplace=ip), F.hardtanh),
    "hardswish": (lambda ip: nn.Hardswish(inplace=ip), F.hardswish),
    "silu": (lambda ip: nn.SiLU(inplace=ip), F.silu),
    "gelu": (lambda ip: nn.GELU(), F.gelu),
    "sigmoid": (lambda ip: nn.Sigmoid(), torch.sigmoid),
    "tanh": (lambda ip: nn.Tanh(), torch.tanh),
}
VIEWS = {  # shape-preserving views and reshapes of a (N, C, S, S) value, and a zero-width pad (a copy)
    "transpose": lambda x: x.transpose(2, 3),
    "zero_pad": lambda x: F.pad(x, (0, 0, 0, 0)),
    "flatten_unflatten": lambda x: x.flatten(2).unflatten(2, (SIZE, SIZE)),
    "reshape": lambda x: x.reshape(x.shape[0], -1).reshape(x.shape),
    "permute": lambda x: x.permute(0, 2, 3, 1).permute(0, 3, 1, 2),
}


@dataclasses.dataclass(frozen=True)
class Step:
    op: str  # layer, bn_functional, act, act_functional, function, dropout, add, mul, cat, view, inplace, head
    args: tuple[int, ...]  # indices of the values it reads
    module: str = ""  # key in Net.layers
    detail: str = ""  # activation / view / in-place op name


class Net(ProgramNet):
    """Runs `program` (tests/program_net.py); the steps are those of `Step.op`."""

    def apply(self, step: Step, a: list):
        layer = self.layers[step.module] if step.module else None
        if step.op in ("layer", "act", "dropout"):
            return layer(a[0])
        if step.op == "head":
            return layer(a[0].flatten(1))
        if step.op == "bn_functional":
            return F.batch_norm(a[0], layer.running_mean, layer.running_var, layer.weight, layer.bias,
                                layer.training or not layer.track_running_stats, 0.1, layer.eps)
        if step.op == "act_functional":
            return ACTIVATIONS[step.detail][1](a[0])
        if step.op == "function":
            return HalfSlopeTanh.apply(a[0])
        if step.op == "add":
            return a[0] + a[1]
        if step.op == "mul":
            return a[0] * a[1]
        if step.op == "cat":
            return torch.cat(a, dim=1)
        if step.op == "view":
            return VIEWS[step.detail](a[0])
        if step.op == "inplace":
            return a[0].add_(0.5) if step.detail == "add_" else a[0].mul_(0.5)
        raise ValueError(step.op)

    def code(self) -> str:
        """The program as readable lines, for a failure report."""
        lines = [f"  {k}: {m}" for k, m in self.layers.items()]
        for i, s in enumerate(self.program, 1):
            lines.append(f"  v{i} = {s.op}{'[' + s.detail + ']' if s.detail else ''}"
                         f"({', '.join(f'v{j}' for j in s.args)}){' via ' + s.module if s.module else ''}")
        lines.append(f"  return {', '.join(f'v{i}' for i in self.outputs)}")
        return "\n".join(lines)


@dataclasses.dataclass
class Case:
    """One generated network with how to optimize it."""

    seed: int
    mode: str  # inference / training
    net: Net
    inputs: tuple
    options: dict
    reoptimize: bool

    def describe(self) -> str:
        return f"seed {self.seed}: {self.mode}, options {self.options}\n{self.net.code()}"


class Builder:
    """Grows a program step by step, tracking each value's channel count and whether it is a view."""

    def __init__(self, rng: random.Random, training: bool, functions: random.Random):
        self.rng, self.training = rng, training
        self.functions = functions  # its own stream: what else a seed draws is as it was before it
        self.channels = [3]
        self.layers: dict[str, nn.Module] = {}
        self.steps: list[Step] = []
        self.heads: list[int] = []
        self.eval_bns: list[str] = []

    def pick(self) -> int:
        """A value to read: recent ones more often (deeper chains), any one sometimes (several users)."""
        n = len(self.channels)
        return n - 1 if self.rng.random() < 0.5 else self.rng.randrange(n)

    def new(self, key: str, module: nn.Module) -> str:
        name = f"{key}{len(self.layers)}"
        self.layers[name] = module
        return name

    def reuse(self, kind: type, in_size: int, **attrs) -> str | None:
        """An existing module of this kind reading `in_size` (a second call site), sometimes."""
        fits = [k for k, m in self.layers.items() if type(m) is kind and _in_size(m) == in_size
                and all(getattr(m, a, None) == v for a, v in attrs.items())]
        return self.rng.choice(fits) if fits and self.rng.random() < 0.3 else None

    def push(self, step: Step, channels: int) -> int:
        self.steps.append(step)
        self.channels.append(channels)
        return len(self.channels) - 1

    def add_layer(self, src: int) -> int:
        c, rng = self.channels[src], self.rng
        kind = rng.choice([nn.Conv2d, nn.Conv2d, nn.ConvTranspose2d, nn.Linear])
        name = self.reuse(kind, SIZE if kind is nn.Linear else c)
        if name is None:
            if kind is nn.Linear:
                name = self.new("linear", nn.Linear(SIZE, SIZE, bias=rng.random() < 0.7))
            else:
                out = rng.choice([2, 4, 6])
                groups = rng.choice([g for g in (1, 2) if c % g == 0 and out % g == 0])
                k = rng.choice([1, 3])
                name = self.new("conv", kind(c, out, k, padding=k // 2, groups=groups, bias=rng.random() < 0.6))
        idx = self.push(Step("layer", (src,), name), getattr(self.layers[name], "out_channels", c))
        if rng.random() < 0.7:  # mostly a BatchNorm right after: fold_conv_bn's sites
            idx = self.add_bn(idx)
        return idx

    def add_bn(self, src: int) -> int:
        c, rng = self.channels[src], self.rng
        name = self.reuse(nn.BatchNorm2d, c)
        if name is None:
            bn = nn.BatchNorm2d(c, momentum=rng.choice([0.1, 0.3, None]), affine=rng.random() < 0.8,
                                track_running_stats=rng.random() < 0.85)
            with torch.no_grad():
                if bn.track_running_stats:
                    bn.running_mean.normal_()
                    bn.running_var.uniform_(0.5, 2.0)
                if bn.affine:
                    bn.weight.normal_()
                    bn.bias.normal_()
            name = self.new("bn", bn)
            if rng.random() < 0.4:
                self.eval_bns.append(name)  # eval BNs inside a training model
        functional = self.layers[name].track_running_stats and rng.random() < 0.3
        return self.push(Step("bn_functional" if functional else "layer", (src,), name), c)

    def add_activation(self, src: int) -> int:
        act = self.rng.choice(list(ACTIVATIONS))
        if self.rng.random() < 0.3:
            made = self.push(Step("act_functional", (src,), detail=act), self.channels[src])
        else:
            inplace = self.rng.random() < 0.4
            module = ACTIVATIONS[act][0](inplace)
            name = self.reuse(type(module), -1, inplace=getattr(module, "inplace", None)) or self.new(act, module)
            made = self.push(Step("act", (src,), name, act), self.channels[src])
        if self.functions.random() < FUNCTION_SHARE:
            self.steps[-1] = Step("function", (src,))
        return made

    def add_dropout(self, src: int) -> int:
        name = self.reuse(nn.Dropout, -1) or self.new("dropout", nn.Dropout(0.3, inplace=self.rng.random() < 0.3))
        return self.push(Step("dropout", (src,), name), self.channels[src])

    def add_binary(self, src: int, op: str) -> int:
        c = self.channels[src]
        partners = [i for i, ch in enumerate(self.channels) if op == "cat" or ch == c]
        other = self.rng.choice(partners)
        return self.push(Step(op, (src, other)), c + self.channels[other] if op == "cat" else c)

    def add_head(self, src: int) -> None:
        c = self.channels[src]
        name = self.new("head", nn.Linear(c * SIZE * SIZE, 3))
        self.heads.append(self.push(Step("head", (src,), name), -1))

    def grow(self) -> None:
        rng = self.rng
        for _ in range(rng.randint(2, 9)):
            src = self.pick()
            while self.channels[src] < 0:  # heads are 2-D: outputs only
                src = self.pick()
            op = rng.choice(["layer", "layer", "layer", "bn", "act", "act", "act", "dropout", "add", "mul",
                             "cat", "view", "inplace", "head"])
            if op == "layer":
                self.add_layer(src)
            elif op == "bn":
                self.add_bn(src)
            elif op == "act":
                self.add_activation(src)
            elif op == "dropout":
                self.add_dropout(src)
            elif op in ("add", "mul", "cat"):
                self.add_binary(src, op)
            elif op == "view":
                self.push(Step("view", (src,), detail=rng.choice(list(VIEWS))), self.channels[src])
            elif op == "inplace" and src > 0:  # never the graph input
                self.push(Step("inplace", (src,), detail=rng.choice(["add_", "mul_"])), self.channels[src])
            elif op == "head":
                self.add_head(src)

    def outputs(self) -> tuple[int, ...]:
        """The values nobody reads (sometimes one left out: dead code), plus up to two read ones (several users)."""
        read = {i for s in self.steps for i in s.args}
        sinks = [i for i in range(1, len(self.channels)) if i not in read]
        if len(sinks) > 1 and self.rng.random() < 0.4:
            sinks.remove(self.rng.choice(sinks))
        extra = self.rng.sample(range(1, len(self.channels)), k=min(self.rng.randint(0, 2), len(self.channels) - 1))
        return tuple(dict.fromkeys([*sinks, *extra]))


def _in_size(m: nn.Module) -> int:
    for attr in ("in_features", "in_channels", "num_features"):
        if hasattr(m, attr):
            return getattr(m, attr)
    return -1


def generate(seed: int, attempt: int = 0) -> Case:
    """The network of `seed` (and `attempt`, when eager rejected the earlier draws)."""
    rng = random.Random(seed * 1000 + attempt)
    torch.manual_seed(seed * 1000 + attempt)
    training = rng.random() < 0.5
    b = Builder(rng, training, random.Random(f"functions {seed * 1000 + attempt}"))
    b.grow()
    if len(b.steps) == 0:
        b.add_layer(0)
    net = Net(b.layers, b.steps, b.outputs()).double().train(training)
    for name in b.eval_bns:
        net.layers[name].eval()
    options = {} if training else {"channels_last": "always"}  # tiny nets gain nothing from it: fuzz the rewrite
    inputs = (torch.randn(BATCH, 3, SIZE, SIZE, dtype=torch.float64, requires_grad=training and rng.random() < 0.3),)
    if training:
        for p in net.parameters():
            if rng.random() < 0.2:
                p.requires_grad_(False)  # frozen parameters
        if rng.random() < 0.5:
            options["memory_budget"] = rng.choice([0.3, 0.5, 0.8])
        if len(net.outputs) > 1 and rng.random() < 0.4:
            options["differentiable_outputs"] = sorted(rng.sample(range(len(net.outputs)), k=len(net.outputs) - 1))
    reoptimize = training and rng.random() < 0.25
    if not training and random.Random(f"dtype {seed * 1000 + attempt}").random() < FLOAT32_SHARE:
        net, inputs = net.float(), tuple(x.float() for x in inputs)  # drawn apart: the float64 draws stay as they were
    return Case(seed, "training" if training else "inference", net, inputs, options, reoptimize)


# ---------------------------------------------------------------------------------------------- check

@dataclasses.dataclass
class Outcome:
    seed: int
    status: str  # ok, mismatch, crash, known (a bug listed in KNOWN)
    detail: str = ""
    stats: dict = dataclasses.field(default_factory=dict)  # pass -> {stat: count}
    seconds: float = 0.0


def eager_accepts(case: Case) -> bool:
    from fxopt.pipeline.verify import run_step
    try:
        run_step(case.net, case.inputs, case.mode == "training", case.options.get("differentiable_outputs"))
    except RuntimeError:
        return False
    return True


def valid_case(seed: int) -> Case:
    for attempt in range(20):
        case = generate(seed, attempt)
        if eager_accepts(case):
            return case
    raise RuntimeError(f"seed {seed}: eager rejected 20 draws")


def check(case: Case, passes: list[str] | None = None) -> Outcome:
    """Optimize `case` (default pipeline, or `passes`) and compare with eager; never raises."""
    import fxopt
    from fxopt.pipeline.verify import max_difference, run_step

    training = case.mode == "training"
    differentiable = case.options.get("differentiable_outputs")
    before = {k: v.clone() for k, v in case.net.state_dict().items()}
    start = time.perf_counter()
    stage = "optimize"
    try:
        given = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in case.inputs)
        optimized = fxopt.optimize(case.net, given, mode=case.mode, passes=passes, **options_for(case, passes))
        stats = {p["name"]: p["stats"] for p in optimized.fxopt_report.to_dict()["passes"]}
        stage = "caller's model"
        wrote_inputs = not all(torch.equal(a, b) for a, b in zip(given, case.inputs))  # reported if all else holds
        leftover = [n for n, p in case.net.named_parameters() if p.grad is not None]
        if leftover:
            return Outcome(case.seed, "mismatch", f"optimize() left .grad on the caller's parameters: {leftover}")
        changed = [k for k, v in case.net.state_dict().items() if not torch.equal(v, before[k])]
        if changed:
            return Outcome(case.seed, "mismatch", f"optimize() changed the caller's state: {changed}")
        candidates = [("optimized", optimized)]
        if case.reoptimize:
            stage = "re-optimize"
            candidates.append(("re-optimized", fxopt.optimize(optimized, given, mode=case.mode, passes=passes,
                                                              **options_for(case, passes))))
            leftover = [n for n, p in case.net.named_parameters() if p.grad is not None]
            if leftover:
                return Outcome(case.seed, "mismatch", f"re-optimize() left .grad on the parameters: {leftover}")
        reference = run_step(case.net, case.inputs, training, differentiable).tensors
        for label, model in candidates:
            stage = f"run {label}"
            got = run_step(model, case.inputs, training, differentiable).tensors
            tolerance = FLOAT32_TOLERANCE if case.inputs[0].dtype == torch.float32 else TOLERANCE
            worst, name, ok = max_difference(reference, got, tolerance, tolerance)
            if not ok:
                return Outcome(case.seed, "mismatch", f"{label}: {name} differs by {worst:.3g}", stats)
            if training and not torch.equal(next_random(model, case), next_random(case.net, case)):
                return Outcome(case.seed, "mismatch", f"{label}: a step draws from the RNG differently", stats)
    except Exception as e:  # noqa: BLE001 - a crash is a finding, reported with its seed
        lines = traceback.format_exception(e)
        return Outcome(case.seed, "crash", f"{stage}: {type(e).__name__}: {str(e)[:300]}\n{''.join(lines[-6:])}")
    if wrote_inputs:
        return Outcome(case.seed, "mismatch", "optimize() wrote into the caller's example inputs", stats)
    return Outcome(case.seed, "ok", stats=stats, seconds=time.perf_counter() - start)


def next_random(model: torch.nn.Module, case: Case) -> torch.Tensor:
    """What the global RNG gives after one training step (forward + backward) of a copy of `model`."""
    from fxopt.pipeline.verify import differentiated_outputs
    model = copy.deepcopy(model)
    inputs = copy.deepcopy(case.inputs)  # a model may write its input in place: the case's inputs stay as generated
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        outputs = differentiated_outputs(model(*inputs), case.options.get("differentiable_outputs"))
        loss = sum(o.sum() for o in outputs if o.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
        return torch.rand(8)


def options_for(case: Case, passes: list[str] | None) -> dict:
    """The case's pass options that the selected passes take."""
    from fxopt.pipeline.pipelines import DEFAULT_PIPELINES
    from fxopt.passes import PASSES
    names = DEFAULT_PIPELINES[case.mode] if passes is None else passes
    taken = {opt for n in names for opt in PASSES[n]().options}
    return {k: v for k, v in case.options.items() if k in taken}


def blame(case: Case, outcome: Outcome) -> str:
    """"capture" if the failure stays without any pass, else the pass whose removal from the pipeline makes it go
    away ("" if none alone does)."""
    from fxopt.pipeline.pipelines import DEFAULT_PIPELINES, ONLY_WITH_OPTION
    if check(case, []).status != "ok":
        return "capture"
    pipeline = [p for p in DEFAULT_PIPELINES[case.mode] if ONLY_WITH_OPTION.get(p, "") in ("", *case.options)]
    for name in pipeline:
        if check(case, [p for p in pipeline if p != name]).status == "ok":
            return name
    return ""


# Bugs already known, each with where it is tracked: (pass blamed, "capture", or None for any; text in the failure;
# what it is).
# A finding that matches is reported as known and does not fail the run; delete an entry once its fix
# is merged (the matching xfail test in tests/test_fuzz_findings.py then fails as XPASS, as a reminder).
KNOWN: tuple[tuple[str | None, str, str], ...] = ()


def known_issue(pass_name: str, detail: str) -> str:
    """What KNOWN says about a finding blamed on `pass_name` ("" for no single pass; None in KNOWN: any)."""
    return next((what for blamed, text, what in KNOWN if blamed in (None, pass_name) and text in detail), "")


def run_seed(seed: int) -> Outcome:
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        case = valid_case(seed)
    except Exception as e:  # noqa: BLE001
        return Outcome(seed, "crash", f"generator: {e}")
    outcome = check(case)
    if outcome.status != "ok":
        culprit = blame(case, outcome)
        outcome.detail = f"[pass: {culprit or 'not one pass alone'}] {outcome.detail}"
        known = known_issue(culprit, outcome.detail)
        if known:
            outcome.status, outcome.detail = "known", f"{known}; {outcome.detail.splitlines()[0]}"
    outcome.seconds = time.perf_counter() - start
    return outcome


# ------------------------------------------------------------------------------------------------ CLI

def fuzz(base_seed: int, count: int, workers: int, progress=print) -> list[Outcome]:
    seeds = range(base_seed, base_seed + count)
    if workers <= 1:
        return [run_seed(s) for s in seeds]
    import multiprocessing
    with multiprocessing.get_context("forkserver").Pool(workers) as pool:
        outcomes = []
        for i, outcome in enumerate(pool.imap_unordered(run_seed, seeds, chunksize=4), 1):
            outcomes.append(outcome)
            if i % 100 == 0:
                progress(f"  {i}/{count} networks", flush=True)
        return sorted(outcomes, key=lambda o: o.seed)


def summarize(outcomes: list[Outcome]) -> tuple[Counter, Counter]:
    status = Counter(o.status for o in outcomes)
    stats: Counter = Counter()
    for o in outcomes:
        for pass_name, counts in o.stats.items():
            for key, n in counts.items():
                stats[f"{pass_name}.{key}"] += n
    return status, stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="base seed (default: from the clock, printed)")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--show", action="store_true", help="print each network's program")
    args = parser.parse_args(argv)
    base = args.seed if args.seed is not None else int(time.time()) % 1_000_000 * 1000
    print(f"fxopt fuzz: base seed {base}, {args.count} networks, {args.workers} worker(s); "
          f"replay one with: python -m tests.fuzz --seed SEED --count 1 --show", flush=True)
    start = time.perf_counter()
    if args.show:
        for s in range(base, base + args.count):
            print(valid_case(s).describe())
    outcomes = fuzz(base, args.count, args.workers)
    elapsed = time.perf_counter() - start
    status, stats = summarize(outcomes)
    modes = Counter(generate(o.seed).mode for o in outcomes) if args.count <= 50 else None
    for o in outcomes:
        if o.status != "ok":
            print(f"\n{o.status.upper()} seed {o.seed}: {o.detail}\n  replay: python -m tests.fuzz --seed {o.seed} --count 1 --show")
    print(f"\n{len(outcomes)} networks in {elapsed:.0f} s ({elapsed / max(len(outcomes), 1):.2f} s each): "
          f"{status['ok']} ok, {status['mismatch']} mismatches, {status['crash']} crashes, "
          f"{status['known']} known bugs (listed in tests/fuzz.py KNOWN)"
          + (f"; modes {dict(modes)}" if modes else ""))
    print("what the passes did: " + ", ".join(f"{k} {v}" for k, v in sorted(stats.items())))
    return 0 if status["ok"] + status["known"] == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
