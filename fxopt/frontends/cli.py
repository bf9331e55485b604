"""The `fxopt` command line (also `python -m fxopt`).

    fxopt passes                      every pass: summary, modes, options, default pipelines
    fxopt inspect MODEL --input-shape 8x3x224x224 [...]   what each pass did to MODEL
    fxopt bench MODEL --input-shape 8x3x224x224 [...]     eager vs fxopt latency (and peak memory)

Arguments are parsed before torch is imported (fxopt.frontends.cli_args), so `--help` and a
mistyped command answer at once. Any bad input ends with one line on stderr, `fxopt: error: ...`,
and exit status 1 (2 for a malformed command line); `--debug` shows the traceback instead.
The user's code runs with a clean `sys.argv`, and with `--json` anything it prints goes to stderr.
fxopt's warnings are one line each on stderr, `fxopt: warning: ...`.
"""
from __future__ import annotations

import dataclasses

import contextlib
import json
import sys
import time
import warnings

from .cli_args import EXIT_USAGE, build_parser  # noqa: F401 - EXIT_USAGE is part of this module's interface

EXIT_ERROR = 1


def _parse_passes(text: str | None) -> list[str] | None:
    from ..errors import FxoptError

    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise FxoptError("--passes needs at least one pass name, e.g. --passes fold_conv_bn,inplace_relu")
    return names


def _passes_command(args, out) -> None:
    from tabulate import tabulate

    from ..passes import PASSES
    from ..pipeline.pipelines import DEFAULT_PIPELINES, ONLY_WITH_OPTION

    rows = []
    for name, cls in PASSES.items():
        defaults = [m for m, pipeline in DEFAULT_PIPELINES.items() if name in pipeline]
        if name in ONLY_WITH_OPTION and defaults:
            defaults = [f"{m} (with {ONLY_WITH_OPTION[name]})" for m in defaults]
        rows.append({"name": name, "summary": cls.summary, "modes": list(cls.modes),
                     "options": {opt: {"default": default, "help": text, **({"values": list(values[0])} if values else {})}
                                 for opt, (default, text, *values) in cls.options.items()},
                     "default_in": defaults})
    if args.json:
        print(json.dumps(rows, indent=2, default=repr), file=out)
        return
    table = [[r["name"], r["summary"], ", ".join(r["modes"]),
              "\n".join(f"{opt}={o['default']!r}: {o['help']}" for opt, o in r["options"].items()) or "-",
              ", ".join(r["default_in"]) or "-"] for r in rows]
    print(tabulate(table, headers=["pass", "summary", "modes", "options", "default pipeline"],
                   maxcolwidths=[None, 44, None, 50, 18]), file=out)


def _dtypes(args) -> list[str]:
    """One dtype per input: --dtype once for all, or once per --input-shape."""
    from ..errors import FxoptError

    given = args.dtype or ["float32"]
    if len(given) == 1:
        return given * len(args.input_shape)
    if len(given) != len(args.input_shape):
        raise FxoptError(f"--dtype given {len(given)} times for {len(args.input_shape)} --input-shape: give it "
                         "once (for every input) or once per input, in the same order")
    return given


def _check_options(args, options: dict) -> None:
    from ..errors import FxoptError
    from ..pipeline.pipelines import build_pipeline

    if args.memory_budget is not None and args.mode != "training":
        raise FxoptError("--memory-budget bounds the memory of a training step: add --mode training")
    build_pipeline(args.mode, _parse_passes(args.passes), options)  # unknown pass, wrong mode: fail before loading
    if getattr(args, "dump_dir", None):
        _check_writable_folder(args.dump_dir)
    if getattr(args, "html", None):
        _check_page_path(args.html)
        from .html.plot import check_matplotlib
        check_matplotlib()


