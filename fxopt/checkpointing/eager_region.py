"""A checkpointed region of a graph: its nodes moved into a GraphModule run under torch.utils.checkpoint.

`extract_region(gm, nodes, name, save_compute_intensive)` moves a contiguous run of call nodes into
`CheckpointedRegion(body)`, registered on `gm` as submodule `name`, and calls it in their place. The region runs under
non-reentrant `torch.utils.checkpoint.checkpoint`, which keeps only the region's inputs (and restores the RNG state
before recomputing, so dropout draws the same mask). Every BatchNorm inside (`aten.batch_norm`, `F.batch_norm`) runs as
`batch_norm_once`, so its running statistics move once per step, as without checkpointing, and checkpoint sees the same
saved tensors on both runs: a train-mode one on a contiguous float CPU input keeps its batch statistics from the
region's first run and its recomputation maps the input with them, bit for bit as ATen did
(fxopt.checkpointing._batch_norm_replay); any other runs as written on the first run and, in train mode, on throwaway
copies of the running statistics when recomputed. With `save_compute_intensive`, a selective checkpoint policy also
keeps the outputs of the ops FlopCounterMode counts (matmuls, convolutions, attention) and recomputes only the rest;
where every op it keeps is a convolution or a matrix product, the region keeps their outputs itself (`convolution_once`
/ `product_once`: fxopt.checkpointing._kept_outputs_run, fxopt.checkpointing._kept_outputs) and its other ops run
without the policy's dispatch mode. A train-mode dropout on CPU runs as `dropout_once`: the mask its first run draws is
kept, and a recomputation rebuilds the noise from it (fxopt.checkpointing._dropout_replay).

The body's modules and tensors are the parent graph's own (not registered a second time), so `state_dict()` keeps the
original keys. Before / after::

    h = aten.linear(x, w1, b1);  n = aten.layer_norm(h, ...);  g = aten.gelu(n);  y = aten.linear(g, w2, b2)
  becomes
    h = aten.linear(x, w1, b1);  checkpointed_norm_to_gelu = self.checkpointed_norm_to_gelu(h);  y = aten.linear(...)
"""
from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .. import _torch_private
from . import _batch_norm_replay as batch_norm_replay
from ._dropout_replay import draw, replay, replayable_dropouts
from ..analysis.flops import is_compute_intensive_op
from ._kept_outputs import ConvolutionCall, ProductCall, outputs_kept_by_region
from ..graph_functions import graph_function, importable_name
from ..op_names import call_arguments
from ._kept_outputs_run import convolution_once, product_once
from ._region_run import RegionRun, recomputed_as_saved


def _save_counted_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_compute_intensive_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


BATCH_NORM_FUNCTIONS = (F.batch_norm, torch.batch_norm, torch.ops.aten.batch_norm.default)


def _statistics_this_run_updates(running_mean, running_var, run: RegionRun) -> tuple:
    """The real running statistics on the first run, throwaway copies of them on a recomputation.

    A recomputation must issue the same aten op on tensors of the same shapes (checkpoint checks that
    it saves the same tensors, and a selective region that it replays the same ops), so it updates
    copies; they are made on the first run, as an op no recomputation has to replay.
    """
    if run.first:
        run.scratch[id(running_mean)] = (running_mean.clone(), running_var.clone())
        return running_mean, running_var
    return run.scratch[id(running_mean)]


def _batch_norm_replaying_statistics(x, weight, bias, running_mean, running_var, momentum, eps, key: str,
                                     run: RegionRun):
    """A train-mode BatchNorm whose recomputation maps `x` with its first run's batch statistics (kept in the run's
    scratch under `key`). The first run is ATen's own, whose node does the backward."""
    if run.first:
        out, mean, invstd = torch.ops.aten.native_batch_norm(x, weight, bias, running_mean, running_var, True,
                                                             momentum, eps)
        run.scratch[key] = batch_norm_replay.KeptStatistics.of(weight, mean, invstd)
        return out
    kept = run.scratch[key]
    return recomputed_as_saved(lambda: batch_norm_replay.replay(x, bias, kept), (x, weight, bias),
                               saved=(x, running_mean, running_var, weight, kept.mean, kept.invstd))  # as ATen's node


