"""The HTML page (`fxopt inspect --html`, `optimize_and_explain`): what it measures, what it draws,
and that a real browser renders it.

The browser test opens the page in headless Chromium (Debian package `chromium`, installed by
`make install-browser`, which CI runs) and reads back the DOM after the page's script ran: the
script marks `<body data-ready>` when it finished and records any script error in
`<body data-errors>`, so a page that fails to render or throws is seen without a DevTools session.
"""
from __future__ import annotations

import pathlib
import random
import re
import shutil
import subprocess

import numpy
import pytest
import torch
import torch.nn as nn

from fxopt.frontends.html import optimize_and_explain
from fxopt.frontends.html.graph_view import MAX_UNITS, cut
from fxopt.frontends.html.snapshots import NodeView, normalize_path
from fxopt.frontends.html.timeline import measure_timeline
from fxopt.measure import measure_peak
from tests.fixtures.rude_models import DeepMLP
from expected_warnings import budget_may_be_unmet

pytest.importorskip("matplotlib", reason='the HTML page needs matplotlib: pip install "fxopt[report]"')


def _chromium() -> str | None:
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)


class Net(nn.Module):
    """Conv-BN-ReLU then eight Linear-LayerNorm-GELU blocks: every pass has something to do."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.mlp = DeepMLP()
        self.proj = nn.Linear(8 * 4 * 4, 32)

    def forward(self, x):
        return self.mlp(self.proj(self.relu(self.bn(self.conv(x))).flatten(1)))


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> pathlib.Path:
    torch.manual_seed(0)
    model = Net().train()
    model.bn.eval()
    path = tmp_path_factory.mktemp("html") / "page.html"
    with budget_may_be_unmet():
        optimize_and_explain(model, torch.randn(16, 3, 4, 4), path, mode="training", memory_budget=0.5)
    return path


def test_timeline_peak_is_the_measured_peak():
    """The timeline's peak is the peak fxopt.measure measures for the same step, and the caller's
    gradients and BatchNorm statistics are left as they were."""
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(16, 3, 4, 4)
    stats = model.bn.running_mean.clone()
    timeline = measure_timeline(model, (x,), training=True, label="eager")
    assert model.bn.running_mean.equal(stats) and all(p.grad is None for p in model.parameters())
    peak = measure_peak(lambda: model(x).float().sum().backward(), model, (x,))
    assert timeline.peak_bytes == peak
    phases = [p.phase for p in timeline.points]
    assert phases[0] == "forward" and phases[-1] == "backward"
    assert any(p.where.startswith("mlp.blocks") for p in timeline.points if p.phase == "backward")


def test_timeline_leaves_python_and_numpy_generators():
    """A step the timeline runs leaves Python's and NumPy's global generators where the caller had them."""
    model = nn.Linear(4, 4)
    model.forward = lambda x: nn.Linear.forward(model, x) * random.random() * float(numpy.random.rand())
    random.seed(5)
    numpy.random.seed(5)
    expected = (random.random(), float(numpy.random.rand()))
    random.seed(5)
    numpy.random.seed(5)
    measure_timeline(model, (torch.randn(2, 4),), training=True, label="eager")
    assert (random.random(), float(numpy.random.rand())) == expected


def test_inference_timeline_is_forward_only():
    """In inference the timeline has the forward only."""
    model = Net().eval()
    timeline = measure_timeline(model, (torch.randn(2, 3, 4, 4),), training=False, label="eager")
    assert timeline.backward_start is None and timeline.peak_bytes > 0


def test_page_is_self_contained(page):
    """Nothing on the page is fetched: no external scripts, styles, images or fonts."""
    text = page.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)
    assert "<link" not in text and "@import" not in text and "url(http" not in text


def test_page_opens_on_the_summary_then_plot_table_graphs(page):
    """Summary first; the plot has both curves labelled and the peak marked; the page says it is measured."""
    text = page.read_text()
    order = [text.index(f'id="{s}"') for s in ("summary", "memory", "passes", "graphs")]
    assert order == sorted(order)
    summary = text[order[0]:order[1]]
    assert "Peak memory of one training step" in summary and "measured" in summary
    assert "Moved by: <b>checkpoint_activations</b>" in summary
    plot = text[order[1]:order[2]]
    assert "before fxopt: peak" in plot and "after fxopt: peak" in plot and "backward starts" in plot
    assert "Measured on real tensors" in plot


def test_graph_marks_sites_regions_and_masks(page):
    """The graphs show changed and refused sites with reasons, checkpointed regions as boxes."""
    text = page.read_text()
    assert 'class="region"' in text and "recomputed in backward" in text
    assert "unit group changed" in text or "unit changed" in text
    assert "✓ folded" in text and "✓ checkpointed" in text
    assert re.search(r"<title>[^<]*relu: refused \(", text) or "refused" in text


def _view_of_a_transformer(layers: int = 12) -> list[NodeView]:
    """A 300-op transformer as an exported graph would name it (nn_module_stack paths)."""
    nodes, previous = [], "input"
    for layer in range(layers):
        for module, ops in (("attention.self.query", 1), ("attention.self.key", 1), ("attention.self.value", 1),
                            ("attention.self", 8), ("attention.output.dense", 1), ("attention.output.LayerNorm", 3),
                            ("intermediate.dense", 1), ("intermediate", 1), ("output.dense", 1),
                            ("output.LayerNorm", 3), ("output", 4)):
            for k in range(ops):
                name = f"l{layer}_{module.replace('.', '_')}_{k}"
                path = normalize_path(f"encoder.layer.{layer}.{module}")
                nodes.append(NodeView(name, "op", path, (previous,)))
                previous = name
    return nodes


def test_a_large_transformer_stays_legible():
    """A 300-op transformer's top view is at most MAX_UNITS boxes, its layers alike; each layer opens."""
    nodes = _view_of_a_transformer()
    assert len(nodes) == 300
    units = cut(nodes)
    assert len(units) <= MAX_UNITS
    per_layer = {}
    for u in units:
        assert u.is_group and u.key[:2] == ("encoder", "layer")
        per_layer.setdefault(u.key[2], []).append(u.key[3:])
    assert list(per_layer) == [str(k) for k in range(12)]
    assert all(keys == per_layer["0"] for keys in per_layer.values())  # every layer drawn alike
    inner = cut(nodes, ("encoder", "layer", "0"))
    assert 3 <= len(inner) <= MAX_UNITS


