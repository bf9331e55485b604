"""The command line as a new user meets it: their scripts exit, parse argv and print; they mistype
options, give files where folders go, and forget --dtype int64. Each gets one clear line.

Most cases run through `main()` in this process (the same code path as the console script,
without paying a torch import each); what needs a fresh interpreter runs as a subprocess.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from fxopt.frontends.cli import main
from fxopt.frontends.cli_args import DTYPE_NAMES, MODES
from fxopt.frontends.cli_loading import DTYPES
from fxopt.passes.base import MODES as PASS_MODES
from fxopt.pipeline.pipelines import DEFAULT_PIPELINES

REPO = pathlib.Path(__file__).resolve().parents[1]
RUDE = "tests/fixtures/rude_models.py"
TINY = "tests/fixtures/tiny_models.py"


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))  # loading a model file puts its folder on sys.path


def _error(capsys, args: list[str]) -> str:
    """Run `fxopt ARGS`, expect exit status 1 and one line on stderr; return it."""
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error" not in err, err
    return err


def test_parser_lists_match_the_real_ones():
    """The torch-free argument lists (parsed before torch loads) name the same modes and dtypes as fxopt."""
    assert set(MODES) == set(PASS_MODES) == set(DEFAULT_PIPELINES)
    assert tuple(DTYPES) == DTYPE_NAMES


@pytest.mark.parametrize("args", [["--help"], ["inspct"], ["inspect", "m.py:Net", "--input-shape", "2", "--verfy"]])
def test_answers_before_importing_torch(args):
    """`fxopt --help` and a mistyped command answer before torch (and Dynamo) are imported."""
    code = (f"import sys\nfrom fxopt.frontends.cli import main\ntry:\n    main({args!r})\nexcept SystemExit:\n"
            "    pass\nprint('torch imported:', 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "torch imported: False" in result.stdout
    assert "inspect" in result.stdout if args == ["--help"] else "fxopt: error:" in result.stderr


def test_sys_exit_at_import_is_an_error_naming_the_file(in_repo, capsys):
    """A model file that calls sys.exit(0) at import is an error naming the file, not a silent exit 0."""
    err = _error(capsys, ["inspect", "tests/fixtures/exits_at_import.py:Net", "--input-shape", "2x3"])
    assert "tests/fixtures/exits_at_import.py" in err and "sys.exit(0)" in err and "__main__" in err


def test_system_exit_in_forward_is_an_error(in_repo, capsys):
    """A forward that raises SystemExit is an error naming the model, not an exit with its status."""
    err = _error(capsys, ["inspect", f"{RUDE}:ExitsInForward", "--input-shape", "2x3"])
    assert "sys.exit(3)" in err and "the model rejects inputs" in err


def test_user_code_sees_a_clean_argv(in_repo, capsys):
    """A file that parses sys.argv at import sees only its own name, not fxopt's arguments."""
    assert main(["inspect", "tests/fixtures/parses_argv.py:Net", "--input-shape", "2x3", "--json"]) == 0
    module = sys.modules["_fxopt_model_parses_argv"]
    assert module.SEEN_ARGV == ["tests/fixtures/parses_argv.py"]
    assert sys.argv[0] != "tests/fixtures/parses_argv.py"  # restored