@graph_function(name="batch_norm", updates_stats=True)
def batch_norm_once(x, running_mean, running_var, weight, bias, training, momentum, eps, key: str, run: RegionRun):
    """`F.batch_norm` / `aten.batch_norm` in a region (`key`: its node's name), running statistics updated on the
    first run only (module docstring)."""
    if training and batch_norm_replay.replays_statistics(x, weight, bias):
        return _batch_norm_replaying_statistics(x, weight, bias, running_mean, running_var, momentum, eps, key, run)
    if training and running_mean is not None:
        running_mean, running_var = _statistics_this_run_updates(running_mean, running_var, run)
    return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


@graph_function(name="dropout")
def dropout_once(x: torch.Tensor, p: float, key: str, run: RegionRun) -> torch.Tensor:
    """A train-mode CPU dropout in a region (fxopt.checkpointing._dropout_replay): the first run draws the noise as
    ATen does and keeps its mask, a recomputation rebuilds the noise from the mask instead of drawing it."""
    if run.first:
        out, run.scratch[key] = draw(x, p)
        return out
    return replay(x, run.scratch[key], p)


class CheckpointedRegion(torch.nn.Module):
    """Runs `body` under non-reentrant checkpoint, with a selective checkpoint `policy` if given (torch's
    `create_selective_checkpoint_contexts`: the op outputs it saves are kept, the rest recomputed).

    A body that runs BatchNorm, replays dropout or keeps op outputs itself takes a first argument, the
    `RegionRun` saying whether this is the first run (the forward) or a recomputation, so running statistics are
    updated once, dropout noise is drawn once and kept ops run once.
    """

    def __init__(self, body: fx.GraphModule, policy, takes_run: bool):
        super().__init__()
        # Held outside the module tree: its modules and tensors are the parent graph's own, so
        # state_dict() and parameters() list nothing twice.
        self.__dict__["body"] = body
        self.policy = policy
        self.takes_run = takes_run

    def forward(self, *args):
        run = self.body
        if self.takes_run:
            runs, scratch = itertools.count(), {}
            run = lambda *inputs: self.body(RegionRun(next(runs) == 0, scratch), *inputs)  # noqa: E731

        if self.policy is None:
            return checkpoint(run, *args, use_reentrant=False)
        context_fn = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn)

    @property
    def kind(self) -> str:
        """What the region keeps, in words."""
        if self.policy is not None:
            return "selective (matmul/conv/attention outputs kept by torch's selective checkpoint policy)"
        if any(n.target in (convolution_once, product_once) for n in self.body.graph.nodes):
            return "selective (matmul/conv outputs kept by the region)"
        return "whole"

    def extra_repr(self) -> str:
        return f"{self.kind}\n{self.body.code.strip()}"


def functional_batch_norm_args(node: fx.Node) -> dict | None:
    """The arguments by name of an `F.batch_norm` / `torch.batch_norm` / `aten.batch_norm` call, or None."""
    if node.op != "call_function" or node.target not in BATCH_NORM_FUNCTIONS:
        return None
    return call_arguments(node)


def can_recompute_batch_norm(node: fx.Node) -> bool:
    """A BatchNorm call a region can hold with its running statistics updated once per step."""
    return functional_batch_norm_args(node) is not None


def _batch_norm_once_call(body: fx.Graph, node: fx.Node, env: dict, run: fx.Node) -> fx.Node:
    """The body's call of `node` (a BatchNorm, see can_recompute_batch_norm) as batch_norm_once."""
    a = {k: env[v] if isinstance(v, fx.Node) else v for k, v in functional_batch_norm_args(node).items()}
    return body.call_function(batch_norm_once, (a["input"], a.get("running_mean"), a.get("running_var"),
                                                a.get("weight"), a.get("bias"), a.get("training", False),
                                                a.get("momentum", 0.1), a.get("eps", 1e-5), node.name, run))


def _kept_output_call(body: fx.Graph, node: fx.Node, how: ConvolutionCall | ProductCall, env: dict,
                      run: fx.Node) -> fx.Node:
    """The body's call of `node` keeping its output (`how`: fxopt.checkpointing._kept_outputs.kept_output)."""
    target = node.target
    if not isinstance(target, _torch_private.op_overload_types()):
        target = importable_name(target)  # fx prints a function as an argument by name only
    original = fx.map_arg((target, node.args, node.kwargs), lambda a: env[a])
    operands = tuple(env[a] if a is not None else None for a in how.operands)
    if isinstance(how, ProductCall):
        return body.call_function(product_once, (how.kind, operands, node.name, run, original))
    return body.call_function(convolution_once, (*operands, tuple(how.arguments), node.name, run, original))


