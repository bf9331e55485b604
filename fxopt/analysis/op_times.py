"""Seconds each node's forward takes, measured by running the graph on real tensors: what recomputing it costs.

`node_seconds(gm)` runs `gm` a few times node by node on real tensors shaped like the
placeholders' `node.meta["val"]` (floating inputs random, integer and bool inputs zero, so that
every index is valid), under `torch.no_grad()` -- as a checkpointed region recomputes, the same
kernels -- and returns {node name: the fastest of its runs} (the first run pays one-time costs; the
fastest drops it), and the fastest of whatever else `also` asks to time beside a node, by its own key
(fxopt.checkpointing._replay_times: replaying a dropout or a BatchNorm from what a region keeps). With one torch thread
it times the thread's CPU time (`step_clock`): wall time on a loaded machine counted other
processes' work (HF BERT's nodes summed to 2.5x its real forward). FLOPs (fxopt.analysis.flops)
price a layer norm, a softmax or a dropout at nothing; on a real model those memory-bound ops
are a large part of what recomputation costs, which only a clock sees.

`graph_seconds(graphs)` times whole graphs against each other the same way: what a rewrite whose gain depends on
the machine (fxopt.passes.channels_last) is kept by.

It leaves no trace: parameters are only read, buffers (BatchNorm statistics) and the RNG are
put back (`fxopt.state_preservation`), and the caller's tensors are never inputs.
A graph that cannot run on such inputs has no timing: None (callers fall back to FLOPs).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from .. import _torch_private
from ..model_copy import constants_as_attributes
from ..node_runner import NodeRunner
from ..state_preservation import preserved_state
from .costs import placeholder_values

# what else to time beside a node: (node, the values computed so far) -> (key, thunk) pairs
AlsoTimed = Callable[[fx.Node, dict], Iterable[tuple[str, Callable[[], object]]]]

ROUNDS = 3  # the fastest of three runs per node: the first warms up; of two more, the less disturbed (HF MobileNetV2
# at budget 0.5: plans measured 1.07-1.14x eager step against 1.09-1.23x with two runs, 9 plans each, 11 rounds)


def real_like(value):
    """A real tensor shaped like a (fake) example value; non-tensors pass through."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = [int(s) for s in value.shape]
    if value.is_floating_point() or value.is_complex():
        return torch.randn(shape, dtype=value.dtype, device=value.device)
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


def step_clock():
    """The clock to time CPU work by: the calling thread's CPU time when torch runs one thread (all the
    work is on this thread, and other processes' load on a shared machine does not count), else wall time."""
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    return time.thread_time if torch.get_num_threads() == 1 and not on_gpu else time.perf_counter


def synchronize() -> None:
    """Wait for the GPU's queued work where torch has started CUDA, so that a host clock times the work, not its
    launch."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed_into(seconds: dict[str, float], also: AlsoTimed | None):
    """A NodeRunner hook keeping in `seconds` the fastest time of each node and of what `also` adds beside it."""
    clock = step_clock()

    def keep(key: str, elapsed: float) -> None:
        seconds[key] = min(seconds.get(key, elapsed), elapsed)

    def hook(node: fx.Node, env: dict):
        start = clock()
        yield
        synchronize()
        keep(node.name, clock() - start)
        for key, run in (also(node, env) if also is not None else ()):
            start = clock()
            run()
            synchronize()
            keep(key, clock() - start)
    return hook


def node_seconds(gm: fx.GraphModule, also: AlsoTimed | None = None) -> dict[str, float] | None:
    """Forward seconds of every call node of `gm` on real tensors, and of what `also` adds (see module docstring),
    or None."""
    examples = placeholder_values(gm)
    try:
        with preserved_state(gm, parameters=False), torch.no_grad():
            inputs = [real_like(v) for v in examples]
            runs = [dict() for _ in range(ROUNDS)]
            for seconds in runs:
                NodeRunner(gm, [_timed_into(seconds, also)]).run(*inputs)
    except Exception:  # noqa: BLE001 - data-dependent code or inputs zeros cannot stand for: no timing
        return None
    return {name: min(r[name] for r in runs) for name in runs[-1]}


GRAPH_ROUNDS, GRAPH_SECONDS = 5, 1.0  # graph_seconds: at most this many rounds, none begun after this many seconds


def _frozen(gm: fx.GraphModule, inputs: list, frozen: frozenset[str]) -> tuple[Callable, list]:
    """`gm` as the eager path's freezing runs it: the placeholders named in `frozen` made attributes holding their
    `inputs`, what depends on them alone computed once; and the inputs left to give it."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    positions = [i for i, name in enumerate(names) if name in frozen]
    attributes = constants_as_attributes(gm, positions, inputs)
    runtime = [x for name, x in zip(names, inputs) if name not in frozen]
    return _torch_private.fold_constant_subgraphs(attributes) or attributes, runtime


def graph_seconds(graphs: list[fx.GraphModule], frozen: frozenset[str] = frozenset()) -> list[float] | None:
    """The fastest forward of each graph (same placeholders, as a rewrite leaves them) under `torch.no_grad()` on
    the same real inputs, the graphs taking turns: at least two rounds (the first pays one-time costs, such as
    oneDNN's kernels for a new layout; the fastest drops it), at most GRAPH_ROUNDS, none begun after GRAPH_SECONDS.
    `frozen`: placeholders (parameters) whose subgraphs each graph computes once before its timed runs, as the eager
    path's freezing will. None where the graphs cannot run on such inputs."""
    clock = step_clock()
    try:
        with preserved_state(graphs[0], parameters=False), torch.no_grad():
            inputs = [real_like(v) for v in placeholder_values(graphs[0])]
            runs = [_frozen(gm, inputs, frozen) if frozen else (gm, inputs) for gm in graphs]
            best, start = [float("inf")] * len(graphs), time.perf_counter()
            for r in range(GRAPH_ROUNDS):
                if r >= 2 and time.perf_counter() - start > GRAPH_SECONDS:
                    break
                for k, (run, args) in enumerate(runs):
                    began = clock()
                    run(*args)
                    synchronize()
                    best[k] = min(best[k], clock() - began)
    except Exception:  # noqa: BLE001 - data-dependent code or inputs zeros cannot stand for: no timing
        return None
    return best