def test_model_prints_stay_off_json_stdout(in_repo, capsys):
    """What the model prints goes to stderr under --json, so stdout parses as JSON."""
    assert main(["inspect", f"{RUDE}:Chatty", "--input-shape", "2x3", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["model"] == f"{RUDE}:Chatty"
    assert "forward called with" in captured.err


def test_file_as_dump_dir(in_repo, capsys, tmp_path):
    """A file given as --dump-dir says so, before any work."""
    existing = tmp_path / "notes.txt"
    existing.write_text("x")
    err = _error(capsys, ["inspect", f"{TINY}:TinyConvNet", "--input-shape", "2x3x8x8", "--dump-dir", str(existing)])
    assert "is a file, not a folder" in err


def test_folder_as_html_page(in_repo, capsys, tmp_path):
    """A folder given as --html, or a file in a missing folder, is said at once, before any work."""
    args = ["inspect", f"{TINY}:TinyConvNet", "--input-shape", "2x3x8x8", "--html"]
    assert "is a folder: give a file name" in _error(capsys, [*args, str(tmp_path)])
    assert "does not exist" in _error(capsys, [*args, str(tmp_path / "missing" / "page.html")])


def test_huge_input_shape(in_repo, capsys):
    """An input larger than the machine's memory is refused with its size, never allocated."""
    err = _error(capsys, ["inspect", f"{TINY}:TinyConvNet", "--input-shape", "100000x3x1000x1000"])
    assert "GiB for the inputs alone" in err and "100000x3x1000x1000" in err


@pytest.mark.parametrize("budget", ["1", "1.0"])
def test_budget_one_is_the_whole_peak(in_repo, capsys, budget):
    """--memory-budget 1 and 1.0 both mean the fraction 1 (no recomputation needed), not one byte."""
    assert main(["inspect", f"{RUDE}:DeepMLP", "--input-shape", "4x32", "--mode", "training", "--memory-budget",
                 budget, "--json"]) == 0
    passes = {p["name"]: p for p in json.loads(capsys.readouterr().out)["passes"]}
    figures = passes["checkpoint_activations"]["figures"]
    assert figures["budget_bytes"] >= figures["peak_estimate_before"]
    assert passes["checkpoint_activations"]["stats"].get("checkpointed", 0) == 0


def test_bare_byte_count_needs_a_unit(in_repo, capsys):
    """A bare number above 1 is not taken as bytes: the message asks for a unit."""
    err = _error(capsys, ["inspect", f"{RUDE}:DeepMLP", "--input-shape", "4x32", "--mode", "training",
                          "--memory-budget", "300000000"])
    assert "not a fraction in (0, 1]" in err and "512MB" in err


def test_python_api_same_budget_rule():
    """fxopt.optimize reads memory_budget by the same rule: 1 is the fraction, bytes need a unit."""
    import torch

    import fxopt
    from tests.fixtures.rude_models import DeepMLP

    model, x = DeepMLP().train(), torch.randn(4, 32)
    report = fxopt.optimize(model, x, mode="training", memory_budget=1).fxopt_report
    assert report["checkpoint_activations"].stats.get("checkpointed", 0) == 0
    with pytest.raises(fxopt.FxoptError, match="give bytes with a unit"):
        fxopt.optimize(model, x, mode="training", memory_budget=300_000_000)
    with pytest.warns(UserWarning, match=r"memory_budget '1KB' .* NOT met.*give memory_budget='\d+KB' or more"):
        report = fxopt.optimize(model, x, mode="training", memory_budget="1KB").fxopt_report
    assert report["checkpoint_activations"].figures["budget_bytes"] == 1000


def test_budget_without_training_says_add_mode(in_repo, capsys):
    """--memory-budget in inference mode tells the user to add --mode training."""
    err = _error(capsys, ["inspect", f"{RUDE}:DeepMLP", "--input-shape", "4x32", "--memory-budget", "0.5"])
    assert "add --mode training" in err


def test_unmet_budget_is_one_warning_line(in_repo, capsys):
    """An unmet --memory-budget is one `fxopt: warning:` line on stderr saying the budget that is met."""
    assert main(["inspect", f"{RUDE}:DeepMLP", "--input-shape", "4x32", "--mode", "training",
                 "--memory-budget", "0.01"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fxopt: warning: memory_budget 0.01"), err
    assert "or more, or a smaller batch" in err[0]


def test_token_model_suggests_int64(in_repo, capsys):
    """A model that wants integer token ids, given floats, gets the hint --dtype int64."""
    err = _error(capsys, ["inspect", f"{RUDE}:TokenModel", "--input-shape", "2x5"])
    assert "--dtype int64" in err


def test_one_dtype_per_input_and_int_range(in_repo, capsys):
    """--dtype once per input gives each its dtype; --int-high bounds generated token ids."""
    assert main(["inspect", f"{RUDE}:IdsAndMask", "--input-shape", "2x5", "--input-shape", "2x5",
                 "--dtype", "int64", "--dtype", "float32", "--int-high", "1000", "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert [i["dtype"] for i in inputs] == ["int64", "float32"]
    err = _error(capsys, ["inspect", f"{RUDE}:IdsAndMask", "--input-shape", "2x5", "--input-shape", "2x5",
                          "--dtype", "int64", "--dtype", "float32", "--dtype", "int64"])
    assert "--dtype given 3 times for 2 --input-shape" in err


def test_int_high_above_the_vocabulary_says_how_high(in_repo, capsys):
    """Token ids beyond an embedding's rows name its size and the --int-high to give, not --dtype int64 again."""
    err = _error(capsys, ["inspect", f"{RUDE}:TokenModel", "--input-shape", "2x5", "--dtype", "int64",
                          "--int-high", "1000"])
    assert "IndexError" in err and "give --int-high 50 or less" in err and "--dtype" not in err


def test_mixed_dtypes_are_named_per_input(in_repo, capsys):
    """With inputs of several dtypes, inspect's header names each input's dtype."""
    assert main(["inspect", f"{RUDE}:IdsAndMask", "--input-shape", "2x5", "--input-shape", "2x5",
                 "--dtype", "int64", "--dtype", "float32", "--int-high", "1000"]) == 0
    assert "inputs 2x5 (int64), 2x5 (float32)," in capsys.readouterr().out


def test_model_file_that_is_not_python(in_repo, capsys, tmp_path, monkeypatch):
    """A MODEL file without the .py suffix, by path or by bare name, says it is not a Python file and how MODEL is
    written."""
    (tmp_path / "notpy.txt").write_text("x = 1\n")
    err = _error(capsys, ["inspect", f"{tmp_path / 'notpy.txt'}:Net", "--input-shape", "2x3"])
    assert "not a Python file; MODEL is 'path/to/file.py:attr'" in err
    monkeypatch.chdir(tmp_path)
    assert "'notpy.txt': not a Python file" in _error(capsys, ["inspect", "notpy.txt:Net", "--input-shape", "2x3"])


def test_model_with_two_colons(in_repo, capsys):
    """MODEL with a second ':' says so and writes the dotted form it probably means."""
    err = _error(capsys, ["inspect", f"{TINY}:TinyConvNet:conv", "--input-shape", "2x3x8x8"])
    assert "has more than one ':'" in err and f"'{TINY}:TinyConvNet.conv'" in err


def test_generated_token_ids_stay_below_int_high():
    """make_inputs draws integer inputs from [0, int_high)."""
    from fxopt.frontends.cli_loading import make_inputs

    (ids,) = make_inputs([(64, 64)], ["int64"], int_high=7)
    assert ids.min() >= 0 and ids.max() == 6


@pytest.mark.parametrize("typo, suggestion", [("--memory-budjet", "--memory-budget"), ("--verfy", "--verify")])
def test_misspelled_option_gets_a_suggestion(capsys, typo, suggestion):
    """A misspelled command-line option is answered with the option it resembles."""
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", f"{TINY}:TinyConvNet", "--input-shape", "2x3x8x8", typo, "0.5"])
    assert exit_.value.code == 2
    assert f"did you mean {suggestion}?" in capsys.readouterr().err


@pytest.mark.parametrize("typo, suggestion", [("memory_budjet", "memory_budget"), ("verfy", "verify")])
def test_misspelled_keyword_in_python_gets_a_suggestion(typo, suggestion):
    """fxopt.optimize answers a misspelled keyword with the one it resembles."""
    import torch

    import fxopt

    with pytest.raises(fxopt.FxoptError, match=f"did you mean {suggestion}"):
        fxopt.optimize(torch.nn.Linear(2, 2).train(), torch.randn(1, 2), **{typo: 0.5})


def test_site_filters(in_repo, capsys):
    """--only refused / --pass NAME keep only those rows of the site table; an unknown --pass is an error."""
    args = ["inspect", f"{TINY}:TinyConvNet", "--input-shape", "2x3x8x8", "--mode", "training"]
    assert main([*args, "--only", "refused"]) == 0
    out = capsys.readouterr().out
    assert "bn_training" in out and "inplaced" not in out.split("Summary")[0].split("pass      ")[-1]
    assert main([*args, "--pass", "inplace_relu"]) == 0
    sites = capsys.readouterr().out.split("\n\n")[2]
    assert "inplace_relu" in sites and "fold_conv_bn" not in sites
    err = _error(capsys, [*args, "--pass", "fold_everything"])
    assert "no such pass ran" in err


def test_summary_separates_capture_passes_and_estimates(in_repo, capsys):
    """inspect's summary says how long capture, the passes and the estimates took, separately."""
    assert main(["inspect", f"{TINY}:TinyConvNet", "--input-shape", "2x3x8x8"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "capture and checks" in summary and "passes" in summary and "estimates" in summary


def test_bench_shows_spread(in_repo, capsys):
    """bench shows min, quartiles and max of the rounds, and peaks to the byte."""
    assert main(["bench", f"{TINY}:TinyConvNet", "--input-shape", "2x3x8x8", "--mode", "training",
                 "--repeats", "4", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "min" in out and "q1–q3" in out and "max" in out and "4 timed rounds" in out
    assert " B)" in out  # exact bytes beside the rounded figure


def test_bench_threads(in_repo, capsys, monkeypatch):
    """bench times with one torch thread unless --threads says otherwise, says which in its header, and restores
    the caller's thread count."""
    import torch

    from fxopt.frontends import cli_bench

    seen, run_bench = [], cli_bench.run_bench
    monkeypatch.setattr(cli_bench, "run_bench", lambda *a: seen.append(torch.get_num_threads()) or run_bench(*a))
    before = torch.get_num_threads()
    args = ["bench", f"{TINY}:TinyConvNet", "--input-shape", "2x3x8x8", "--repeats", "1", "--warmup", "0"]
    assert main(args) == 0
    assert "1 torch thread(s) (the default on CPU; --threads N for more)" in capsys.readouterr().out
    assert main([*args, "--threads", "2"]) == 0
    assert "2 torch thread(s) (--threads)" in capsys.readouterr().out
    assert seen == [1, 2] and torch.get_num_threads() == before
    assert "--threads must be at least 1" in _error(capsys, [*args, "--threads", "0"])


def test_progress_on_a_terminal_is_one_line_cleared_at_the_end():
    """On a terminal, progress is one status line with the time elapsed, rewritten and cleared at the end."""
    import io

    from fxopt.frontends.cli_progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = Progress("fxopt inspect", lines=False, stream=stream)
    progress.status("capturing the model")
    progress.phase("pass 1 (fold_conv_bn) done")
    progress.finish()
    text = stream.getvalue()
    assert "fxopt inspect: capturing the model [0.0 s]" in text and "\n" not in text
    assert text.endswith("\r\033[K")
    log = io.StringIO()
    Progress("fxopt inspect", lines=False, stream=log).status("capturing")
    assert log.getvalue() == ""  # not a terminal, no log lines asked for: an error stays one line
