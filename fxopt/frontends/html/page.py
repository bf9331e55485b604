"""One self-contained HTML page of what fxopt did to a model: opens on the summary, then the memory
timeline of one step before and after the pipeline, the per-pass table, and each pass's graph.

Nothing is fetched when the page opens: the plot and the graphs are inline SVG, the style and the
few lines of script (open a group's view when its box is clicked) are in the page.
"""
from __future__ import annotations

import dataclasses
import html
import pathlib
import re

from ..._version import __version__
from ...pipeline.report import Report
from ..cli_inspect import format_change, format_flops, human_bytes
from .graph_view import ARROW_DEFS, MASK_ACTIONS, NOT_SAVED_ACTIONS, render
from .plot import timeline_svg
from .snapshots import NodeView, Stage
from .timeline import Timeline

MAX_VIEWS_PER_STAGE = 120
MAX_SITE_ROWS = 300


@dataclasses.dataclass
class PageData:
    model: str  # what the user called the model (the CLI's MODEL, or a class name)
    inputs: str  # "8x3x32x32 (float32)"
    report: Report
    timelines: list[Timeline]  # before, after (measured on real tensors)
    stages: list[Stage] = dataclasses.field(default_factory=list)  # captured, then one per pass
    stage_peaks: list[int | None] = dataclasses.field(default_factory=list)  # measured, per stage
    estimates: list[dict] = dataclasses.field(default_factory=list)  # per pass: CostEstimates.around
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # phase -> seconds


def _e(value) -> str:
    return html.escape(str(value))


def _change(before: int | None, after: int | None) -> str:
    return format_change(before, after, human_bytes)


def _movers(data: PageData) -> tuple[str, list[tuple[str, int]]]:
    """(what was compared, [(pass, change)]) for the passes that moved the peak, largest drop first: the
    measured peak after each pass when the whole model is one graph, else the estimated saved bytes."""
    peaks = data.stage_peaks
    if len(peaks) == len(data.report.passes) + 1 and None not in peaks:
        pairs, what = list(zip(peaks, peaks[1:])), "measured peak after each pass"
    elif data.estimates:
        pairs = [(e["saved_bytes_before"], e["saved_bytes_after"]) for e in data.estimates]
        what = "estimated bytes saved for backward (the peak is measured per pass only when the model is one graph)"
    else:
        return "", []
    moves = [(p.name, after - before) for p, (before, after) in zip(data.report.passes, pairs)
             if before is not None and after is not None and after != before]
    return what, sorted(moves, key=lambda m: m[1])


def _summary(data: PageData) -> str:
    report, timelines = data.report, data.timelines
    training = report.mode == "training"
    step = "one training step (forward + backward)" if training else "one forward (inference)"
    sites = [s for p in report.passes for s in p.sites]
    lines = []
    if len(timelines) >= 2:
        before, after = timelines[0], timelines[-1]
        lines.append(f'<p class="big">Peak memory of {step}: <b>{_change(before.peak_bytes, after.peak_bytes)}</b> '
                     f'<span class="how">measured</span></p>')
        lines.append(f"<p>Peak before: {_e(before.describe_peak())}.<br>Peak now: {_e(after.describe_peak())}.</p>")
        what, movers = _movers(data)
        if abs(after.peak_bytes - before.peak_bytes) < 0.01 * before.peak_bytes:
            lines.append("<p>The peak did not move (less than 1%).</p>")
        elif movers:
            text = ", ".join(f"<b>{_e(name)}</b> ({'+' if d > 0 else '−'}{human_bytes(abs(d))})" for name, d in movers)
            lines.append(f'<p>Moved by: {text} <span class="note">({_e(what)})</span>.</p>')
        else:
            lines.append("<p>No pass moved it.</p>")
    changed = sum(not s.refused for s in sites)
    lines.append(f"<p>{len(report.passes)} pass(es), {sum(p.changed for p in report.passes)} changed the model; "
                 f"{changed} site(s) rewritten, {len(sites) - changed} refused; "
                 f"{len(report.graphs)} graph(s) captured, {len(report.graph_breaks)} graph break(s) before it.</p>")
    if data.estimates:
        first, last = data.estimates[0], data.estimates[-1]
        text = f"FLOPs (est.) {format_flops(first['flops_before'])} → {format_flops(last['flops_after'])}"
        if training:
            text += f"; saved for backward (est.) {_change(first['saved_bytes_before'], last['saved_bytes_after'])}"
        lines.append(f"<p>{text}</p>")
    if data.timings:
        lines.append("<p>Time: " + ", ".join(f"{_e(k)} {v:.2f} s" for k, v in data.timings.items()) + "</p>")
    return "\n".join(lines)


