"""Default pipelines, one literal tuple per mode, and the checks on what a caller asked for."""
from __future__ import annotations

import difflib

from ..errors import FxoptError
from ..passes import PASSES
from ..passes.base import MODES, Pass

DEFAULT_PIPELINES: dict[str, tuple[str, ...]] = {
    # prepack_conv_weights last: every pass before it sees ATen's convolutions (fold_conv_bn, channels_last), which it
    # then replaces by oneDNN's, with the activations after them.
    "inference": ("fold_conv_bn", "prune_dead_grads", "drop_zero_pads", "drop_eval_dropout", "channels_last",
                  "inplace_relu", "prepack_conv_weights"),
    # checkpoint_activations before inplace_relu: an in-place ReLU is a write the planner must keep out of
    # regions (and out of what they keep), while inplace_relu sees a region call as an unknown op and never
    # writes into its inputs or outputs, so each pass's gain survives the other. drop_eval_dropout before
    # both: a dropout that returns its input is neither a step to plan around nor a producer that hides one.
    # tied_embedding_grads and inplace_log_softmax_grad before checkpoint_activations: the planner prices the
    # sparse gradients and the shared gradient they make.
    "training": ("fold_conv_bn", "prune_dead_grads", "drop_zero_pads", "drop_eval_dropout", "tied_embedding_grads",
                 "inplace_log_softmax_grad", "checkpoint_activations", "inplace_relu"),
}

# Keywords of fxopt.optimize besides pass options: a misspelling of one is caught as a stray option.
OPTIMIZE_KEYWORDS = ("mode", "passes", "verify", "instruments")

# Passes in a default pipeline that run only when the caller gives this option.
ONLY_WITH_OPTION = {"checkpoint_activations": "memory_budget"}


def resolve_mode(mode: str, training_flag: bool) -> str:
    if mode == "auto":
        return "training" if training_flag else "inference"
    if mode not in MODES:
        raise FxoptError(f"unknown mode {mode!r}; expected one of: auto, {', '.join(MODES)}")
    return mode


def _who_takes(option: str, mode: str, accepted: set[str]) -> str:
    """What to do about an option no selected pass takes: the mode its passes run in, or the options taken."""
    owners = [cls for cls in PASSES.values() if option in cls.options]
    modes = [m for m in MODES if m != mode and any(m in cls.modes for cls in owners)]
    if owners and modes:
        return (f"it is {owners[0].name}'s, which runs in {modes[0]} mode: pass mode={modes[0]!r} "
                f"(on the command line: --mode {modes[0]})")
    if owners:
        return f"it is {owners[0].name}'s: add {owners[0].name} to passes (on the command line: to --passes)"
    return f"options they take: {', '.join(sorted(accepted)) or 'none'}"


def build_pipeline(mode: str, names, options: dict, *, mode_per_graph: bool = False) -> list[Pass]:
    """The passes to run, for every front end; unknown names, wrong modes and stray options are errors.

    names: pass names in order, or None for the default pipeline of `mode` (with the passes whose
    option is given). mode_per_graph: the names were given once for graphs of either mode
    (torch.compile decides each graph's mode), so a named pass that does not run in `mode` stays in
    the pipeline and the manager reports it skipped on this graph, instead of an error.
    """
    if names is None:
        names = [n for n in DEFAULT_PIPELINES[mode] if ONLY_WITH_OPTION.get(n, "") in ("", *options)]
    elif isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise FxoptError(f"unknown pass {unknown[0]!r}; available passes: {', '.join(PASSES)}")
    passes = [PASSES[n]() for n in names]
    for p in passes:
        if mode not in p.modes and not mode_per_graph:
            raise FxoptError(f"pass {p.name!r} does not run in {mode} mode (it runs in: {', '.join(p.modes)})")
    accepted = {opt for p in passes for opt in p.options}
    stray = sorted(set(options) - accepted)
    if stray:
        known = {opt for cls in PASSES.values() for opt in cls.options} | set(OPTIMIZE_KEYWORDS)
        close = difflib.get_close_matches(stray[0], sorted(known), n=1)
        if close and close[0] != stray[0]:
            raise FxoptError(f"unknown option {stray[0]!r}: did you mean {close[0]}?")
        raise FxoptError(f"option {stray[0]!r} is not taken by any selected pass "
                         f"({', '.join(p.name for p in passes) or 'none'}); {_who_takes(stray[0], mode, accepted)}")
    for p in passes:
        for name, (_default, _help, *values) in p.options.items():
            if values and name in options and options[name] not in values[0]:
                raise FxoptError(f"{name}={options[name]!r}: expected one of {', '.join(map(repr, values[0]))}")
    return passes