def _check_writable_folder(path: str) -> None:
    import pathlib

    from ..errors import FxoptError

    folder = pathlib.Path(path)
    if folder.exists() and not folder.is_dir():
        raise FxoptError(f"--dump-dir {path!r} is a file, not a folder: give a folder (it is created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FxoptError(f"--dump-dir {path!r} cannot be created: {e.strerror}") from e


def _check_page_path(path: str) -> None:
    import pathlib

    from ..errors import FxoptError

    page = pathlib.Path(path)
    if page.is_dir():
        raise FxoptError(f"--html {path!r} is a folder: give a file name, e.g. {str(page / 'fxopt.html')!r}")
    if not page.parent.is_dir():
        raise FxoptError(f"--html {path!r}: the folder {str(page.parent)!r} does not exist")


def _prepare(args, progress):
    """Check everything the command line says, then load the model and make its inputs."""
    from .cli_loading import check_model_accepts, load_model, make_inputs, parse_shape

    shapes = [parse_shape(s) for s in args.input_shape]
    dtypes = _dtypes(args)
    options = {name: value for name, value in (("memory_budget", args.memory_budget),
                                               ("channels_last", args.channels_last)) if value is not None}
    _check_options(args, options)
    inputs = make_inputs(shapes, dtypes, args.int_high)
    progress.status(f"loading {args.model}")
    model = load_model(args.model)
    floating = [x.dtype for x in inputs if x.is_floating_point()]
    if floating:
        model = model.to(floating[0])
    model.train(args.mode == "training")
    progress.status("checking the model runs on the inputs")
    check_model_accepts(model, inputs, args.int_high)
    return model, inputs, _parse_passes(args.passes), options


def _inspect_command(args, out) -> None:
    from ..pipeline.instruments import DumpStages, PrintDiff, PrintGraphs
    from .api import optimize
    from .cli_inspect import CostEstimates, InspectResult, PassProgress, phase_times
    from .cli_progress import Progress

    progress = Progress("fxopt inspect", lines=False)
    model, inputs, passes, options = _prepare(args, progress)
    training = args.mode == "training"
    costs = CostEstimates(training=training)
    stream = sys.stderr if args.json else out  # keep stdout pure JSON
    instruments = [costs, PassProgress(progress)]
    recorder = None
    if args.html:
        from .html import PageRecorder
        recorder = PageRecorder(inputs, training)
        instruments += recorder.instruments
    if args.show_graph:
        instruments.append(PrintGraphs(stream))
    if args.diff:
        instruments.append(PrintDiff(stream))
    if args.dump_dir:
        instruments.append(DumpStages(args.dump_dir))
    progress.status("capturing the model")
    start = time.perf_counter()
    optimized = optimize(model, inputs, mode=args.mode, passes=passes, verify=args.verify,
                         instruments=instruments, **options)
    total = time.perf_counter() - start
    # the latest graph's report (the whole model's, where Dynamo broke no graph), with every graph break of the call
    report = dataclasses.replace(optimized.fxopt_report,
                                 graph_breaks=[b for r in optimized.fxopt_reports for b in r.graph_breaks])
    result = InspectResult(args.model, inputs, report, costs, phase_times(total, report, costs), only=args.only,
                           pass_filter=args.pass_filter)
    if recorder is not None:
        progress.status("measuring the memory of a step, before and after")
        result.timings = recorder.write(args.html, args.model, model, optimized, costs, total)
    progress.finish()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=str), file=out)
    else:
        if args.show_graph or args.diff:
            print(file=out)
        print(result, file=out)
        if args.html:
            print(f"\nHTML report: {args.html}", file=out)


def _bench_command(args, out) -> None:
    from ..errors import FxoptError
    from .cli_bench import bench_table, run_bench, torch_threads
    from .cli_loading import describe_inputs
    from .cli_progress import Progress

    if args.repeats < 1 or args.warmup < 0:
        raise FxoptError("--repeats must be at least 1 and --warmup at least 0")
    if args.threads is not None and args.threads < 1:
        raise FxoptError(f"--threads must be at least 1, got {args.threads}")
    threads = args.threads or 1
    progress = Progress("fxopt bench", lines=True)
    model, inputs, passes, options = _prepare(args, progress)
    with torch_threads(threads):
        variants = run_bench(model, inputs, args.mode, passes, options, args.compile, args.repeats, args.warmup,
                             progress)
    chosen = "--threads" if args.threads else "the default on CPU; --threads N for more"
    print(f"fxopt bench {args.model}: {args.mode}, inputs {describe_inputs(inputs)}, {args.repeats} timed rounds "
          f"after {args.warmup} warm-up, variants interleaved, {threads} torch thread(s) ({chosen})", file=out)
    print(bench_table(variants, args.mode == "training"), file=out)


COMMANDS = {"passes": _passes_command, "inspect": _inspect_command, "bench": _bench_command}


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines())


@contextlib.contextmanager
def _user_code_context(args):
    """A clean `sys.argv` for the user's code; with --json, what it prints goes to stderr."""
    saved = sys.argv
    sys.argv = [getattr(args, "model", "fxopt").rpartition(":")[0] or "fxopt"]
    quiet = contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) else contextlib.nullcontext()
    try:
        with quiet:
            yield
    finally:
        sys.argv = saved


@contextlib.contextmanager
def _fxopt_warnings_as_lines():
    """fxopt's warnings during a command as one line each, `fxopt: warning: ...`: no file and line, as the
    user's code here is MODEL, not a line calling fxopt. Other warnings are shown as Python shows them."""
    with warnings.catch_warnings():
        shown_elsewhere = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not str(message).startswith("fxopt: "):
                return shown_elsewhere(message, category, filename, lineno, file, line)
            print(f"fxopt: warning: {_one_line(str(message).removeprefix('fxopt: '))}", file=sys.stderr)

        warnings.showwarning = show
        yield


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = sys.stdout
    try:
        with _user_code_context(args), _fxopt_warnings_as_lines():
            COMMANDS[args.command](args, out)
    except KeyboardInterrupt:
        print("fxopt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fxopt ... | head`: the reader left; nothing more to say
        sys.stdout = None  # no flush at exit onto the closed pipe
        return 0
    except SystemExit as e:  # only the user's code can raise it here: argparse is done
        if args.debug:
            raise
        print(f"fxopt: error: the code of {getattr(args, 'model', 'the model')!r} called sys.exit({e.code!r}) "
              "(raised SystemExit) while fxopt was running it", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # noqa: BLE001 - the one place every error becomes a one-line message
        if args.debug:
            raise
        from ..errors import FxoptError
        if isinstance(e, FxoptError):
            print(f"fxopt: error: {_one_line(str(e))}", file=sys.stderr)
        else:
            print(f"fxopt: internal error: {type(e).__name__}: {_one_line(str(e))} "
                  "(rerun with --debug for the traceback, and please report it)", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
