"""The `fxopt` command line's arguments, parsed before torch is imported (`fxopt --help` is instant).

This module imports nothing heavy; what the names mean (passes, dtypes, pipelines) is checked by
the commands after parsing, and tests/test_cli.py checks these lists against the real ones.
"""
from __future__ import annotations

import argparse
import difflib
import re

EXIT_USAGE = 2
MODES = ("inference", "training")  # fxopt.passes.base.MODES
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int64", "int32")  # cli_loading.DTYPES
DEFAULT_INT_HIGH = 16  # integer inputs (token ids) are drawn from [0, --int-high)
SITE_FILTERS = ("changed", "refused")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first), with a
    "did you mean" for a misspelled option."""

    def error(self, message: str):
        hint = _did_you_mean(message, self._all_options())
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")


    def _all_options(self) -> list[str]:
        """This parser's option strings and its subcommands' (unknown options are reported by the top one)."""
        options = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    options += list(sub._option_string_actions)
        return options


def _did_you_mean(message: str, options) -> str:
    match = re.match(r"unrecognized arguments: (.*)", message)
    if not match:
        return ""
    hints = []
    for word in match.group(1).split():
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=")[0], [o for o in options if o.startswith("--")], n=1)
            if close:
                hints.append(f"did you mean {close[0]}?")
    return "; " + "; ".join(hints) if hints else ""


def parse_budget(text: str) -> float | str:
    """A bare number is a fraction of the captured step's peak ('1' and '1.0' alike); bytes need a unit."""
    try:
        return float(text)
    except ValueError:
        return text  # '512MB': checkpoint_activations parses sizes and checks the range


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="package.module:attr or path/to/file.py:attr; attr is an nn.Module subclass "
                             "(built with no arguments), a factory function, or a module instance")
    parser.add_argument("--input-shape", action="append", required=True, metavar="SHAPE",
                        help="shape of one model input, e.g. 8x3x224x224; repeat for several inputs")
    parser.add_argument("--dtype", action="append", choices=list(DTYPE_NAMES), metavar="DTYPE",
                        help=f"dtype of the inputs: once for all of them, or once per --input-shape, in order "
                             f"({', '.join(DTYPE_NAMES)}; default float32). The model is converted to the first "
                             "floating dtype given. Token ids: --dtype int64")
    parser.add_argument("--int-high", type=int, default=DEFAULT_INT_HIGH, metavar="N",
                        help=f"integer inputs are drawn at random from [0, N) (default {DEFAULT_INT_HIGH}; keep N "
                             "below the vocabulary size of a language model)")
    parser.add_argument("--mode", choices=list(MODES), default="inference",
                        help="optimize for inference (default) or for a training step")
    parser.add_argument("--passes", metavar="A,B", help="passes to run in order (default: the mode's pipeline)")
    parser.add_argument("--memory-budget", type=parse_budget, metavar="BUDGET",
                        help="training only (with --mode training): peak memory of a step for "
                             "checkpoint_activations, as a fraction of the captured step's peak (0.5; 1 = no "
                             "recomputation) or a size with a unit (512MB, 1.5GiB)")
    parser.add_argument("--channels-last", choices=["when_faster", "always"],
                        help="inference only: keep channels_last's rewrite only if the graph runs faster so on the "
                             "example's shapes (when_faster, the default), or always")
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
                                         "--input-shape 8x3x32x32 --mode training --html seed.html")
    _model_arguments(inspect)
    inspect.add_argument("--show-graph", action="store_true", help="print the graph after each pass that changed it")
    inspect.add_argument("--diff", action="store_true", help="print a unified diff of the code for each pass")
    inspect.add_argument("--dump-dir", metavar="DIR", help="write every stage to DIR (00_input.py, 01_<pass>.py, ...)")
    inspect.add_argument("--json", action="store_true", help="print the whole report as JSON (see README)")
    inspect.add_argument("--html", metavar="FILE",
                         help='write one self-contained HTML page: memory of a step before/after, each pass\'s '
                              'graph (needs matplotlib: pip install "fxopt[report]")')
    inspect.add_argument("--only", choices=SITE_FILTERS, help="list only the sites passes changed, or refused")
    inspect.add_argument("--pass", dest="pass_filter", metavar="NAME", help="list only the sites of pass NAME")
    inspect.add_argument("--verify", action="store_true",
                         help="check the model against the original after each pass; show the max difference")

    bench = commands.add_parser("bench", help="latency spread (and training peak memory): eager vs fxopt",
                                epilog="example: fxopt bench examples/seed_net.py:SeedNet --input-shape 8x3x32x32 "
                                       "--mode training")
    _model_arguments(bench)
    bench.add_argument("--compile", action="store_true", help="also time torch.compile(model, backend='fxopt')")
    bench.add_argument("--repeats", type=int, default=20, help="timed rounds (default 20)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    bench.add_argument("--threads", type=int, metavar="N",
                       help="torch intra-op threads while timing (default 1 on CPU: on a shared or busy machine "
                            "torch's default, a thread per core, makes latencies vary a hundredfold)")
    return parser
