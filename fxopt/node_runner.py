"""The one node-by-node runner: a graph run by torch.fx's Interpreter, each node inside the caller's hooks.

A hook is a generator function `hook(node, env)` (`env`: the values computed so far, by node). It yields once,
where the node runs, and receives the node's output there:

    def count_flops(node, env):
        with FlopCounterMode(display=False) as counter:
            yield                      # the node runs here
        flops[node.name] = counter.get_total_flops()

    NodeRunner(gm, [count_flops]).run(*inputs)

A hook that returns without yielding leaves that node alone. If the node raises, each hook is closed (its
`finally` blocks run) and the error propagates. Hooks see call nodes only, unless `every_node`.
FLOP counting (fxopt.analysis.flops), op timing (fxopt.analysis.op_times), a real run's shapes
(fxopt.analysis.shapes) and the HTML timeline's attribution of ops to modules all run through it.
"""
from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch.fx as fx

NodeHook = Callable[[fx.Node, dict], Generator[None, object, None]]
_DECLINED = object()


class NodeRunner(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, hooks: Sequence[NodeHook], every_node: bool = False):
        super().__init__(gm)
        self.hooks, self.every_node = list(hooks), every_node

    def run_node(self, n: fx.Node):
        if not self.every_node and n.op in ("placeholder", "get_attr", "output"):
            return super().run_node(n)
        running = []
        try:
            for hook in self.hooks:
                inside = hook(n, self.env)
                if next(inside, _DECLINED) is not _DECLINED:
                    running.append(inside)
            out = super().run_node(n)
        except BaseException:
            for inside in reversed(running):
                inside.close()
            raise
        for inside in reversed(running):
            try:
                inside.send(out)
            except StopIteration:
                continue
            raise RuntimeError(f"a node hook yielded twice for {n.name}")
        return out
