"""A stage's graphs drawn as inline SVG, grouped by module path, with one pass's sites on them.

Layout (ours, no dependency): the graph is cut into at most `MAX_UNITS` units -- module groups,
expanded greedily (largest first) while the cut stays within the limit, so a 300-op transformer
shows as its layers, and a group holding a single op shows as that op. Units go top to bottom in
execution order; an edge to the next unit is a short arrow, a longer one (a residual connection)
an arc on the right. Every group is a link to its own view (a `<details>` below, opened by the
page's script), so any level can be expanded.

Marks: a unit with a site the pass changed has a green border, one it refused an orange badge
(the reasons are in the SVG `<title>`, shown on hover, and in the table beside); a checkpointed
region is a dashed blue box around the units it covers; activations now kept as a bool mask, or
no longer saved for backward, have a purple badge.
"""
from __future__ import annotations

import collections
import dataclasses
import html
import math

from ...passes.base import Site
from .snapshots import NodeView, normalize_path

MAX_UNITS = 40
MASK_ACTIONS = {"masked": "bool mask"}
NOT_SAVED_ACTIONS = {"no_grad": "not saved", "frozen_conv": "input not saved", "frozen_bn": "nothing saved",
                     "detached": "not saved"}
ROW, BOX_H, BOX_W, LEFT, ARC_SPACE = 50, 36, 470, 24, 200


@dataclasses.dataclass
class Unit:
    key: tuple  # a group's module path, or ("#op", node name), or ("#ops", first node name) for a run
    members: list[int]  # indices into the stage's nodes, in order

    @property
    def is_group(self) -> bool:
        return self.key[:1] not in (("#op",), ("#ops",))


def _split(nodes: list[NodeView], group: tuple, members: list[int]) -> list[Unit]:
    """`group`'s members as its child groups and its own ops, in order of first appearance."""
    units: dict[tuple, Unit] = {}
    for i in members:
        path = nodes[i].path
        key = path[:len(group) + 1] if len(path) > len(group) else ("#op", nodes[i].name)
        units.setdefault(key, Unit(key, [])).members.append(i)
    return list(units.values())


def _merge_op_runs(units: list[Unit], shortest: int) -> list[Unit]:
    """Runs of at least `shortest` consecutive single ops become one unit each."""
    merged: list[Unit] = []
    run: list[Unit] = []

    def flush() -> None:
        if len(run) >= shortest:
            merged.append(Unit(("#ops", run[0].key[1]), [i for u in run for i in u.members]))
        else:
            merged.extend(run)
        run.clear()

    for u in units:
        if u.is_group:
            flush()
            merged.append(u)
        else:
            run.append(u)
    flush()
    return merged


def _expand(nodes: list[NodeView], units: list[Unit], chosen: list[Unit]) -> list[Unit]:
    out = []
    for u in units:
        out.extend(_split(nodes, u.key, u.members) if u in chosen else [u])
    return out


def cut(nodes: list[NodeView], group: tuple = (), limit: int = MAX_UNITS) -> list[Unit]:
    """The units to draw for the view of `group`: its children, then the groups of the shallowest
    depth expanded together (all of a level or none, so the layers of a transformer look alike) while
    the view stays within `limit` units; a group with a single child is always expanded."""
    members = [i for i, n in enumerate(nodes) if n.path[:len(group)] == group]
    units = _split(nodes, group, members)
    while True:
        units.sort(key=lambda u: u.members[0])
        single = [u for u in units if u.is_group and len(u.members) > 1 and len(_split(nodes, u.key, u.members)) == 1]
        if single:
            units = _expand(nodes, units, single)
            continue
        groups = [u for u in units if u.is_group and len(u.members) > 1]
        if not groups:
            break
        depth = min(len(u.key) for u in groups)
        level = [u for u in groups if len(u.key) == depth]
        expanded = _merge_op_runs(sorted(_expand(nodes, units, level), key=lambda u: u.members[0]), 3)
        if len(expanded) > limit:
            break
        units = expanded
    units.sort(key=lambda u: u.members[0])
    units = _merge_op_runs(units, 3 if any(u.is_group for u in units) else limit + 1)
    return _merge_op_runs(units, 2) if len(units) > limit else units