def _pass_table(data: PageData) -> str:
    training = data.report.mode == "training"
    peaks = data.stage_peaks if len(data.stage_peaks) == len(data.report.passes) + 1 else []
    if all(p is None for p in peaks):
        peaks = []  # the model is not one graph: no stage can run alone
    estimates = [data.estimates[k] if k < len(data.estimates) else {} for k in range(len(data.report.passes))]

    def flops(index: int, p) -> str:
        est = estimates[index - 1]
        return f"{format_flops(est.get('flops_before'))} → {format_flops(est.get('flops_after'))}" if est else "?"

    def saved(index: int, p) -> str:
        est = estimates[index - 1]
        return _change(est.get("saved_bytes_before"), est.get("saved_bytes_after")) if est else "?"

    extra = {"FLOPs (est.)": flops, **({"saved for backward (est.)": saved} if training else {}),
             **({"peak (measured)": lambda index, p: _change(peaks[index - 1], peaks[index])} if peaks else {})}
    head, rows = data.report.pass_table(extra)
    return _table(head, rows, "passes")


def _table(head: list[str], rows: list[list], cls: str = "") -> str:
    out = [f'<table class="{cls}"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _anchor(stage: int, key: tuple) -> str:
    return f"s{stage}-" + re.sub(r"[^0-9A-Za-z_-]", "_", ".".join(key))


def _stage_views(index: int, stage: Stage, sites, previous: dict[str, NodeView]) -> str:
    """The stage's top view, then one expandable view per group reachable from it."""
    queue: list[tuple] = [()]
    seen = {()}
    sections = []

    def link(unit) -> str | None:
        if not unit.is_group or len(unit.members) < 2:
            return None
        if unit.key not in seen and len(seen) < MAX_VIEWS_PER_STAGE:
            seen.add(unit.key)
            queue.append(unit.key)
        return _anchor(index, unit.key) if unit.key in seen else None

    while queue:
        group = queue.pop(0)
        svg, _ = render(stage.nodes, sites, previous, group, link)
        if group == ():
            sections.append(f'<div class="view top">{svg}</div>')
        else:
            title = ".".join(group)
            sections.append(f'<details class="view" id="{_anchor(index, group)}"><summary>{_e(title)}</summary>'
                            f'{svg}</details>')
    return sections[0] + ('<div class="groups"><p class="note">Module views (click a box above, or open one '
                          'here):</p>' + "".join(sections[1:]) + "</div>" if len(sections) > 1 else "")


def _graphs(data: PageData) -> str:
    if not data.stages:
        return "<p>No graphs were recorded.</p>"
    out = []
    names = [p.name for p in data.report.passes]
    _, movers = _movers(data)
    first_changed = next((k for k, p in enumerate(data.report.passes, start=1) if p.changed), None)
    shown_open = names.index(movers[0][0]) + 1 if movers and movers[0][1] < 0 else first_changed
    for k, stage in enumerate(data.stages):
        if k == 0:
            title, sites, previous = "captured graph (before any pass)", [], {}
        else:
            p = data.report.passes[k - 1]
            sites = p.sites
            previous = {n.name: n for n in data.stages[k - 1].nodes}
            title = f"after {p.name} — {p.what_happened}"
        if k > 0 and not stage.changed and not sites:
            out.append(f'<details class="stage"><summary>{_e(title)} (graph unchanged)</summary></details>')
            continue
        shown = sites[:MAX_SITE_ROWS]
        rows = [[s.node, s.action, s.reason, s.detail] for s in shown]
        more = f"<p>… and {len(sites) - len(shown)} more (see the JSON report)</p>" if len(sites) > len(shown) else ""
        side = _table(["node", "action", "reason", "detail"], rows, "sites") + more if rows else \
            "<p>No sites.</p>"
        is_open = " open" if k == shown_open else ""
        out.append(f'<details class="stage" id="stage-{k}"{is_open}><summary>{_e(title)} '
                   f'({len(stage.nodes)} nodes)</summary><div class="stage-body"><div>'
                   f'{_stage_views(k, stage, sites, previous)}</div><div class="side">{side}</div></div></details>')
    return "\n".join(out)


_LEGEND = (
    '<p class="legend"><span class="k changed">green border: changed by this pass</span> '
    '<span class="k refused">orange badge: refused (reason on hover and in the table)</span> '
    '<span class="k region">dashed blue box: recomputed in backward (checkpointed region)</span> '
    f'<span class="k mark">purple badge: {", ".join(sorted(set(MASK_ACTIONS.values()) | set(NOT_SAVED_ACTIONS.values())))}'
    '</span> Boxes are module groups (execution order, top to bottom; arcs are skip connections); '
    'click a group to open its own view.</p>')

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#666;margin:0 0 12px} .big{font-size:18px} .how{background:#e8f0fe;border-radius:4px;padding:1px 6px;font-size:12px}
#summary{background:#f6f8fa;border:1px solid #ddd;border-radius:8px;padding:4px 16px}
table{border-collapse:collapse;font-size:13px;margin:6px 0} th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f0f0f0} table.sites td:nth-child(2){white-space:nowrap} .side table{width:100%} .side td{word-break:break-word}
details.stage{border:1px solid #ddd;border-radius:6px;margin:8px 0;padding:4px 10px} details>summary{cursor:pointer;font-weight:600}
.stage-body{display:flex;gap:16px;align-items:flex-start;flex-wrap:wrap} .side{flex:1;min-width:380px;max-height:900px;overflow:auto}
details.view{margin:4px 0 4px 12px} details.view>summary{font-weight:500}
svg.graph rect.box{fill:#fafafa;stroke:#999;stroke-width:1} svg.graph .group>rect.box{fill:#eef3fb}
svg.graph .changed>rect.box{stroke:#2ca02c;stroke-width:3} svg.graph .refused>rect.box{stroke:#ff7f0e;stroke-width:2}
svg.graph .changed.refused>rect.box{stroke:#2ca02c}
svg.graph text{font:12px system-ui,sans-serif;fill:#222} svg.graph .summary{font-size:11px;fill:#555}
svg.graph .label{font-weight:600} svg.graph .badge{font-size:10px;fill:#fff;font-weight:600}
svg.graph .region-label{font-size:11px;fill:#1f77b4;font-weight:600}
svg.graph .edge{stroke:#888;stroke-width:1.2;fill:none} svg.graph a.open{cursor:pointer}
svg.graph a.open:hover rect.box{filter:brightness(0.95)}
.legend .k{display:inline-block;margin-right:10px;padding:0 4px;border-radius:3px}
.k.changed{border:2px solid #2ca02c} .k.refused{border:2px solid #ff7f0e} .k.region{border:2px dashed #1f77b4} .k.mark{border:2px solid #9467bd}
.note{color:#666;font-size:12px} .plot svg{max-width:100%;height:auto}
"""

_SCRIPT = """
(function () {
  var body = document.body;
  window.addEventListener('error', function (e) {
    body.dataset.errors = (body.dataset.errors || '') + String(e.message) + '\\n';
  });
  function openView(id) {
    var d = document.getElementById(id);
    for (var p = d; p; p = p.parentElement) { if (p.tagName === 'DETAILS') { p.open = true; } }
    if (d) { d.scrollIntoView({block: 'nearest'}); }
  }
  document.addEventListener('click', function (e) {
    var a = e.target.closest ? e.target.closest('a.open') : null;
    if (!a) { return; }
    e.preventDefault();
    openView(a.getAttribute('href').slice(1));
  });
  body.dataset.ready = String(document.querySelectorAll('svg').length);
})();
"""


def _capture(report: Report) -> str:
    """What TorchDynamo did: why it compiled this graph again, and the graph breaks before it."""
    out = []
    if report.not_optimized:
        out.append(f"<h3>Not optimized</h3><p>{_e(report.not_optimized)}</p>")
    if report.recompile_reason:
        out.append(f"<h3>Compiled again</h3><p>{_e(report.recompile_reason)}</p>")
    if report.graph_breaks:
        out.append("<h3>Graph breaks (the code between graphs runs as Python)</h3>")
        out.append(_table(["where", "Dynamo's reason"], [[where, why] for why, where in report.graph_breaks]))
    return "\n".join(out)


def render_page(data: PageData) -> str:
    training = data.report.mode == "training"
    step = "one training step: forward, then backward" if training else "one forward (inference)"
    plot = timeline_svg(data.timelines, f"Live activation bytes during {step}") if data.timelines else \
        "<p>No timeline was measured.</p>"
    how = ("Measured on real tensors on the example inputs (CPU): after every ATen op, the bytes of the storages "
           "the step created that are still alive (fxopt.measure's dispatch-mode count); parameters, buffers, "
           "inputs and the gradients left after the step are not counted. The per-pass FLOPs and "
           "saved-for-backward figures are estimates from one run on fake tensors.")
    capture = _capture(data.report)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fxopt: {_e(data.model)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head>
<body>
{ARROW_DEFS}
<h1>fxopt inspect {_e(data.model)}</h1>
<p class="sub">{_e(data.report.mode)}, inputs {_e(data.inputs)} · fxopt {_e(__version__)}</p>
<section id="summary"><h2>Summary</h2>{_summary(data)}</section>
<section id="memory"><h2>Memory of {_e(step)}</h2><div class="plot">{plot}</div><p class="note">{_e(how)}</p></section>
<section id="passes"><h2>Passes</h2>{_pass_table(data)}</section>
<section id="graphs"><h2>Graphs, pass by pass</h2>{_LEGEND}{_graphs(data)}</section>
{f'<section id="capture"><h2>Capture</h2>{capture}</section>' if capture else ''}
<script>{_SCRIPT}</script>
</body></html>
"""


def write_page(path: str | pathlib.Path, data: PageData) -> pathlib.Path:
    path = pathlib.Path(path)
    path.write_text(render_page(data), encoding="utf-8")
    return path
