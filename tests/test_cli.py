"""The `fxopt` command line, through `main(argv)` in this process (the code path of the console script,
without paying a torch import per invocation), and two subprocesses for the entry points themselves:
`python -m fxopt` and the `fxopt` script.

Each invocation runs once, when a test first asks for it, and its result is shared by the tests that read it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from fxopt.errors import FxoptError
from fxopt.frontends.cli import main
from fxopt.frontends.cli_inspect import JSON_KEYS
from fxopt.pipeline.pipelines import DEFAULT_PIPELINES

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = "tests/fixtures/tiny_models.py"
IMAGE = ["--input-shape", "2x3x8x8"]
DUMP_DIR = "{dump_dir}"  # replaced by a temporary folder

HAPPY = {
    "passes": ["passes"],
    "passes_json": ["passes", "--json"],
    "inspect_text": ["inspect", f"{TINY}:TinyConvNet", *IMAGE, "--show-graph", "--diff", "--verify",
                     "--dump-dir", DUMP_DIR],
    "inspect_json_training": ["inspect", "tests.fixtures.tiny_models:make_tiny", *IMAGE, "--mode", "training",
                              "--json", "--verify", "--diff"],
    "inspect_json_instance": ["inspect", f"{TINY}:TINY", *IMAGE, "--json", "--passes", "fold_conv_bn"],
    "inspect_two_inputs": ["inspect", f"{TINY}:TwoInputs", "--input-shape", "2x6", "--input-shape", "2x4"],
    "inspect_opaque": ["inspect", f"{TINY}:PartlyTraceable", "--input-shape", "2x3"],
    "bench_inference": ["bench", f"{TINY}:TinyConvNet", *IMAGE, "--repeats", "3", "--warmup", "1"],
    "bench_training": ["bench", f"{TINY}:TinyConvNet", *IMAGE, "--mode", "training", "--repeats", "3",
                       "--warmup", "1"],
}

# Each bad input the issue names: name -> (arguments, exit status, what the message says).
BAD_INPUT = {
    "module_does_not_import": (["inspect", "fxopt_no_such_pkg.models:Net", *IMAGE], 1,
                               "cannot import 'fxopt_no_such_pkg.models': ModuleNotFoundError"),
    "attribute_missing": (["inspect", f"{TINY}:Missing", *IMAGE], 1, "has no attribute 'Missing'"),
    "value_not_a_module": (["inspect", f"{TINY}:LEARNING_RATE", *IMAGE], 1,
                           "is a float, not an nn.Module subclass, a factory function or a module instance"),
    "factory_needs_arguments": (["inspect", f"{TINY}:make_with_depth", *IMAGE], 1, "needs arguments (depth)"),
    "malformed_shape": (["inspect", f"{TINY}:TinyConvNet", "--input-shape", "2xQx32"], 1,
                        "malformed --input-shape '2xQx32'"),
    "shape_rejected": (["inspect", f"{TINY}:TinyConvNet", "--input-shape", "2x3x16x16"], 1,
                       "layer 'fc' (Linear) called with 2x1024 raised RuntimeError"),
    "unknown_pass": (["inspect", f"{TINY}:TinyConvNet", *IMAGE, "--passes", "fold_conv_bn,fold_everything"], 1,
                     "unknown pass 'fold_everything'"),
    "budget_out_of_range": (["inspect", f"{TINY}:TinyConvNet", *IMAGE, "--mode", "training",
                             "--memory-budget", "1.5"], 1, "memory_budget 1.5 is not a fraction in (0, 1]"),
    "unknown_mode": (["inspect", f"{TINY}:TinyConvNet", *IMAGE, "--mode", "fast"], 2, "invalid choice: 'fast'"),
    "bench_shape_rejected": (["bench", f"{TINY}:TinyConvNet", "--input-shape", "2x3x16x16"], 1,
                             "the model rejects inputs 2x3x16x16"),
}

# More ways to give MODEL wrong: name -> (arguments, what the message says).
MORE_BAD_MODELS = {
    "file_import_fails": (["inspect", "tests/fixtures/broken_import.py:Net", *IMAGE],
                          "No module named 'fxopt_no_such_package'"),
    "file_missing": (["inspect", "tests/fixtures/no_such_file.py:Net", *IMAGE], "no such file"),
    "class_not_a_module": (["inspect", f"{TINY}:NotAModule", *IMAGE], "is not an nn.Module subclass"),
    "class_needs_arguments": (["inspect", f"{TINY}:NeedsWidth", *IMAGE], "needs arguments (width)"),
    "factory_returns_other": (["inspect", f"{TINY}:make_list", *IMAGE], "returned a list, not an nn.Module"),
    "constructor_raises": (["inspect", f"{TINY}:ExplodingInit", *IMAGE], "RuntimeError: no weights file found"),
    "model_without_attr": (["inspect", TINY, *IMAGE], "MODEL must be 'package.module:attr'"),
    "no_passes": (["inspect", f"{TINY}:TinyConvNet", *IMAGE, "--passes", ","], "--passes needs at least one"),
    "channels_last_in_training": (["inspect", f"{TINY}:TinyConvNet", *IMAGE, "--mode", "training",
                                   "--channels-last", "always"], "option 'channels_last' is not taken"),
}


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def _main(args: list[str]) -> Run:
    """`fxopt ARGS` in this process, from the repository root, as the console script runs it."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.chdir(REPO)
        patch.setattr(sys, "path", list(sys.path))  # loading a model file puts its folder on sys.path
        try:
            code = main(args)
        except SystemExit as e:  # argparse: a malformed command line
            code = e.code
    return Run(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> Run of that invocation (HAPPY, BAD_INPUT), each run once, when first asked for."""
    dump_dir = tmp_path_factory.mktemp("stages") / "out"
    invocations = {name: [a.replace(DUMP_DIR, str(dump_dir)) for a in args] for name, args in HAPPY.items()}
    invocations.update({name: args for name, (args, _, _) in BAD_INPUT.items()})

    class Runs(dict):
        def __missing__(self, name):
            self[name] = _main(invocations[name])
            return self[name]

    results = Runs()
    results["dump_dir"] = dump_dir
    return results


def _ok(result: Run) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_passes_lists_every_pass(runs):
    """`fxopt passes` names every registered pass with its modes."""
    out = _ok(runs["passes"])
    for name in ("fold_conv_bn", "inplace_relu", "checkpoint_activations"):
        assert name in out
    assert "memory_budget" in out and "inference, training" in out


def test_passes_json(runs):
    """`fxopt passes --json` gives each pass's summary, modes, options and default pipelines."""
    rows = {r["name"]: r for r in json.loads(_ok(runs["passes_json"]))}
    assert rows["fold_conv_bn"]["modes"] == ["inference", "training"]
    assert "memory_budget" in rows["checkpoint_activations"]["options"]
    assert rows["checkpoint_activations"]["default_in"] == ["training (with memory_budget)"]
    assert rows["channels_last"]["options"]["channels_last"]["values"] == ["when_faster", "always"]
    assert all(r["summary"] for r in rows.values())


def test_inspect_text_report(runs):
    """The text report has the per-pass table with estimates, the sites, the graphs, the diffs and a summary."""
    out = _ok(runs["inspect_text"])
    assert "FLOPs (est.)" in out and "max |diff|" in out
    assert "folded: 1" in out and "conv + bn" in out
    assert re.search(r"# ---- dynamo_graph_\d+ after fold_conv_bn ----", out)  # --show-graph
    assert re.search(r"--- dynamo_graph_\d+ before fold_conv_bn", out) and "after fold_conv_bn" in out  # --diff
    assert out.rstrip().splitlines()[-1].startswith("Summary: ")
    assert "saved for backward" not in out  # inference keeps nothing for backward


def test_inspect_dump_dir(runs):
    """--dump-dir writes the captured graph and the graph after each pass, numbered in pipeline order."""
    _ok(runs["inspect_text"])
    expected = ["00_input.py"] + [f"{i:02d}_{name}.py" for i, name in enumerate(DEFAULT_PIPELINES["inference"], 1)]
    dump_dir = runs["dump_dir"]
    assert sorted(p.name for p in dump_dir.iterdir()) == expected
    assert "aten.batch_norm" in (dump_dir / "00_input.py").read_text()
    assert "aten.batch_norm" not in (dump_dir / "01_fold_conv_bn.py").read_text()


def _assert_keys(record: dict, kind: str) -> None:
    assert tuple(record) == JSON_KEYS[kind], kind


def test_inspect_json_schema(runs):
    """--json prints exactly the documented keys, in order, at every level; --diff goes to stderr."""
    data = json.loads(_ok(runs["inspect_json_training"]))
    _assert_keys(data, "top")
    _assert_keys(data["summary"], "summary")
    assert data["inputs"] == [{"shape": [2, 3, 8, 8], "dtype": "float32"}]
    assert data["model"] == "tests.fixtures.tiny_models:make_tiny" and data["mode"] == "training"
    for entry in data["passes"]:
        _assert_keys(entry, "pass")
        _assert_keys(entry["estimated"], "estimated")
        for site in entry["sites"]:
            _assert_keys(site, "site")
        assert isinstance(entry["max_abs_diff"], float)
    assert re.search(r"--- dynamo_graph_\d+ before", runs["inspect_json_training"].stderr)


def test_inspect_json_figures(runs):
    """Training estimates give FLOPs and saved bytes that chain pass to pass; the summary agrees with the passes."""
    data = json.loads(_ok(runs["inspect_json_training"]))
    passes, summary = data["passes"], data["summary"]
    assert summary["passes_run"] == len(passes) == len(DEFAULT_PIPELINES["training"]) - 1  # no budget given
    for before, after in zip(passes, passes[1:]):
        assert after["estimated"]["flops_before"] == before["estimated"]["flops_after"]
        assert after["nodes_before"] == before["nodes_after"]
    first = passes[0]["estimated"]
    assert first["flops_before"] > 0 and first["saved_bytes_before"] > 0
    assert summary["saved_bytes_before"] == first["saved_bytes_before"]
    assert summary["nodes_before"] == passes[0]["nodes_before"]
    assert summary["sites_refused"] == sum(s["action"] == "refused" for p in passes for s in p["sites"])


def test_inspect_instance_with_chosen_passes(runs):
    """A module instance works as MODEL; --passes runs exactly those passes; inference keeps no saved bytes."""
    data = json.loads(_ok(runs["inspect_json_instance"]))
    assert [p["name"] for p in data["passes"]] == ["fold_conv_bn"]
    assert data["passes"][0]["stats"] == {"folded": 1}
    assert data["passes"][0]["estimated"]["saved_bytes_before"] is None


def test_inspect_two_inputs(runs):
    """--input-shape given twice feeds a two-input model."""
    assert "inputs 2x6, 2x4 (float32)" in _ok(runs["inspect_two_inputs"])


def test_inspect_lists_graph_breaks(runs):
    """A child Dynamo cannot trace whole is listed as a graph break with the line of its code, and the rest is still optimized."""
    out = _ok(runs["inspect_opaque"])
    assert "Graph breaks" in out and "tiny_models.py:" in out and "inplaced: 1" in out


def test_bench_inference(runs):
    """`fxopt bench` prints eager and fxopt median latencies and reports progress on stderr."""
    result = runs["bench_inference"]
    out = _ok(result)
    assert "median latency" in out and "eager" in out and "fxopt" in out
    assert "peak memory" not in out
    assert "fxopt bench: timing" in result.stderr


def test_bench_training_measures_peak(runs):
    """In training, `fxopt bench` also measures each variant's peak memory."""
    out = _ok(runs["bench_training"])
    assert "peak memory" in out
    fxopt_row = next(line for line in out.splitlines() if line.split()[0] == "fxopt" and "bench" not in line)
    assert "KiB" in fxopt_row or " B " in fxopt_row


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line(runs, case):
    """Each bad input exits non-zero with exactly one line on stderr saying what is wrong, never a traceback."""
    _, status, message = BAD_INPUT[case]
    result = runs[case]
    assert result.returncode == status
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr


def test_debug_raises_instead_of_one_line():
    """--debug lets the error through (its traceback shown) instead of the one line."""
    with pytest.raises(FxoptError, match="has no attribute 'Missing'"):
        _main(["inspect", f"{TINY}:Missing", *IMAGE, "--debug"])


@pytest.mark.parametrize("case", list(MORE_BAD_MODELS))
def test_more_bad_models(case):
    """Each of these exits 1 with one line saying what is wrong with MODEL."""
    args, message = MORE_BAD_MODELS[case]
    result = _main(args)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_python_m_fxopt_exits_with_one_line():
    """`python -m fxopt` is the command line: a bad MODEL exits 1 with one line on stderr, no traceback."""
    result = subprocess.run([sys.executable, "-m", "fxopt", "inspect", f"{TINY}:Missing", *IMAGE], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "fxopt: error:" in result.stderr and "has no attribute 'Missing'" in result.stderr


@pytest.mark.skipif(shutil.which("fxopt") is None, reason="the fxopt console script is not installed")
def test_console_script():
    """The `fxopt` console script declared in pyproject runs the same command line."""
    result = subprocess.run(["fxopt", "passes"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "fold_conv_bn" in result.stdout


def test_channels_last_always_keeps_the_rewrite():
    """`--channels-last always` keeps channels_last's rewrite without timing it."""
    assert "converted" in _ok(_main(["inspect", f"{TINY}:TinyConvNet", *IMAGE, "--channels-last", "always",
                                     "--pass", "channels_last"]))