def _unit_title(u: Unit, nodes: list[NodeView], group: tuple) -> tuple[str, str]:
    """(bold label, small summary line)."""
    if len(u.members) == 1 and u.key[0] != "#ops":
        n = nodes[u.members[0]]
        where = ".".join(n.path[len(group):])
        return (f"{where}: {n.label}" if where and where != n.label else n.label), n.shape
    counts = collections.Counter(nodes[i].label for i in u.members)
    ops = ", ".join(f"{label}×{k}" if k > 1 else label for label, k in counts.most_common(5))
    more = ", …" if len(counts) > 5 else ""
    name = ".".join(u.key[len(group):]) if u.is_group else f"{len(u.members)} ops"
    return name or "(model)", f"{len(u.members)} ops: {ops}{more}"


def _site_text(site: Site) -> str:
    text = f"{site.node}: {site.action}"
    if site.reason:
        text += f" ({site.reason})"
    if site.detail:
        text += f" — {site.detail}"
    return text


@dataclasses.dataclass
class _Marks:
    changed: list[Site] = dataclasses.field(default_factory=list)
    refused: list[Site] = dataclasses.field(default_factory=list)
    badges: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _marks(units: list[Unit], nodes: list[NodeView], sites: list[Site],
           previous: dict[str, NodeView]) -> list[_Marks]:
    """What each unit shows of `sites`: a site on a node of the unit, or on a node the pass removed
    from a module the unit covers."""
    unit_of = {nodes[i].name: k for k, u in enumerate(units) for i in u.members}
    region_units = collections.defaultdict(set)  # a site may name a region: it marks every unit the region covers
    for k, u in enumerate(units):
        for i in u.members:
            if nodes[i].region:
                region_units[nodes[i].region].add(k)
    marks = [_Marks() for _ in units]
    for site in sites:
        where = {unit_of[site.node]} if site.node in unit_of else region_units.get(site.node, set())
        if not where and site.node in previous:
            path = previous[site.node].path
            where = {j for j, u in enumerate(units) if u.is_group and path[:len(u.key)] == u.key}
        if not where and (path := normalize_path(site.node)):  # a site named by module path (torch.export)
            where = {k for k, u in enumerate(units) if any(nodes[i].path[:len(path)] == path for i in u.members)}
        for k in sorted(where):  # units never nest, so a removed node's module is one unit at most
            (marks[k].refused if site.refused else marks[k].changed).append(site)
            badge = MASK_ACTIONS.get(site.action) or NOT_SAVED_ACTIONS.get(site.action)
            if badge:
                marks[k].badges[badge] += 1
    return marks


def _badge(x: float, y: float, text: str, color: str) -> tuple[str, float]:
    width = 7 * len(text) + 10
    svg = (f'<rect class="b" x="{x - width:.0f}" y="{y}" width="{width}" height="15" rx="7" style="fill:{color}"/>'
           f'<text x="{x - width / 2:.0f}" y="{y + 11}" text-anchor="middle" class="badge">{html.escape(text)}</text>')
    return svg, x - width - 4


def _regions(units: list[Unit], nodes: list[NodeView]) -> dict[str, tuple[int, int, int]]:
    """Region name -> (first unit row, last unit row, nodes in it)."""
    rows: dict[str, list[int]] = collections.defaultdict(list)
    for k, u in enumerate(units):
        for i in u.members:
            if nodes[i].region:
                rows[nodes[i].region].append(k)
    return {name: (min(r), max(r), len(r)) for name, r in rows.items()}


ARROW_DEFS = ('<svg width="0" height="0" style="position:absolute"><defs><marker id="arrow" viewBox="0 0 8 8" '
              'refX="7" refY="4" markerWidth="6" markerHeight="6" orient="auto"><path d="M0,0 L8,4 L0,8 z" '
              'fill="#777"/></marker></defs></svg>')  # once per page; every graph's edges point to it


def _top(row: int) -> float:
    return 10 + row * ROW


def _edges(units: list[Unit], nodes: list[NodeView]) -> set[tuple[int, int]]:
    """(row, row) pairs where a unit reads a tensor another unit made."""
    row_of = {i: k for k, u in enumerate(units) for i in u.members}
    by_name = {n.name: i for i, n in enumerate(nodes)}
    edges = set()
    for k, u in enumerate(units):
        for i in u.members:
            for name in nodes[i].inputs:
                j = by_name.get(name)
                if j is not None and j in row_of and row_of[j] != k and nodes[j].makes_tensor:
                    edges.add((row_of[j], k))
    return edges


