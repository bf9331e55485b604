"""fxopt.optimize in the loop users write: keyword arguments, a new padded length every batch, default configs.

    python benchmarks/user_loop.py                      # all three parts
    python benchmarks/user_loop.py --part inference     # BERT (4 layers) with attention_mask=, a new length per batch
    python benchmarks/user_loop.py --part training      # BertForSequenceClassification and GPT2LMHeadModel with labels=
    python benchmarks/user_loop.py --part training --size default   # the same at the configs' own sizes
    python benchmarks/user_loop.py --part overhead      # per-call cost where the guards hold, and of an unoptimizable call
    python benchmarks/user_loop.py --part recompile     # a new length's first call, in fresh interpreters

inference: eager, `fxopt.optimize(model, example_kwargs=...)` and `torch.compile(model, backend="eager")` (Dynamo
alone) take the same batches, round-robin, one call each per round, a length drawn anew per round from a fixed
list; the table gives each one's median call time after the first pass over the lengths, its speed against
eager, its outputs' largest difference from eager's, and the time of each variant's first call at a length it
has not seen (the compiles). Torch runs on one thread (`--threads`), so other load on the machine hits all alike.

training: each model, default config (SDPA attention, `use_cache=True` for GPT-2; 4 layers 256 wide, or with
`--size default` the configs' own 12 layers 768 wide), dropout on, trained with
`labels=` and `attention_mask=` at a length that changes every step, eager and fxopt (`memory_budget=0.5`)
from the same seeds: losses per step, and the allocator's peak of one step at a length the result never saw.

recompile: the first call at a second length (Dynamo's recompile, which makes the length dynamic) of BERT (4 layers,
batch 8) after a first compile at 37, timed in a fresh interpreter per variant and pair (fxopt, then Dynamo alone),
so neither inherits the other's warm caches (in one process the variant that compiles second runs faster).

overhead: a 2-layer MLP at batch 1 (the call is mostly the per-call cost): eager, fxopt and Dynamo alone; a
forward whose first line breaks the graph (a linear layer after it is captured: Dynamo's cost of a graph break);
a forward disabled for Dynamo (it captures nothing: the calls fxopt cannot optimize); and BERT (4 layers, batch
8 x 64) past Dynamo's recompile limit (an int attribute its forward reads changes every call), where every call
runs as the model's own code: fxopt against eager, the fixed per-call cost against a real model's call.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torch.nn as nn
import transformers
from tabulate import tabulate

import fxopt
from fxopt.measure import measure_allocator_peak

LENGTHS = (37, 52, 64, 71, 88, 96, 109, 128)


SMALL = {"bert": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
         "gpt2": dict(n_layer=4, n_embd=256, n_head=4)}  # --size small; --size default: the configs' own sizes


def _bert(layers: int = 4, classify: bool = False, size: str = "small"):
    sizes = {**SMALL["bert"], "num_hidden_layers": layers} if size == "small" else {}
    cls = transformers.BertForSequenceClassification if classify else transformers.BertModel
    return cls(transformers.BertConfig(**sizes))


def _gpt2(size: str = "small"):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**(SMALL["gpt2"] if size == "small" else {})))


def _batch(length: int, batch: int = 8, vocab: int = 30522, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 1000 + length)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[: batch // 2, length - length // 4:] = 0  # padded rows, as a collator pads
    return ids, mask


def _time(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def inference(rounds: int) -> None:
    model = _bert().eval()
    ids, mask = _batch(LENGTHS[0])
    variants = {
        "eager": model,
        "fxopt.optimize": fxopt.optimize(model, (ids,), example_kwargs={"attention_mask": mask}),
        "torch.compile(backend='eager')": torch.compile(copy.deepcopy(model), backend="eager"),
    }
    first_calls = {name: [] for name in variants}
    times = {name: [] for name in variants}
    worst = {name: 0.0 for name in variants}
    with torch.no_grad():
        for r in range(len(LENGTHS) + rounds):
            length = LENGTHS[r % len(LENGTHS)] if r < len(LENGTHS) else LENGTHS[(r * 5) % len(LENGTHS)]
            ids, mask = _batch(length, seed=r)
            reference = None
            for name, fn in variants.items():
                seconds, out = _time(lambda: fn(ids, attention_mask=mask))
                hidden = out.last_hidden_state
                if reference is None:
                    reference = hidden
                worst[name] = max(worst[name], (hidden - reference).abs().max().item())
                (first_calls if r < len(LENGTHS) else times)[name].append(seconds)
    eager = statistics.median(times["eager"])
    rows = [[name, f"{statistics.median(t) * 1e3:.2f}", f"{eager / statistics.median(t):.2f}x",
             f"{worst[name]:.1e}", " ".join(f"{s:.2f}" for s in first_calls[name])] for name, t in times.items()]
    print(f"BERT {4} layers, batch 8, lengths {LENGTHS}, {rounds} timed rounds, {torch.get_num_threads()} thread(s)")
    print(tabulate(rows, headers=["variant", "median ms", "vs eager", "max |diff|", "first call per new length (s)"]))
    graphs = variants["fxopt.optimize"].fxopt_reports
    print(f"fxopt compiled {len(graphs)} graph(s); dynamic sizes of the last: {graphs[-1].dynamic_sizes}")


def train_side_by_side(reference: nn.Module, model: nn.Module, fast, lengths: list[int], batch: int, vocab: int,
                       classify: bool) -> list[list[float]]:
    """One step per length of `reference` (eager) and `fast` (fxopt's result for `model`) from the same seeds, with
    `labels=` (two classes, or the ids for a language model) and `attention_mask=`: each step's two losses."""
    losses = []
    for step, length in enumerate(lengths):
        ids, mask = _batch(length, batch, vocab=vocab, seed=step)
        labels = torch.randint(0, 2, (ids.shape[0],)) if classify else ids
        pair = []
        for m in (reference, fast):
            torch.manual_seed(step)
            loss = m(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            pair.append(loss.item())
        model.zero_grad(), reference.zero_grad()
        losses.append(pair)
    return losses


def training(steps: int, size: str = "small", batch: int = 8, unseen: int = 100, models=("bert", "gpt2")) -> None:
    rows = []
    for name, build, vocab in (("BertForSequenceClassification", lambda: _bert(classify=True, size=size), 30522),
                               ("GPT2LMHeadModel", lambda: _gpt2(size), 50257)):
        if ("bert" if "Bert" in name else "gpt2") not in models:
            continue
        torch.manual_seed(0)
        model = build().train()
        reference = copy.deepcopy(model)
        fast = fxopt.optimize(model, memory_budget=0.5)
        losses = train_side_by_side(reference, model, fast, [LENGTHS[s % len(LENGTHS)] for s in range(steps)],
                                    batch, vocab, classify="Bert" in name)
        equal = all(a == b for a, b in losses)
        ids, mask = _batch(unseen, batch, vocab=vocab, seed=99)  # a length neither has seen
        labels = torch.randint(0, 2, (ids.shape[0],)) if "Bert" in name else ids

        def loss_of(m):
            return lambda i: m(i, attention_mask=mask, labels=labels).loss

        eager_peak = measure_allocator_peak(reference, (ids,), forward=loss_of(reference))
        fxopt_peak = measure_allocator_peak(model, (ids,), forward=loss_of(fast))
        plans = [len(r["checkpoint_activations"].figures.get("regions", [])) for r in fast.fxopt_reports
                 if any(p.name == "checkpoint_activations" for p in r.passes)]
        rows.append([name, steps, "yes" if equal else f"no: {losses}", f"{eager_peak / 2**20:.1f}",
                     f"{fxopt_peak / 2**20:.1f}", f"{fxopt_peak / eager_peak:.4f}", len(fast.fxopt_reports),
                     " ".join(map(str, plans))])
    print(tabulate(rows, headers=["model", "steps", "losses equal eager's", f"eager peak MiB ({batch} x {unseen})",
                                  "fxopt peak MiB", "ratio", "graphs", "regions per plan"]))


def overhead(calls: int) -> None:
    mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(1, 16)

    class Unoptimizable(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 4)

        def forward(self, x):
            torch._dynamo.graph_break()
            return self.lin(x)

    class Uncapturable(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 4)

        @torch._dynamo.disable
        def forward(self, x):
            return self.lin(x)

    breaking, uncapturable = Unoptimizable().eval(), Uncapturable().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fxopt's one warning: nothing captured
        cases = {"MLP, guards hold": (mlp, {"fxopt": fxopt.optimize(mlp, x),
                                           "Dynamo alone": torch.compile(copy.deepcopy(mlp), backend="eager")}),
                 "graph break at the first line": (breaking, {"fxopt": fxopt.optimize(breaking, x)}),
                 "Dynamo captures nothing": (uncapturable, {"fxopt": fxopt.optimize(uncapturable, x)})}
    rows = []
    with torch.no_grad():
        for case, (model, variants) in cases.items():
            fns = {"eager": model, **variants}
            samples = {name: [] for name in fns}
            for _ in range(calls):
                for name, fn in fns.items():
                    samples[name].append(_time(lambda: fn(x))[0])
            eager = statistics.median(samples["eager"])
            for name, s in samples.items():
                rows.append([case, name, f"{statistics.median(s) * 1e6:.1f}", f"{statistics.median(s) / eager:.2f}x"])
    rows += _past_recompile_limit(max(calls // 20, 20))
    print(tabulate(rows, headers=["case", "variant", "median µs per call", "vs eager"]))


class _ScaledBert(nn.Module):
    """BERT's last hidden state times an int attribute: Dynamo guards on its value, so a new value compiles anew."""

    def __init__(self):
        super().__init__()
        self.bert = _bert().eval()
        self.scale = 1

    def forward(self, ids, attention_mask):
        return self.bert(ids, attention_mask=attention_mask).last_hidden_state * self.scale


def _past_recompile_limit(calls: int) -> list:
    """Per-call time of BERT once every call is past the recompile limit (a scale never seen before), fxopt and
    eager interleaved."""

    model = _ScaledBert().eval()
    ids, mask = _batch(64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fxopt's one warning: the recompile limit
        fast = fxopt.optimize(model, (ids,), example_kwargs={"attention_mask": mask})
        scale = 2
        while not fast.__dict__.get("_warned_recompile_limit") and scale < 64:  # compile up to the limit
            fast.scale = scale
            fast(ids, attention_mask=mask)
            scale += 1
        samples = {"eager": [], "fxopt": []}
        for _ in range(calls):
            scale += 1
            model.scale = scale
            samples["eager"].append(_time(lambda: model(ids, attention_mask=mask))[0])
            fast.scale = scale
            samples["fxopt"].append(_time(lambda: fast(ids, attention_mask=mask))[0])
    eager = statistics.median(samples["eager"])
    return [["BERT past the recompile limit", name, f"{statistics.median(s) * 1e6:.1f}",
             f"{statistics.median(s) / eager:.3f}x"] for name, s in samples.items()]


def _recompile_child(variant: str) -> None:
    """In a fresh interpreter: a first compile at length 37, then the time of the first call at 52, printed."""
    model = _bert().eval()
    ids, mask = _batch(LENGTHS[0])
    with torch.no_grad():
        if variant == "fxopt":
            fast = fxopt.optimize(model, (ids,), example_kwargs={"attention_mask": mask})
        else:
            fast = torch.compile(model, backend="eager")
            fast(ids, attention_mask=mask)
        ids, mask = _batch(LENGTHS[1])
        seconds, _ = _time(lambda: fast(ids, attention_mask=mask))
    print(seconds)


def recompile(pairs: int) -> None:
    import subprocess
    import sys

    times = {"fxopt.optimize": [], "torch.compile(backend='eager')": []}
    for _ in range(pairs):
        for name, variant in zip(times, ("fxopt", "dynamo")):
            done = subprocess.run([sys.executable, __file__, "--recompile-child", variant], capture_output=True,
                                  text=True, check=True)
            times[name].append(float(done.stdout.strip().splitlines()[-1]))
    ratios = [a / b for a, b in zip(*times.values())]
    rows = [[name, " ".join(f"{t:.2f}" for t in ts), f"{statistics.median(ts):.2f}"] for name, ts in times.items()]
    print(f"BERT 4 layers, batch 8: first call at length {LENGTHS[1]} after a compile at {LENGTHS[0]}, "
          f"{pairs} fresh-interpreter pairs")
    print(tabulate(rows, headers=["variant", "seconds per pair", "median"]))
    print(f"fxopt / Dynamo per pair: {' '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("inference", "training", "overhead", "recompile", "all"), default="all")
    parser.add_argument("--pairs", type=int, default=5, help="recompile: fresh-interpreter pairs")
    parser.add_argument("--recompile-child", choices=("fxopt", "dynamo"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", choices=("small", "default"), default="small",
                        help="training: 4 layers 256 wide, or the configs' own sizes (BERT-base, GPT-2 small)")
    parser.add_argument("--batch", type=int, default=8, help="training: sequences per step")
    parser.add_argument("--unseen-length", type=int, default=100, help="training: the length the peak is measured at")
    parser.add_argument("--models", default="bert,gpt2", help="training: bert, gpt2 or both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.recompile_child:
        _recompile_child(args.recompile_child)
        return
    if args.part in ("inference", "all"):
        inference(args.rounds)
    if args.part in ("training", "all"):
        training(args.steps, args.size, args.batch, args.unseen_length, args.models.split(","))
    if args.part in ("overhead", "all"):
        overhead(2000)
    if args.part in ("recompile", "all"):
        recompile(args.pairs)


if __name__ == "__main__":
    main()
