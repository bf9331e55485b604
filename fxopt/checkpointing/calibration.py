"""What a checkpointed region costs beyond its ops, measured on a block of the graph being planned.

`fxopt.checkpointing._region_overhead` times regions over a chain of small ops. On a real model a region costs more
than that beyond its predicted recomputation (docs/checkpointing.md): its BatchNorms, its selective policy over
convolutions, the activations it holds all play a part. `calibrated_overhead(gm, profile, span)` runs the graph's
own steps [span) as a block, on real tensors shaped like the example, plain and as a whole and a selective
CheckpointedRegion (what checkpoint_activations makes), in interleaved rounds; what each kind costs beyond the plain
block and its ops' predicted recomputation is its per-region overhead, never less than the chain's (the per-op part
stays the chain's). The block differentiates its inputs and the trainable parameters it reads, as a training step
does: a kept convolution's backward computes its weight's gradient whenever the weight requires one, so
differentiating the inputs alone would overprice a selective region over a convolution. Nothing of the model
changes: those gradients are returned, not accumulated into `.grad`; buffers and the RNG are put back.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable

import torch
import torch.fx as fx

from .profile import Region, StepProfile
from ..analysis.op_times import real_like, step_clock, synchronize
from ._region_overhead import RegionOverhead
from ..state_preservation import preserved_state
from .eager_region import extract_region, inputs_of_graph, read_outside

ROUNDS = 5
BLOCK_SECONDS = 1.5e-3  # the forward time of the block timed: a model's block, in about 0.1 s for all rounds


def calibration_span(profile: StepProfile, boundaries: list[int], checkpointable: list[bool],
                     allowed: Callable[[Region], bool]) -> Region | None:
    """A block from each region boundary to the first boundary at least three steps on, that every region may hold
    and `allowed` takes as a whole and a selective region: the one whose forward time is nearest BLOCK_SECONDS (None
    if there is none)."""
    firsts = ((a, next((b for b in boundaries if b >= a + 3), None)) for a in boundaries)
    spans = [(a, b) for a, b in firsts if b is not None and all(checkpointable[a:b])
             and allowed(Region(a, b)) and allowed(Region(a, b, save_compute_intensive=True))]
    if not spans:
        return None

    def distance(span: tuple[int, int]) -> float:
        seconds = sum(s.seconds for s in profile.steps[span[0]:span[1]])
        return abs(math.log(max(seconds, 1e-9) / BLOCK_SECONDS))

    return Region(*min(spans, key=distance))


def _block(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple[fx.GraphModule, list]:
    """`nodes` as a GraphModule of their own (on `gm`'s parameters and buffers), with the example values of its
    inputs."""
    graph = fx.Graph()
    env = inputs_of_graph(graph, nodes)
    examples = [a.meta.get("val") for a in env if a.op != "get_attr"]
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n] for n in read_outside(nodes) or nodes[-1:]))
    return fx.GraphModule(gm, graph), examples


def calibrated_overhead(gm: fx.GraphModule, profile: StepProfile, span: Region) -> RegionOverhead | None:
    """The profile's overhead with each kind's per-region part measured on the graph's block `span` (see module
    docstring); None where the block cannot run on such tensors."""
    steps = profile.steps[span.start:span.stop]
    nodes, intensive = [s.node for s in steps], {s.node.name for s in steps if s.compute_intensive}
    variants = {}
    for kind in ("plain", "whole", "selective"):
        block, examples = _block(gm, nodes)
        if kind != "plain":
            calls = [n for n in block.graph.nodes if n.op == "call_function"]  # copies of `nodes`, under their names
            extract_region(block, calls, "region", kind == "selective",
                           compute_intensive=[call for call in calls if call.name in intensive])
            block.recompile()
        variants[kind] = block
    clock, times = step_clock(), {kind: [] for kind in variants}
    try:
        with preserved_state(gm, parameters=False):
            values = [real_like(v) for v in examples]
            leaves = [x.requires_grad_() for x in values if isinstance(x, torch.Tensor) and x.is_floating_point()]
            leaves += [p for p in variants["plain"].parameters() if p.requires_grad]
            for _ in range(ROUNDS + 1):  # the first round warms up
                for kind, block in variants.items():
                    start = clock()  # each run on copies: the block may write its inputs in place
                    inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in values]
                    outputs = [o for o in block(*inputs) if isinstance(o, torch.Tensor) and o.requires_grad]
                    torch.autograd.grad(sum(o.float().sum() for o in outputs), leaves, allow_unused=True)
                    synchronize()
                    times[kind].append(clock() - start)
    except Exception:  # noqa: BLE001 - a block zeros or random values cannot stand for: keep the chain's prices
        return None
    plain, per_region = statistics.median(times["plain"][1:]), {}
    chain = {"whole": profile.overhead.per_region, "selective": profile.overhead.selective_per_region}
    for kind in ("whole", "selective"):
        region = span._replace(save_compute_intensive=kind == "selective")
        recomputed = (profile.region_cost(region) - profile.overhead_ns(region)) / 1e9
        extra = statistics.median(times[kind][1:]) - plain - recomputed
        # never below the chain's figure, a floor (a small block may measure less than its predicted recompute)
        per_region[kind] = max(chain[kind], extra - profile.overhead_per_op(region) * (span.stop - span.start))
    return dataclasses.replace(profile.overhead, per_region=per_region["whole"],
                               selective_per_region=per_region["selective"])