def test_module_paths_of_every_graph_form():
    """torch.export, Dynamo and torch.fx spell module paths differently; they read the same."""
    for text in ("encoder.layer.0", "L['self'].encoder.layer[0]", "L['self'].encoder.layer['0']"):
        assert normalize_path(text) == ("encoder", "layer", "0")


@pytest.mark.skipif(_chromium() is None, reason="no chromium found (CI installs it: make install-browser)")
def test_page_renders_in_headless_chromium(page, tmp_path):
    """Headless Chromium runs the page's script to the end without an error, with the plot and the graphs
    drawn; a page whose script throws is caught the same way (the check can fail)."""
    browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]

    def dom(path: pathlib.Path) -> str:
        result = subprocess.run([*browser, "--dump-dom", path.as_uri()], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    rendered = dom(page)
    ready = re.search(r'<body[^>]*data-ready="(\d+)"', rendered)
    assert ready and int(ready.group(1)) >= 2, "the page's script did not finish"
    assert "data-errors" not in rendered
    assert re.search(r'<svg[^>]*class="graph"', rendered) and "before fxopt: peak" in rendered

    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("<script>", "<script>undefinedFunction();", 1))
    assert 'data-ready="' not in dom(broken)

    shot = tmp_path / "page.png"
    subprocess.run([*browser, "--window-size=1400,1800", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000


def test_cli_writes_the_page(tmp_path, monkeypatch, capsys):
    """`fxopt inspect ... --html FILE` writes the page and says where."""
    from fxopt.frontends.cli import main

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    out = tmp_path / "seed.html"
    assert main(["inspect", "examples/seed_net.py:SeedNet", "--input-shape", "2x3x32x32", "--html", str(out)]) == 0
    assert f"HTML report: {out}" in capsys.readouterr().out
    text = out.read_text()
    assert "Peak memory of one forward (inference)" in text and "✓ folded" in text


def test_missing_matplotlib_names_the_extra(monkeypatch):
    """Without matplotlib the page cannot be drawn: the error names the extra to install."""
    import fxopt
    from fxopt.frontends.html.plot import check_matplotlib

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(fxopt.FxoptError, match=r'pip install "fxopt\[report\]"'):
        check_matplotlib()


class Wrapper(nn.Module):
    """Calls a graph module it holds, as a result with guards does."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.graph_module = inner

    def forward(self, x):
        return self.graph_module(x)


def test_exported_graph_ops_are_attributed_to_modules():
    """An exported graph of ATen ops (torch.export, nn_module_stack on each node) gets the same peak as
    the eager model, with its ops attributed to the modules the graph recorded."""
    torch.manual_seed(0)
    model, x = DeepMLP().train(), torch.randn(4, 32)
    exported = torch.export.export(model, (x,), strict=False).module()
    eager = measure_timeline(model, (x,), training=True, label="eager")
    for runs_graph in (exported, Wrapper(exported)):
        graph = measure_timeline(runs_graph, (x,), training=True, label="exported")
        assert graph.peak_bytes == eager.peak_bytes
        forward = {p.where for p in graph.points if p.phase == "forward"}
        backward = {p.where for p in graph.points if p.phase == "backward"}
        assert "blocks.3.1" in forward and "blocks.3.1" in backward  # the fourth block's LayerNorm
    assert "forward" not in vars(exported)  # the graph runs its generated code again


def test_export_stand_in_for_no_module_is_the_model():
    """torch.export's `_empty_nn_module_stack...` entry means the model itself, not a module of that name."""
    assert normalize_path("_empty_nn_module_stack_from_metadata_hook") == ()


class ReluThenAdd(nn.Module):
    """A ReLU whose output only an add reads: inplace_relu keeps a bool mask for its backward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.relu = nn.ReLU()

    def forward(self, x):
        return (self.relu(self.fc(x)) + 1).sum()


def test_mask_is_marked(tmp_path):
    """An activation now kept as a bool mask has the mask badge on its box, with the pass's reason on hover."""
    path = tmp_path / "mask.html"
    optimize_and_explain(ReluThenAdd().train(), torch.randn(4, 8), path, mode="training")
    text = path.read_text()
    assert "bool mask" in text.split('id="graphs"')[1].split("</p>", 1)[1]  # on a box, not only in the legend
    assert "relu: masked — keeps a bool mask" in text