def is_lone_state_update(node: fx.Node) -> bool:
    """An in-place update of buffers nothing else in the graph touches, read by nobody
    (`aten.add_(num_batches_tracked, 1)`; the buffer a get_attr, or a graph input capture marked as state, as
    TorchDynamo passes it): it may run before the region around it. (Left inside, the region would take the buffer
    as an input and write it: checkpoint checks its saved inputs' versions at recomputation, and fails.)"""
    return (node.op == "call_function" and not node.users and bool(node.all_input_nodes)
            and all((a.op == "get_attr" or (a.op == "placeholder" and a.meta.get("constant_input")))
                    and set(a.users) == {node} for a in node.all_input_nodes))


def inputs_of_graph(graph: fx.Graph, nodes: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """What `nodes` read from outside them, in order of first reading, each made a node of `graph` (a get_attr as
    itself, anything else a placeholder) with its meta: the start of the environment that copies them into `graph`."""
    members, env = set(nodes), {}
    for arg in dict.fromkeys(a for node in nodes for a in node.all_input_nodes if a not in members):
        env[arg] = graph.get_attr(arg.target) if arg.op == "get_attr" else graph.placeholder(arg.name)
        env[arg].meta.update(arg.meta)
    return env


def read_outside(nodes: list[fx.Node]) -> list[fx.Node]:
    """Those of `nodes` a node outside them reads: what a graph of them returns."""
    members = set(nodes)
    return [n for n in nodes if any(u not in members for u in n.users)]


def extract_region(gm: fx.GraphModule, nodes: list[fx.Node], name: str, save_compute_intensive: bool,
                   replay_dropout: bool = True, compute_intensive: Iterable[fx.Node] | None = None) -> fx.Node:
    """Replace `nodes` (contiguous in graph order) with one call of a CheckpointedRegion; return that call.
    `replay_dropout`: its CPU dropouts keep their masks (dropout_once), else they draw again. A selective region
    (`save_compute_intensive`) keeps the outputs of `compute_intensive` (the matmuls, convolutions and attention among `nodes` that
    StepProfile.kept_steps names): itself where it can keep each (outputs_kept_by_region), else (or without
    `compute_intensive`) by torch's selective checkpoint policy. The call (and its items) carry the `meta["val"]` of
    the outputs they stand for: a region computes the same values.

    Lone state updates among them (is_lone_state_update) move in front of the call, run once."""
    updates = [n for n in nodes if is_lone_state_update(n)]
    nodes = [n for n in nodes if n not in updates]
    for update in updates:
        nodes[0].prepend(update)
    body = fx.Graph()
    batch_norms = {n for n in nodes if can_recompute_batch_norm(n)}
    dropouts = replayable_dropouts(nodes) if replay_dropout else {}
    kept = outputs_kept_by_region(compute_intensive) if save_compute_intensive and compute_intensive is not None else None
    run = body.placeholder("run") if batch_norms or dropouts or kept else None
    env = inputs_of_graph(body, nodes)
    inputs = [a for a in env if a.op != "get_attr"]
    for node in nodes:
        if node in batch_norms:
            env[node] = _batch_norm_once_call(body, node, env, run)
        elif node in dropouts:
            env[node] = body.call_function(dropout_once, (env[node.all_input_nodes[0]], dropouts[node], node.name, run))
        elif kept and node in kept:
            env[node] = _kept_output_call(body, node, kept[node], env, run)
        else:
            env[node] = body.node_copy(node, lambda a: env[a])
        env[node].meta.update(node.meta)
    outputs = read_outside(nodes)
    body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[n] for n in outputs))
    policy = _save_counted_ops if save_compute_intensive and kept is None else None
    gm.add_submodule(name, CheckpointedRegion(fx.GraphModule(gm, body, "Region"), policy,
                                              bool(batch_norms or dropouts or kept)))
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        vals = [out.meta.get("val") for out in outputs]  # the same values as before, so the same shapes
        if all(v is not None for v in vals):
            call.meta["val"] = vals[0] if len(outputs) == 1 else tuple(vals)
        if len(outputs) == 1:
            outputs[0].replace_all_uses_with(call)
        else:
            for i, out in enumerate(outputs):
                item = gm.graph.call_function(operator.getitem, (call, i))
                item.meta.update(out.meta)
                out.replace_all_uses_with(item)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    return call