def _edge_svg(a: int, b: int) -> str:
    if b == a + 1:
        x = LEFT + BOX_W / 2
        return f'<line x1="{x}" y1="{_top(a) + BOX_H}" x2="{x}" y2="{_top(b) - 1}" class="edge" marker-end="url(#arrow)"/>'
    x = LEFT + BOX_W
    bulge = min(ARC_SPACE - 20, 16 + 14 * math.log2(abs(b - a)))
    ya, yb = _top(a) + BOX_H / 2, _top(b) + BOX_H / 2
    return (f'<path d="M{x},{ya} C{x + bulge},{ya} {x + bulge},{yb} {x + 2},{yb}" class="edge arc" '
            f'marker-end="url(#arrow)"/>')


def _region_svg(number: int, name: str, first: int, last: int, count: int) -> str:
    y0, y1 = _top(first) - 6, _top(last) + BOX_H + 6
    return (f'<g class="region"><title>{html.escape(name)}: {count} op(s) recomputed in backward</title>'
            f'<rect x="{LEFT - 10}" y="{y0}" width="{BOX_W + 20}" height="{y1 - y0}" rx="8" fill="#1f77b4" '
            f'fill-opacity="0.06" stroke="#1f77b4" stroke-width="2" stroke-dasharray="6 4"/>'
            f'<text x="{LEFT + BOX_W + 14}" y="{y0 + 12}" class="region-label">↻ region {number} · {count} op(s)'
            f'</text></g>')


def _unit_svg(row: int, u: Unit, m: _Marks, nodes: list[NodeView], group: tuple, anchor: str | None) -> str:
    y = _top(row)
    label, summary = _unit_title(u, nodes, group)
    cls = "unit" + (" group" if u.is_group or u.key[0] == "#ops" else "") + (" changed" if m.changed else "") \
        + (" refused" if m.refused else "")
    tooltip = [label, summary] + [_site_text(s) for s in m.changed + m.refused]
    tooltip += [f"{nodes[i].name}: {nodes[i].label} {nodes[i].shape}".rstrip() for i in u.members[:40]]
    if len(u.members) > 40:
        tooltip.append(f"… and {len(u.members) - 40} more")
    badges, x = [], LEFT + BOX_W - 6
    for text, color in ([(f"✓ {s.action}", "#2ca02c") for s in _first_actions(m.changed)]
                        + ([(f"✗ refused {len(m.refused)}", "#ff7f0e")] if m.refused else [])
                        + [(f"{b}" + (f" ×{c}" if c > 1 else ""), "#9467bd") for b, c in m.badges.items()]):
        svg, x = _badge(x, y + 3, text, color)
        badges.append(svg)
    room = max(8, int((x - LEFT - 8) / 7))  # characters of the bold label that fit left of the badges
    shown = label if len(label) <= room else label[:room - 1] + "…"
    body = (f'<title>{html.escape(chr(10).join(tooltip))}</title>'
            f'<rect class="box" x="{LEFT}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="5"/>'
            f'<text x="{LEFT + 8}" y="{y + 15}" class="label">{html.escape(shown)}</text>'
            f'<text x="{LEFT + 8}" y="{y + 29}" class="summary">{html.escape(summary[:80])}</text>' + "".join(badges))
    unit = f'<g class="{cls}">{body}</g>'
    return f'<a href="#{anchor}" class="open">{unit}</a>' if anchor else unit


def render(nodes: list[NodeView], sites: list[Site], previous: dict[str, NodeView], group: tuple,
           link) -> tuple[str, list[Unit]]:
    """The SVG of `group`'s view and its units; `link(unit)` gives the anchor of a group's own view
    (or None). Regions go under the boxes, then the edges, then the boxes."""
    units = cut(nodes, group)
    marks = _marks(units, nodes, sites, previous)
    height, width = 16 + len(units) * ROW, LEFT + BOX_W + ARC_SPACE
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}">']
    parts += [_region_svg(number, name, *rows) for number, (name, rows) in
              enumerate(_regions(units, nodes).items(), start=1)]
    parts += [_edge_svg(a, b) for a, b in sorted(_edges(units, nodes))]
    parts += [_unit_svg(k, u, m, nodes, group, link(u)) for k, (u, m) in enumerate(zip(units, marks))]
    parts.append("</svg>")
    return "".join(parts), units


def _first_actions(sites: list[Site]) -> list[Site]:
    """One site per action (the badge says what happened; the count is in the title)."""
    seen: dict[str, Site] = {}
    for s in sites:
        seen.setdefault(s.action, s)
    return list(seen.values())[:2]
