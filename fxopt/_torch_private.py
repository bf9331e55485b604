"""Every private torch API fxopt touches, each behind one small function.

A torch upgrade that moves one of these should need a change here and nowhere else.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch


def fake_tensor_mode():
    """A fresh FakeTensorMode that also accepts real tensors (parameters) as inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@functools.cache
def _fake_tensor_type() -> type:
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def is_fake(t) -> bool:
    """Whether `t` is a FakeTensor (asked on every call of prepack_conv_weights' helpers: the import is made once)."""
    return isinstance(t, _fake_tensor_type())


def detect_fake_mode(inputs):
    """The FakeTensorMode that `inputs` already live in (Dynamo hands one to backends), or None."""
    from torch._guards import detect_fake_mode as _detect

    return _detect(inputs)


def unset_fake_mode():
    """Leave any ambient fake mode (Dynamo compiles backends inside one) for real computation."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def register_dynamo_backend(name: str, compiler_fn) -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if name not in _BACKENDS:
        register_backend(compiler_fn=compiler_fn, name=name)


def untyped_storage_key(t: torch.Tensor):
    """A key identifying the storage behind `t` (views share it)."""
    return t.untyped_storage()._cdata


def size_hint(n) -> int:
    """A size as an int: a symbolic one (dynamic shapes) as its value in the example being compiled."""
    if isinstance(n, int):
        return n
    from torch.fx.experimental import symbolic_shapes

    if hasattr(symbolic_shapes, "optimization_hint"):  # torch >= 2.12: a hint that adds no guard
        return symbolic_shapes.optimization_hint(n)
    return symbolic_shapes.hint_int(n)


def decomposed_at_runtime(target) -> bool:
    """An ATen overload with a CompositeImplicitAutograd kernel: eager runs its decomposition, which may
    hand back an input as it is (dropout with p=0, contiguous of a contiguous tensor, type_as of the same
    dtype) where a traced value is a new tensor."""
    return isinstance(target, torch._ops.OpOverload) and target.has_kernel_for_dispatch_key(
        torch._C.DispatchKey.CompositeImplicitAutograd)


def fake_tensor_prop(gm, mode):
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    return FakeTensorProp(gm, mode)


def dispatch_mode_base():
    """The base class of Python dispatch modes (torch.utils._python_dispatch.TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def tree_leaves(tree) -> list:
    from torch.utils._pytree import tree_leaves as _leaves

    return _leaves(tree)


def tree_flatten(tree) -> tuple[list, object]:
    """(leaves, spec) of a nested structure, as torch.export flattens a call's (args, kwargs)."""
    from torch.utils._pytree import tree_flatten as _flatten

    return _flatten(tree)


def is_view(t: torch.Tensor) -> bool:
    """Whether `t` is a view of another tensor's storage (autograd cannot detach a view in place)."""
    return t._is_view()


def module_hooks(module: torch.nn.Module) -> list[str]:
    """The kinds of hook that run around a call of `module`: its own and the global ones."""
    from torch.nn.modules import module as nn_module

    kinds = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
    return [k for k in kinds if getattr(module, f"_{k}") or getattr(nn_module, f"_global_{k}")]


def dynamo_parameter_placeholders(gm, example_inputs) -> frozenset[str]:
    """Names of the placeholders of a Dynamo graph that hold parameters or buffers of an nn.Module.

    With `inline_inbuilt_nn_modules` (the default) module state reaches the backend as graph
    inputs; Dynamo records where each input came from in `node.meta["grapharg"].source`.
    """
    from torch._dynamo.source import is_from_unspecialized_param_buffer_source

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = set()
    for node, value in zip(placeholders, example_inputs):
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        guard_source = source.guard_source if source is not None else None
        from_module = source is not None and (is_from_unspecialized_param_buffer_source(source)
                                              or guard_source.is_specialized_nn_module()
                                              or guard_source.is_unspecialized_nn_module())
        if isinstance(value, torch.nn.Parameter) or from_module:
            names.add(node.name)
    return frozenset(names)


def inductor_compile(gm, example_inputs, freezing: bool = False):
    """Inductor's `compile_fx` (AOTAutograd + min-cut partitioner inside); `freezing` turns
    `get_attr` parameters into constants it can fold and pre-pack."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    with config.patch(freezing=freezing):
        return compile_fx(gm, example_inputs)


def aot_eager_compile(gm, example_inputs, partition_fn=None):
    """AOTAutograd with Inductor's decompositions and min-cut partitioner, and no code generation:
    a debugging hand-off that traces and partitions forward/backward the way Inductor's does.

    Random ops keep their ATen form (their decompositions are left out): a decomposed dropout
    draws different numbers than eager; ATen's `native_dropout` draws the same (as torch's own
    aot_eager, which decomposes nothing). `partition_fn(joint, joint_inputs, **kwargs)` replaces the min-cut
    partitioner. The graphs take their inputs boxed (torch's `boxed_nop`, as Inductor's code): each
    input, saved tensors included, is dropped after its last use, not held until the graph returns."""
    import torch._inductor.lowering  # noqa: F401  Inductor's max_pool2d decomposition reads it; only Inductor imports it
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    decompositions = {op: fn for op, fn in select_decomp_table().items() if not op_is_random(op)}
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                           partition_fn=partition_fn or min_cut_rematerialization_partition,
                           decompositions=decompositions)
    return backend(gm, example_inputs)


def inductor_compile_with_partitioner(gm, example_inputs, partition_fn):
    """Inductor's `compile_fx` partitioning forward/backward with `partition_fn(joint, joint_inputs, **kwargs)`
    (after Inductor's joint-graph passes), through `torch._inductor.config.custom_partitioner_fn`.

    Inductor's FX graph cache and AOTAutograd's cache are off for this compile: their keys take a custom
    partitioner by its `uuid()` only, so a cached compile would be reused whatever `partition_fn` would
    choose now (another budget), and `partition_fn` would not run at all."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    no_cache = {"enable_autograd_cache": False} if hasattr(functorch_config, "enable_autograd_cache") else {}
    with config.patch(custom_partitioner_fn=_custom_partitioner_class()(partition_fn), fx_graph_cache=False), \
            functorch_config.patch(**no_cache):
        return compile_fx(gm, example_inputs)


@functools.cache
def _custom_partitioner_class():
    """A CustomPartitionerFn calling a given function; a module global, so Inductor can pickle its config."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class FxoptPartitioner(CustomPartitionerFn):
        def __init__(self, partition_fn):
            self.partition_fn = partition_fn

        def __call__(self, gm, joint_inputs, **kwargs):
            return self.partition_fn(gm, joint_inputs, **kwargs)

        def uuid(self):
            return None  # the partition depends on the budget: the caches are off (inductor_compile_with_partitioner)

    FxoptPartitioner.__qualname__ = FxoptPartitioner.__name__
    globals()[FxoptPartitioner.__name__] = FxoptPartitioner
    return FxoptPartitioner


def has_custom_partitioner() -> bool:
    """Whether this torch lets a backend give Inductor its own forward/backward partitioner (torch >= 2.8)."""
    from torch._inductor import config

    return hasattr(config, "custom_partitioner_fn")


def min_cut_partition(joint, joint_inputs, **kwargs):
    """AOTAutograd's min-cut partitioner: (forward module, backward module) of a joint graph; it reads
    `node.meta["recompute"]` (`CheckpointPolicy`) and `node.meta["ac_graph_id"]`."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def activation_memory_budget(fraction: float | None):
    """Context in which AOTAutograd's min-cut partitioner keeps at most `fraction` of the activations."""
    import contextlib

    from torch._functorch import config

    return config.patch(activation_memory_budget=fraction) if fraction is not None else contextlib.nullcontext()


def outside_tracing_context():
    """Context without Dynamo's TracingContext, whose fake mode `detect_fake_mode` would otherwise return
    (its fake parameters do not require grad, and mixing it with other fake tensors fails)."""
    from torch._guards import tracing

    return tracing(None)


def reset_dynamo() -> None:
    import torch._dynamo

    torch._dynamo.reset()


# ---- side effects of ops (fxopt.analysis.side_effects) ----

def op_overload_types() -> tuple:
    """The types of ATen operator objects a graph may call (`torch.ops.aten.add.Tensor` and its packet)."""
    return (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def op_is_mutable(op) -> bool:
    """Whether an ATen operator's schema writes into an argument."""
    op = getattr(op, "default", op)
    schema = getattr(op, "_schema", None)
    return schema is not None and schema.is_mutable


def written_arguments(op) -> tuple[str, ...]:
    """The names of the arguments an ATen operator's schema writes into (`self` of `add_`, `out` of `add.out`)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return ()
    return tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)


def op_is_random(op) -> bool:
    """Whether an ATen operator draws from the random generator."""
    op = getattr(op, "default", op)
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


class OneDNNConvolution(NamedTuple):
    """oneDNN's CPU convolution ops, as Inductor's CPU freezing uses them."""

    reorder: Callable  # mkldnn._reorder_convolution_weight: a weight into oneDNN's blocked layout
    convolve: Callable  # mkldnn._convolution_pointwise: the convolution on it, then an activation
    convolve_add: Callable  # its .binary overload: the convolution, plus a tensor, then an activation
    convolve_add_: Callable  # mkldnn._convolution_pointwise_.binary: the same, written into that tensor


@functools.cache  # looked up in every call of a prepacked convolution
def onednn_convolution_ops() -> OneDNNConvolution | None:
    """oneDNN's convolution ops (`OneDNNConvolution`); None where this torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        ops = torch.ops.mkldnn
        return OneDNNConvolution(ops._reorder_convolution_weight.default, ops._convolution_pointwise.default,
                                 ops._convolution_pointwise.binary, ops._convolution_pointwise_.binary)
    except (AttributeError, RuntimeError):
        return None


def fold_constant_subgraphs(gm):
    """`gm` with every subgraph computed from its attributes alone (no input, no random or in-place op) run once
    now and kept as constants (torch.fx's `split_const_subgraphs`): a callable of the remaining inputs; None where
    there is no such subgraph, or it only takes views (an expand of a token): folding them saves no work and would
    cost the frozen graph's checks on every call."""
    from torch.fx.experimental.const_fold import split_const_subgraphs

    attributes = [*gm.parameters(), *gm.buffers()]
    device = str(attributes[0].device) if attributes else "cpu"
    import warnings

    with warnings.catch_warnings():  # it builds its constant graph before giving it the attributes it reads
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node with no underlying reference")
        folded = split_const_subgraphs(gm, skip_folding_node_fn=lambda n: n.op == "call_function" and (
            op_is_random(n.target) or op_is_mutable(n.target)), device_for_folded_attrs=device)
    constants = folded.const_subgraph_module
    if constants is None or all(getattr(n.target, "is_view", False) for n in constants.graph.nodes
                                if n.op == "call_function"):
        return None
    folded.run_folding()
    return folded.forward


def op_is_pointwise(op) -> bool:
    """Whether ATen tags an operator pointwise: each output element from the same-index input elements."""
    op = getattr(op, "default", op)
    return torch.Tag.pointwise in getattr(op, "tags", ())


def fx_is_impure(fn, args, kwargs) -> bool:
    """torch.fx's own impurity test for a called function (asserts, profiler ranges, effectful ops)."""
    from torch._library.utils import is_impure

    return is_impure(fn, args=args, kwargs=kwargs)


def profiler_running() -> bool:
    """Whether a torch profiler is recording now (a second one started inside it would end the first's session)."""
    return torch._C._autograd._profiler_enabled()


@contextlib.contextmanager
def _stderr_silenced():
    """Process-level stderr (file descriptor 2) goes to the null device for the block; unchanged where it has none."""
    sys.stderr.flush()
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def allocation_profile():
    """A CPU `torch.profiler.profile(profile_memory=True)` around the block, yielding the profile for
    `profiler_allocations`. Kineto prints a line to stderr as it starts and as it stops, whatever its log
    level (torch 2.13), which would reach the user on every `optimize()` that measures a convolution: only
    those two moments run with stderr silenced, never the block."""
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _stderr_silenced():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _stderr_silenced():
            prof.__exit__(None, None, None)


def allocation_peak(prof) -> tuple[int, int]:
    """(the most bytes held at once, the bytes still held at the end) of what an `allocation_profile()` saw
    allocated; memory allocated before it and freed during it counts negative."""
    live = peak = 0
    for _, _, nbytes in profiler_allocations(prof):
        live += nbytes
        peak = max(peak, live)
    return peak, live


def profiler_allocations(prof) -> list[tuple[int, int, int]]:
    """(time in ns, address, +bytes allocated / -bytes freed) of every allocator event an
    `allocation_profile()` recorded, in time order."""
    found, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            found.append((event.start_time_ns, fields.ptr, fields.alloc_size))
    return sorted(found)


_version_of = operator.attrgetter("_version")


def tensor_versions(tensors) -> list[int]:
    """Each tensor's version counter (bumped by every in-place change), read in one C-level loop."""
    return list(map(_version_of, tensors))


# ---- grad mode, autocast and tensor versions ----

def grad_and_autocast_state_calls() -> frozenset:
    """The graph calls Dynamo records for `torch.no_grad()` / `torch.autocast` blocks: they change global
    state for every node after them."""
    return frozenset({torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                      torch.amp.autocast_mode._exit_autocast})


def is_tensor_subclass(t: torch.Tensor) -> bool:
    """Whether `t` (or the value a fake tensor stands for) is a wrapper subclass such as DTensor."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def has_storage_bytes(t: torch.Tensor) -> bool:
    """Whether a (plain or DTensor) tensor's storage still holds bytes; FSDP2 frees storages with resize_(0)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    try:
        return local.untyped_storage().nbytes() > 0
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage of their own
        return True


def tensor_version(t: torch.Tensor) -> int:
    """A tensor's version counter (bumped by every in-place change through autograd-visible ops); -1 for an
    inference tensor (made under `torch.inference_mode()`), which has none."""
    return -1 if t.is_inference() else t._version


def aten_op_name(target) -> str | None:
    """The ATen op's name without namespace and overload (`aten.relu_.default` -> "relu_"), or None."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target.overloadpacket.__name__
    return None


def aliased_argument(target) -> tuple[str, bool] | None:
    """(argument name, written) when an ATen op's first result shares storage with an argument:
    a view (`view`, `reshape`, `to`: not written) or an in-place / out= op (`relu_`, `add.out`: written)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return None
    if returns_list(target):  # a list of views (`split`, `unbind`): `Tensor(a -> *) self`
        views = [a.name for a in schema.arguments if a.alias_info is not None and not a.alias_info.is_write]
        return (views[0], False) if views else None
    if schema.returns[0].alias_info is None:
        return None
    sets = schema.returns[0].alias_info.before_set
    for arg in schema.arguments:
        if arg.alias_info is not None and arg.alias_info.before_set & sets:
            return arg.name, arg.alias_info.is_write
    return None


def returns_list(target) -> bool:
    """Whether an ATen op returns a list of tensors (`split`, `chunk`, `unbind`)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch.ListType)


def bind_aten_arguments(target, args: tuple, kwargs: dict) -> dict:
    """{argument name: value} of an ATen op call, defaults filled in, in schema order."""
    bound = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


# ---- capture (fxopt.capture) ----

def higher_order_op_type() -> type:
    """The type of torch's higher-order operators (`torch.ops.higher_order.cond`, `wrap_with_autocast`, ...)."""
    return torch._ops.HigherOrderOperator


def output_structure(gm) -> tuple[list, list[int]] | None:
    """(top-level keys or indices, number of flat outputs in each) of the structure an exported
    graph's flat outputs are rebuilt into (its pytree code generation), or None for a plain graph."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    spec = getattr(info, "out_spec", None)
    if spec is None:
        return None
    if spec.is_leaf():
        return [0], [1]
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs  # torch < 2.10
    context = spec.context
    keyed = isinstance(context, (list, tuple)) and len(context) == len(children) and \
        all(isinstance(k, str) for k in context)
    return (list(context) if keyed else list(range(len(children)))), [c.num_leaves for c in children]


def graph_codegen(graph):
    """How `graph` generates its Python code (for an exported graph: with its call's pytree structures)."""
    return graph._codegen


def set_graph_codegen(graph, codegen) -> None:
    graph._codegen = codegen


def lazily_compiled_graph_module(root, graph):
    """A GraphModule of `graph` on `root`'s attributes that generates its Python code only when first called or
    its code is read (torch.fx's _LazyGraphModule, which Inductor uses for graphs it may never run)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


class _Interpreter(torch.fx.Interpreter):
    """Runs a Dynamo graph, calling `keep_whole(target, args, kwargs)` instead of each node whose target it
    claims (returns not NotImplemented for): a call the trace must record as it is."""

    def __init__(self, gm, keep_whole):
        super().__init__(gm)
        self.keep_whole = keep_whole

    def call_function(self, target, args, kwargs):
        if self.keep_whole is not None:
            out = self.keep_whole(target, args, kwargs)
            if out is not NotImplemented:
                return out
        return super().call_function(target, args, kwargs)


def aten_graph_of_dynamo_graph(gm, example_inputs, keep_whole=None):
    """Dynamo's graph `gm` traced to ATen ops (`make_fx`, pre-dispatch: autograd still sees every op,
    so the graph runs under eager autograd as the model's own ops would), with Dynamo's symbolic sizes.

    Dynamo hands a backend its own fake mode through the tracing context; the placeholders' fake
    values (`example_value`) belong to the mode Dynamo traced in, so they are re-made in the backend's
    (as AOTAutograd does for "cross compilation"). `keep_whole(target, args, kwargs)` may stand in for a
    call (NotImplemented: traced as usual). Returns the ATen graph and its fake inputs.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    if fake_mode is None or any(v is None for v in values):  # not from Dynamo: trace the real inputs' fakes
        fake_mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        values = list(example_inputs)
    fake_inputs = [_fake_of(v, fake_mode) if isinstance(v, torch.Tensor) else v for v in values]
    # A float Dynamo made dynamic (a module attribute that changed between calls) reaches the graph as a
    # 0-d tensor and `.item()`: traced as an unbacked symbol, as AOTAutograd would, not refused as data-dependent
    owner = fake_mode if hasattr(fake_mode, "allow_scalar_outputs") else fake_mode.shape_env
    scalar_outputs = getattr(owner, "allow_scalar_outputs", None)
    try:
        if owner is not None:
            owner.allow_scalar_outputs = True
        with fake_mode, torch.fx.traceback.preserve_node_meta():  # each op keeps its module path and source line
            aten = make_fx(_Interpreter(gm, keep_whole).run, pre_dispatch=True)(*fake_inputs)
    finally:
        if owner is not None:
            owner.allow_scalar_outputs = scalar_outputs
    return aten, fake_inputs


def _fake_of(value: torch.Tensor, fake_mode):
    """`value` re-made in `fake_mode`, keeping the symbol Dynamo gave its `.item()`: a float attribute
    Dynamo made dynamic reaches the graph as a 0-d tensor read by `.item()`, and that symbol carries
    the value's hint, so the ops that check it (dropout's `0 <= p <= 1`) trace."""
    fake = fake_mode.from_tensor(value)
    memo = getattr(value, "item_memo", None)
    if memo is not None and getattr(fake, "item_memo", None) is None:
        fake.item_memo = memo
    return fake


def is_compiling() -> bool:
    """Whether Dynamo (torch.compile) or torch.export is tracing the code running now."""
    return torch.compiler.is_compiling()


def backend_compiler_failed() -> type:
    """The exception Dynamo wraps a backend's error in (the backend's own is its `inner_exception`)."""
    from torch._dynamo.exc import BackendCompilerFailed

    return BackendCompilerFailed


def dynamo_compile_facts() -> tuple[str | None, str | None]:
    """What Dynamo knows, inside a backend, of the graph being compiled: its compile id ("0/1": frame 0's
    second compile) and the guard failure that made it recompile (None for a first compile)."""
    from torch._dynamo.utils import get_metrics_context
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    metrics = getattr(get_metrics_context(), "_metrics", {})
    return str(compile_id) if compile_id is not None else None, metrics.get("recompile_reason")


def graph_break_count() -> int:
    """How many graph breaks Dynamo has recorded in this process (one list for every model it compiles)."""
    from torch._dynamo.utils import graph_break_reasons

    return len(graph_break_reasons)


def graph_breaks_since(count: int) -> list[tuple[str, str]]:
    """The graph breaks Dynamo recorded after the first `count`: its reason's first line, and the user's file:line."""
    from torch._dynamo.utils import graph_break_reasons

    breaks = []
    for reason in graph_break_reasons[count:]:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame is not None else "?"
        breaks.append((reason.reason.splitlines()[0] if reason.reason else "", where))
    return breaks


def compile_on_its_own(module: torch.nn.Module, backend, dynamic: bool | None = None):
    """`torch.compile(module, backend=backend, dynamic=dynamic)` with its own recompile count where torch
    offers one (`isolate_recompiles`, torch >= 2.13): optimizing many models of one class must not exhaust
    the recompile limit their shared `forward` code object would otherwise share."""
    import inspect

    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return torch.compile(module, backend=backend, dynamic=dynamic, isolate_recompiles=True)
    return torch.compile(module, backend=backend, dynamic=dynamic)


def compile_with_settings(module: torch.nn.Module, backend, on_recompile_limit: Callable[[], object],
                          converting: Callable[[], contextlib.AbstractContextManager]):
    """`compile_on_its_own(module, backend)` whose FXOPT_DYNAMO_SETTINGS apply while Dynamo compiles a frame of it (or
    decides not to), inside `converting()`, calling `on_recompile_limit()` when Dynamo ran a frame as written there
    because a recompile limit was reached: Dynamo's frame callback, which it calls only where no compiled code's
    guards hold, wrapped as its own wrappers are (`_torchdynamo_orig_backend`). Returns (compiled, True); or
    (compiled, False) where this torch's OptimizedModule is not laid out so, and the caller applies the settings and
    `converting()` around each call (`settings_applied`)."""
    compiled = compile_on_its_own(module, backend)
    context = getattr(compiled, "dynamo_ctx", None)
    if not (callable(getattr(context, "callback", None)) and hasattr(compiled, "_initialize")):
        return compiled, False
    context.callback = _CompilingWithSettings(context.callback, on_recompile_limit, converting)
    compiled._initialize()  # wraps the module's call again, with the new callback
    return compiled, True


class _CompilingWithSettings:
    """Dynamo's frame callback under FXOPT_DYNAMO_SETTINGS (see `compile_with_settings`)."""

    def __init__(self, callback, on_recompile_limit: Callable[[], object],
                 converting: Callable[[], contextlib.AbstractContextManager]):
        self._torchdynamo_orig_backend = callback  # how Dynamo finds the backend inside its callback wrappers
        self.callback, self.on_recompile_limit, self.converting = callback, on_recompile_limit, converting

    def __call__(self, *args, **kwargs):
        with settings_applied(self.on_recompile_limit), self.converting():
            return self.callback(*args, **kwargs)


@contextlib.contextmanager
def settings_applied(on_recompile_limit: Callable[[], object] | None = None):
    """FXOPT_DYNAMO_SETTINGS inside (a capture made so sees the graphs an fxopt.optimize result gets);
    `on_recompile_limit()` after, if Dynamo reached a recompile limit inside."""
    hits = recompile_limit_hits()[0]
    entered = enter_fxopt_dynamo_settings()
    try:
        yield
    finally:
        leave_fxopt_dynamo_settings(entered)
        if on_recompile_limit is not None and recompile_limit_hits()[0] != hits:
            on_recompile_limit()


# TorchDynamo settings for the calls of an fxopt.optimize result, where torch's defaults would let the compiled
# model differ from eager: guard modules' hooks (torch skips guards on empty hook dicts, so a hook registered
# after compiling would silently not run), run NumPy's random functions with NumPy's own stream (torch traces
# them onto its generator: HF Wav2Vec2's SpecAugment masks would change), keep float attributes constants
# with a guard (a float made a graph input reaches ops whose ATen schema takes a Python float), and bound
# recompiles per result only (`isolate_recompiles`: each result has its own `recompile_limit`), not by
# torch's process-wide count of every compile of the model class's `forward` code, which results long gone
# used up (a sweep or a fuzzer optimizing hundreds of models of one class then ran the rest unoptimized).
FXOPT_DYNAMO_SETTINGS = {"skip_nnmodule_hook_guards": False, "use_numpy_random_stream": True,
                         "specialize_float": True, "accumulated_recompile_limit": 1 << 30}


def _dynamo_setting_variables() -> list | None:
    """Each setting's context variable (torch >= 2.10 keeps Dynamo's config in ContextVars), or None."""
    import contextvars

    import torch._dynamo.config as config

    entries = getattr(config, "_config", {})
    variables = [(getattr(entries.get(name), "user_override", None), value)
                 for name, value in FXOPT_DYNAMO_SETTINGS.items()]
    return variables if all(isinstance(v, contextvars.ContextVar) for v, _ in variables) else None


_SETTING_VARIABLES = _dynamo_setting_variables()


def enter_fxopt_dynamo_settings():
    """Apply FXOPT_DYNAMO_SETTINGS for this thread's call (a fraction of a microsecond); pass what it returns to
    `leave_fxopt_dynamo_settings`."""
    if _SETTING_VARIABLES is not None:
        return [variable.set(value) for variable, value in _SETTING_VARIABLES]
    import torch._dynamo.config as config  # older torch: plain attributes

    before = {name: getattr(config, name) for name in FXOPT_DYNAMO_SETTINGS}
    for name, value in FXOPT_DYNAMO_SETTINGS.items():
        setattr(config, name, value)
    return before


def leave_fxopt_dynamo_settings(entered) -> None:
    """Put back the settings `enter_fxopt_dynamo_settings` changed."""
    if _SETTING_VARIABLES is not None:
        for (variable, _), token in zip(_SETTING_VARIABLES, entered):
            variable.reset(token)
        return
    import torch._dynamo.config as config

    for name, value in entered.items():
        setattr(config, name, value)


_LIMIT_EXCEEDED = "Dynamo recompile limit exceeded"  # the start of Dynamo's record of such a call (`unimplemented`)
_limit_hits_seen = [-1, 0, ""]  # Dynamo's count of frames it tried to compile, and what that count implied


@functools.cache
def _dynamo_counters():
    """Dynamo's process-wide counters (`torch._dynamo.utils.counters`, one dict for the process's life)."""
    from torch._dynamo.utils import counters

    return counters


def recompile_limit_hits() -> tuple[int, str]:
    """(how many calls in this process Dynamo ran as written because a recompile limit was reached, the last
    limit's setting): Dynamo's counters, read anew only after it tried to compile something (O(1) otherwise)."""
    counters = _dynamo_counters()
    frames = counters["frames"]["total"]
    if frames != _limit_hits_seen[0]:
        hits = {message: count for message, count in counters["unimplemented"].items()
                if message.startswith(_LIMIT_EXCEEDED)}
        last = ""
        for message in hits:
            kind = message.split("Limit type: ", 1)[-1].split()[0] if "Limit type: " in message else "recompile_limit"
            last = f"torch._dynamo.config.{kind} = {getattr(torch._dynamo.config, kind, '?')}"
        _limit_hits_seen[:] = [frames, sum(hits.values()), last or _limit_hits_seen[2]]
    return _limit_hits_seen[1], _limit_hits_seen[2]


def dynamo_input_source(node) -> str | None:
    """The Python source Dynamo read a graph input from (`L['self']._modules['fc']._parameters['weight']`), or None."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else name  # a method before torch 2.12, a property since
