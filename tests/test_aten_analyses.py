"""The analyses on torch.export's ATen graphs: aliasing from op schemas, effects of ATen ops.

Each case is a small hand-written graph of ATen overloads (the form `fxopt.optimize` captures),
so the rule under test is the only thing that decides the answer.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from fxopt.analysis.aliasing import AliasInfo, returns_several_views
from fxopt.analysis.side_effects import IO, MUTATION, NO_EFFECTS, RNG, STATS, effects, removable_if_unused

aten = torch.ops.aten


def graph_of(build) -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """`build(graph, x, y, buffer)` adds nodes and returns {name: node}; the graph returns x."""
    root = torch.nn.Module()
    root.register_buffer("buffer", torch.zeros(4))
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    buffer = graph.get_attr("buffer")
    nodes = build(graph, x, y, buffer)
    graph.output(x)
    return fx.GraphModule(root, graph), nodes


def test_views_alias_their_base_and_copies_do_not():
    """`aten.view`/`aten.slice` (schema `Tensor(a)`) share storage with their input; `aten.clone` does not."""
    gm, n = graph_of(lambda g, x, y, b: {
        "view": g.call_function(aten.view.default, (x, [-1])),
        "slice": g.call_function(aten.slice.Tensor, (x, 0, 0, 2)),
        "clone": g.call_function(aten.clone.default, (y,)),
    })
    aliases = AliasInfo(gm)
    x, y = (next(p for p in gm.graph.nodes if p.name == name) for name in "xy")
    assert {n["view"], n["slice"], x} <= set(aliases.aliases(x))
    assert n["clone"] not in aliases.aliases(y)


def test_in_place_and_out_results_alias_the_tensor_they_write():
    """`aten.add_` aliases `self`; `aten.add.out` aliases its `out=` argument, not its first input."""
    gm, n = graph_of(lambda g, x, y, b: {
        "add_": g.call_function(aten.add_.Tensor, (x, y)),
        "out": g.call_function(aten.add.out, (x, x), {"out": y}),
    })
    aliases = AliasInfo(gm)
    x, y = (next(p for p in gm.graph.nodes if p.name == name) for name in "xy")
    assert n["add_"] in aliases.aliases(x)
    assert n["out"] in aliases.aliases(y)
    assert MUTATION in effects(n["add_"], gm) and MUTATION in effects(n["out"], gm)


@pytest.mark.parametrize("p, train, aliases_input", [(0.5, False, True), (0.0, True, True), (0.5, True, False)])
def test_dropout_aliases_its_input_when_it_returns_it(p, train, aliases_input):
    """`aten.dropout` returns its input itself in eval mode or at p=0 (known from its arguments alone), else a new tensor."""
    gm, n = graph_of(lambda g, x, y, b: {"drop": g.call_function(aten.dropout.default, (x, p, train))})
    x = next(node for node in gm.graph.nodes if node.name == "x")
    assert (n["drop"] in AliasInfo(gm).aliases(x)) == aliases_input


def test_a_merge_after_a_query_joins_the_groups():
    """Groups read before `merge` (as inplace_relu reads them while it rewrites) include the merged node after it."""
    gm, n = graph_of(lambda g, x, y, b: {"clone": g.call_function(aten.clone.default, (y,))})
    aliases = AliasInfo(gm)
    x = next(p for p in gm.graph.nodes if p.name == "x")
    assert n["clone"] not in aliases.aliases(x)
    aliases.merge(n["clone"], x)
    assert n["clone"] in aliases.aliases(x) and x in aliases.aliases(n["clone"])

def test_split_returns_several_views():
    """`aten.split` returns a list of views of one tensor: none of them may be written in place."""
    gm, n = graph_of(lambda g, x, y, b: {"split": g.call_function(aten.split.Tensor, (x, 2))})
    assert returns_several_views(n["split"])


def test_copy_into_a_buffer_is_a_mutation():
    """export's writeback `aten.copy_(buffer, value)` writes the buffer: never dead code."""
    gm, n = graph_of(lambda g, x, y, b: {"copy_": g.call_function(aten.copy_.default, (b, x))})
    assert effects(n["copy_"], gm) == {MUTATION} and not removable_if_unused(n["copy_"], gm)


def test_an_in_place_op_writes_only_the_arguments_its_schema_writes():
    """`aten.add_(x, buffer)` writes `x`, not the buffer it reads; `aten.copy_(buffer, x)` writes the buffer; a
    train-mode batch norm (a statistics update) may write every input, the buffer it reads included."""
    from fxopt.analysis.written_state import written_state

    def written(build) -> set:
        gm, _ = graph_of(build)
        return written_state(gm)

    assert written(lambda g, x, y, b: {"add_": g.call_function(aten.add_.Tensor, (x, b))}) == {"x"}
    into_buffer = written(lambda g, x, y, b: {"copy_": g.call_function(aten.copy_.default, (b, x))})
    assert len(into_buffer) == 1 and "x" not in into_buffer  # the buffer's key: its tensor's id
    assert "y" in written(lambda g, x, y, b: {
        "bn": g.call_function(aten.batch_norm.default, (x, y, None, b, b, True, 0.1, 1e-5, False))})


@pytest.mark.parametrize("training, expected", [(True, {STATS}), (False, NO_EFFECTS)])
def test_batch_norm_updates_statistics_only_in_training(training, expected):
    """`aten.batch_norm(..., training=True)` updates its running statistics, though its schema writes nothing."""
    gm, n = graph_of(lambda g, x, y, b: {
        "bn": g.call_function(aten.batch_norm.default, (x, None, None, b, b, training, 0.1, 1e-5, False))})
    assert effects(n["bn"], gm) == expected


def test_batch_norm_without_running_statistics_has_no_effect():
    """A train-mode batch_norm given no running statistics writes nothing."""
    gm, n = graph_of(lambda g, x, y, b: {
        "bn": g.call_function(aten.batch_norm.default, (x, None, None, None, None, True, 0.1, 1e-5, False))})
    assert effects(n["bn"], gm) == NO_EFFECTS


@pytest.mark.parametrize("train, expected", [(True, {RNG}), (False, NO_EFFECTS)])
def test_dropout_draws_only_in_training(train, expected):
    """`aten.dropout(x, p, train=False)` returns its input and draws nothing; with train=True it draws."""
    gm, n = graph_of(lambda g, x, y, b: {"drop": g.call_function(aten.dropout.default, (x, 0.5, train))})
    assert effects(n["drop"], gm) == expected


def test_export_metadata_assert_is_kept():
    """`aten._assert_tensor_metadata` checks a dtype: an assertion, kept by dead-code elimination."""
    gm, n = graph_of(lambda g, x, y, b: {
        "check": g.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})})
    assert IO in effects(n["check"], gm)
