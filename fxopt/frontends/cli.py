"""The `fxopt` command line (also `python -m fxopt`).

    fxopt passes                      every pass: summary, modes, options, default pipelines
    fxopt inspect MODEL --input-shape 8x3x224x224 [...]   what each pass did to MODEL
    fxopt bench MODEL --input-shape 8x3x224x224 [...]     eager vs fxopt latency (and peak memory)

Any bad input ends with one line on stderr, `fxopt: error: ...`, and exit status 1 (2 for a
malformed command line); `--debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import sys

from tabulate import tabulate

from ..errors import FxoptError
from ..passes import PASSES
from ..pipeline.instruments import DumpStages, PrintDiff, PrintGraphs
from ..pipeline.pipelines import DEFAULT_PIPELINES, ONLY_WITH_OPTION, build_pipeline
from .api import optimize
from .cli_loading import DTYPES, check_model_accepts, load_model, make_inputs, parse_shape

EXIT_ERROR = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parse_passes(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise FxoptError("--passes needs at least one pass name, e.g. --passes fold_conv_bn,inplace_relu")
    return names


def _parse_budget(text: str) -> float | int | str:
    """'0.5' -> 0.5 (a fraction), '1000000' -> 1000000 (bytes), '512MB' -> '512MB'; the pass checks the range."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="package.module:attr or path/to/file.py:attr; attr is an nn.Module subclass "
                             "(built with no arguments), a factory function, or a module instance")
    parser.add_argument("--input-shape", action="append", required=True, metavar="SHAPE",
                        help="shape of one model input, e.g. 8x3x224x224; repeat for several inputs")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="dtype of the inputs (and of the model, for floating dtypes); default float32")
    parser.add_argument("--mode", choices=list(DEFAULT_PIPELINES), default="inference",
                        help="optimize for inference (default) or for a training step")
    parser.add_argument("--passes", metavar="A,B", help="passes to run in order (default: the mode's pipeline)")
    parser.add_argument("--memory-budget", type=_parse_budget, metavar="BUDGET",
                        help="training peak-memory budget for checkpoint_activations: a fraction such as 0.5 "
                             "(1.0 = no recomputation) or a size in bytes (300000000, 512MB)")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxopt", description="fxopt: see what each graph pass does to a PyTorch model.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    passes = commands.add_parser("passes", help="list the passes, their modes and options")
    passes.add_argument("--json", action="store_true", help="print the list as JSON")
    passes.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    inspect = commands.add_parser("inspect", help="run the pipeline on MODEL and show what each pass did",
                                  epilog="example: fxopt inspect examples/seed_net.py:SeedNet "
                                         "--input-shape 8x3x32x32 --diff")
    _model_arguments(inspect)
    inspect.add_argument("--show-graph", action="store_true", help="print the graph after each pass that changed it")
    inspect.add_argument("--diff", action="store_true", help="print a unified diff of the code for each pass")
    inspect.add_argument("--dump-dir", metavar="DIR", help="write every stage to DIR (00_input.py, 01_<pass>.py, ...)")
    inspect.add_argument("--json", action="store_true", help="print the whole report as JSON (see README)")
    inspect.add_argument("--verify", action="store_true",
                         help="check the model against the original after each pass; show the max difference")

    bench = commands.add_parser("bench", help="median latency (and training peak memory): eager vs fxopt",
                                epilog="example: fxopt bench examples/seed_net.py:SeedNet --input-shape 8x3x32x32 "
                                       "--mode training")
    _model_arguments(bench)
    bench.add_argument("--compile", action="store_true", help="also time torch.compile(model, backend='fxopt')")
    bench.add_argument("--repeats", type=int, default=20, help="timed runs per variant (default 20)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed runs per variant first (default 3)")
    return parser


def _passes_command(args) -> None:
    rows = []
    for name, cls in PASSES.items():
        defaults = [m for m, pipeline in DEFAULT_PIPELINES.items() if name in pipeline]
        if name in ONLY_WITH_OPTION and defaults:
            defaults = [f"{m} (with {ONLY_WITH_OPTION[name]})" for m in defaults]
        rows.append({"name": name, "summary": cls.summary, "modes": list(cls.modes),
                     "options": {opt: {"default": default, "help": text} for opt, (default, text) in cls.options.items()},
                     "default_in": defaults})
    if args.json:
        print(json.dumps(rows, indent=2, default=repr))
        return
    table = [[r["name"], r["summary"], ", ".join(r["modes"]),
              "\n".join(f"{opt}={o['default']!r}: {o['help']}" for opt, o in r["options"].items()) or "-",
              ", ".join(r["default_in"]) or "-"] for r in rows]
    print(tabulate(table, headers=["pass", "summary", "modes", "options", "default pipeline"],
                   maxcolwidths=[None, 44, None, 50, 18]))


def _prepare(args):
    """Check everything the command line says, then load the model and make its inputs."""
    shapes = [parse_shape(s) for s in args.input_shape]
    passes = _parse_passes(args.passes)
    options = {} if args.memory_budget is None else {"memory_budget": args.memory_budget}
    build_pipeline(args.mode, passes, options)  # unknown pass, wrong mode, stray option: fail before loading
    model = load_model(args.model)
    inputs = make_inputs(shapes, args.dtype)
    if inputs[0].is_floating_point():
        model = model.to(inputs[0].dtype)
    model.train(args.mode == "training")
    check_model_accepts(model, inputs)
    return model, inputs, passes, options


def _inspect_command(args) -> None:
    from .cli_inspect import CostEstimates, InspectResult

    model, inputs, passes, options = _prepare(args)
    costs = CostEstimates(training=args.mode == "training")
    stream = sys.stderr if args.json else sys.stdout  # keep stdout pure JSON
    instruments = [costs]
    if args.show_graph:
        instruments.append(PrintGraphs(stream))
    if args.diff:
        instruments.append(PrintDiff(stream))
    if args.dump_dir:
        instruments.append(DumpStages(args.dump_dir))
    optimized = optimize(model, inputs, mode=args.mode, passes=passes, verify=args.verify,
                         instruments=instruments, **options)
    result = InspectResult(args.model, inputs, optimized.fxopt_report, costs)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        if args.show_graph or args.diff:
            print()
        print(result)


def _bench_command(args) -> None:
    from .cli_bench import Progress, bench_table, run_bench

    if args.repeats < 1 or args.warmup < 0:
        raise FxoptError("--repeats must be at least 1 and --warmup at least 0")
    model, inputs, passes, options = _prepare(args)
    variants = run_bench(model, inputs, args.mode, passes, options, args.compile, args.repeats, args.warmup,
                         Progress())
    shapes = ", ".join(args.input_shape)
    print(f"fxopt bench {args.model}: {args.mode}, inputs {shapes} ({args.dtype}), "
          f"median of {args.repeats} runs after {args.warmup} warm-up")
    print(bench_table(variants, args.mode == "training"))


COMMANDS = {"passes": _passes_command, "inspect": _inspect_command, "bench": _bench_command}


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("fxopt: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place every error becomes a one-line message
        if args.debug:
            raise
        if isinstance(e, FxoptError):
            print(f"fxopt: error: {_one_line(str(e))}", file=sys.stderr)
        else:
            print(f"fxopt: internal error: {type(e).__name__}: {_one_line(str(e))} "
                  "(rerun with --debug for the traceback, and please report it)", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
