"""fxopt.save / fxopt.load: an optimized model on disk and back, and a clear error for any other file."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxopt

X = torch.randn(2, 3, 8, 8)


def _result():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    return fxopt.optimize(model, X)


def test_round_trip_computes_the_same(tmp_path):
    """What fxopt.load gives back is the optimized model (its options kept; it compiles on its first call), computing
    the same outputs bit for bit."""
    result = _result()
    fxopt.save(result, tmp_path / "m.pt")
    loaded = fxopt.load(tmp_path / "m.pt")
    assert type(loaded) is type(result) and loaded.fxopt_report is None
    torch.testing.assert_close(loaded(X), result(X), rtol=0, atol=0)
    assert [p.name for p in loaded.fxopt_report.passes] == [p.name for p in result.fxopt_report.passes]


def test_a_torch_save_file_is_refused_with_what_to_do(tmp_path):
    """A file torch.save wrote (a state_dict) is an FxoptError saying to use torch.load, before its pickle runs."""
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / "weights.pt")
    with pytest.raises(fxopt.FxoptError, match="not a file written by fxopt.save .*load it with torch.load"):
        fxopt.load(tmp_path / "weights.pt")


def test_a_file_that_is_not_an_archive_is_refused(tmp_path):
    """A file that is not a torch archive at all, or no file, is an FxoptError naming it."""
    (tmp_path / "notes.pt").write_text("hello")
    with pytest.raises(fxopt.FxoptError, match="not a torch.save archive"):
        fxopt.load(tmp_path / "notes.pt")
    with pytest.raises(fxopt.FxoptError, match="no such file"):
        fxopt.load(tmp_path / "missing.pt")


def test_save_takes_only_an_optimized_model(tmp_path):
    """fxopt.save of a plain module says it takes what fxopt.optimize returned."""
    with pytest.raises(fxopt.FxoptError, match="takes what fxopt.optimize returned, got a Linear"):
        fxopt.save(nn.Linear(2, 2), tmp_path / "m.pt")
