"""The plots of a leaderboard: accuracy against parameters with its Pareto frontier, and learning curves.

Both group experiments by method family (an experiment file's ``family:``): one marker and colour per
family on the Pareto plot, one panel per family for the learning curves.  The Pareto plot names every
point, and :func:`place_labels` puts the names where they overlap neither each other nor a marker.
"""

from __future__ import annotations

import io
import itertools
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The Figure/Agg canvas pair draws without pyplot, so no global backend is chosen behind the user's back.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.text import Text
from matplotlib.ticker import MaxNLocator


@dataclass(frozen=True)
class Point:
    """One experiment on the plot: trainable parameters (head included), task-mean top-1, all tasks run, family."""

    label: str
    params: float
    accuracy: float
    complete: bool
    family: str = ""


# Okabe and Ito's colour-blind-safe palette less its yellow (too pale on white) and its black (the text's colour:
# the 256-colour PNG merges it with the antialiased text, so no black marker pixel survives), then Paul Tol's
# wine, indigo and olive, then grey; each family gets the next (marker, colour) pair, so two families never
# share a colour while there are at most 10.
_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")
_COLOURS += ("#882255", "#332288", "#999933", "#999999")
# Filled shapes first: a thin star leaves few pixels of its colour.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h", "<", ">", "p", "*")
_LABEL_SIZE = 8  # points
_MARKER_AREA, _RING_AREA = 55, 150  # scatter sizes (points squared) of a point and of a frontier point's ring


def family_styles(families: list[str]) -> dict[str, tuple[str, str]]:
    """(marker, colour) of each family, in the order given."""
    return {f: (_MARKERS[i % len(_MARKERS)], _COLOURS[i % len(_COLOURS)]) for i, f in enumerate(families)}


def _family_order(families: list[str], order: list[str] | None) -> list[str]:
    # The order given first, then any family it misses in the order first seen.
    listed = list(order or [])
    return listed + [f for f in dict.fromkeys(families) if f not in listed]


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (fewer parameters, higher accuracy).

    Args:
        points: (trainable parameters, accuracy) pairs.

    Returns:
        Indices of the frontier, in increasing parameter order.

    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


# ---------------------------------------------------------------------------------------------------
# Label placement: greedy, in display pixels, so it can be tested without drawing.


@dataclass(frozen=True)
class Box:
    """An axis-aligned rectangle in display pixels."""

    x0: float
    y0: float
    x1: float
    y1: float

    def overlap(self, other: Box) -> float:
        """The area the two boxes share (0 when they only touch)."""
        width = min(self.x1, other.x1) - max(self.x0, other.x0)
        height = min(self.y1, other.y1) - max(self.y0, other.y0)
        return width * height if width > 0 and height > 0 else 0.0

    def inside(self, other: Box) -> bool:
        """Whether this box lies within ``other``."""
        return other.x0 <= self.x0 and self.x1 <= other.x1 and other.y0 <= self.y0 and self.y1 <= other.y1


@dataclass(frozen=True)
class Placement:
    """Where a label goes: its offset from its point (pixels), its alignment, and the box it covers."""

    dx: float
    dy: float
    ha: str
    va: str
    box: Box


# Directions tried around a point, the right-hand side first (labels read left to right from their marker).
_DIRECTIONS = (
    (1, 0, "left", "center"),
    (1, 1, "left", "bottom"),
    (1, -1, "left", "top"),
    (0, 1, "center", "bottom"),
    (0, -1, "center", "top"),
    (-1, 0, "right", "center"),
    (-1, 1, "right", "bottom"),
    (-1, -1, "right", "top"),
)
_RADII = (0, 10, 22, 36, 52, 72, 96)  # pixels beyond the marker
_NEAR = 60  # pixels: points closer than this to a point make it crowded (placed first)


def _label_box(x: float, y: float, width: float, height: float, ha: str, va: str) -> Box:
    x0 = x - {"left": 0.0, "center": width / 2, "right": width}[ha]
    y0 = y - {"bottom": 0.0, "center": height / 2, "top": height}[va]
    return Box(x0, y0, x0 + width, y0 + height)


def place_labels(
    anchors: list[tuple[float, float]],
    sizes: list[tuple[float, float]],
    bounds: Box,
    marker_radius: float,
    avoid: list[Box] | None = None,
) -> list[Placement]:
    """Place one label beside each point so that no two labels, and no label and marker, overlap.

    Greedy: the most crowded points choose first; each takes the first position, going outwards ring by
    ring, that stays inside ``bounds`` and clear of every marker, every box in ``avoid`` and every label
    placed so far.  Where none is free (more labels than room), the position overlapping least is taken.

    Args:
        anchors: each point's position (display pixels, y up).
        sizes: each label's (width, height) in pixels.
        bounds: the box every label must stay in (the axes).
        marker_radius: half the side of the square each marker covers.
        avoid: further boxes to keep clear (the frontier line's segments).

    Returns:
        One placement per point, in the order given.

    """
    pad = 2.0
    markers = [Box(x - marker_radius, y - marker_radius, x + marker_radius, y + marker_radius) for x, y in anchors]
    markers += avoid or []
    crowd = [sum(math.dist(a, b) < _NEAR for b in anchors) for a in anchors]
    placed: dict[int, Placement] = {}
    for i in sorted(range(len(anchors)), key=lambda i: (-crowd[i], i)):
        (x, y), (width, height) = anchors[i], sizes[i]
        best: tuple[float, Placement] | None = None
        for radius in _RADII:
            for sx, sy, ha, va in _DIRECTIONS:
                # Diagonal steps are shortened so that every ring lies at about the same distance.
                step = marker_radius + pad + radius * (0.75 if sx and sy else 1.0)
                dx, dy = sx * step, sy * step
                box = _label_box(x + dx, y + dy, width, height, ha, va)
                padded = Box(box.x0 - pad, box.y0 - pad, box.x1 + pad, box.y1 + pad)
                cost = sum(padded.overlap(m) for m in markers) + sum(padded.overlap(p.box) for p in placed.values())
                if not box.inside(bounds):
                    cost += 1e6
                if best is None or cost < best[0]:
                    best = (cost, Placement(dx, dy, ha, va, box))
                if cost == 0:
                    break
            if best is not None and best[0] == 0:
                break
        assert best is not None
        placed[i] = best[1]
    return [placed[i] for i in range(len(anchors))]


# ---------------------------------------------------------------------------------------------------
# The plots.


def _as_text(fig: Figure) -> None:
    """Draw every text of ``fig`` as written (names come from folders and files: no mathtext, no ``$...$``).

    Tick labels excepted: matplotlib writes them itself, a log axis's as mathtext (`10^3` in math mode).
    """
    ticks = {
        id(label)
        for ax in fig.axes
        for axis in (ax.xaxis, ax.yaxis)
        for tick in (*axis.get_major_ticks(), *axis.get_minor_ticks())
        for label in (tick.label1, tick.label2)
    }
    for text in fig.findobj(Text):
        text.set_parse_math(id(text) in ticks)


def _png(fig: Figure) -> bytes:
    """The figure as a 256-colour PNG: a third of the bytes, no visible change (the HTML embeds both plots).

    Octree quantisation keeps small patches of colour (a marker, a panel's title) that median cut would merge.
    """
    from PIL import Image  # Pillow comes with matplotlib

    _as_text(fig)
    drawn = io.BytesIO()
    fig.savefig(drawn, format="png")
    buffer = io.BytesIO()
    image = Image.open(drawn).convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE)
    image.save(buffer, format="png", optimize=True)
    return buffer.getvalue()


def render_pareto(
    points: list[Point], num_tasks: int, models: list[str], families: Mapping[str, str] | None = None
) -> bytes:
    """PNG bytes of task-mean top-1 against trainable parameters (log x), one marker and colour per family.

    Every point carries its experiment's name, placed clear of the other names and markers; faded points
    (name followed by ``*``) did not run on every task or seed.  The x axis counts the head too: linear
    probing trains nothing else, and a log axis needs a positive value.

    Args:
        points: one per experiment; those without an accuracy or with no parameters are left out.
        num_tasks: how many tasks a complete experiment's mean covers (axis label).
        models: the backbones measured on (title).
        families: family name -> what its methods train (its legend entry), in legend order; a point's
            family missing here is listed after them.

    """
    rows = [p for p in points if not math.isnan(p.accuracy) and p.params > 0]
    families = dict(families or {})
    order = _family_order([p.family for p in rows], [f for f in families if any(p.family == f for p in rows)])
    styles = family_styles(order)
    fig = Figure(figsize=(11, 6.2), dpi=110)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # The legend is built by hand: one full-strength entry per family, whether or not its points are faded.
    handles = []
    for family in order:
        marker, colour = styles[family]
        members = [p for p in rows if p.family == family]
        label = f"{family}: {families[family]}" if families.get(family) else family
        handles.append(
            Line2D([], [], ls="none", marker=marker, color=colour, markeredgecolor="white", ms=8, label=label)
        )
        for complete in (True, False):
            shown = [p for p in members if p.complete == complete]
            if shown:
                ax.scatter(
                    [p.params for p in shown],
                    [p.accuracy for p in shown],
                    marker=marker,
                    color=colour,
                    s=_MARKER_AREA,
                    edgecolors="white",
                    linewidths=0.6,
                    alpha=1.0 if complete else 0.35,
                    zorder=3,
                )
    # A mean over fewer tasks is not comparable, so only experiments run on every task make the frontier.
    complete_points = [(p.params, p.accuracy) for p in rows if p.complete]
    front = [complete_points[i] for i in pareto_front(complete_points)]
    if len(front) > 1:
        # A step line: between two frontier points, the better accuracy is only reached at the larger budget.
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="0.4", ls="--", lw=1.0, zorder=2)
    if front:
        xs, ys = zip(*front, strict=True)
        ax.scatter(xs, ys, s=_RING_AREA, facecolors="none", edgecolors="0.35", zorder=2)
        ring = math.sqrt(_RING_AREA)
        handles.append(Line2D([], [], ls="none", marker="o", ms=ring, mfc="none", mec="0.35", label="Pareto frontier"))
    ax.set_xscale("log")
    ax.margins(x=0.12, y=0.1)  # room for the names of the outermost points
    ax.set_xlabel("trainable parameters, head included (mean over runs, log scale)")
    ax.set_ylabel(f"task-mean top-1 (%) over {num_tasks} tasks")
    incomplete = (
        "\nfaded, name followed by *: not run on every task or seed yet" if any(not p.complete for p in rows) else ""
    )
    ax.set_title(f"petl, measured on {', '.join(models)}{incomplete}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if rows:
        # Beside the axes, not on them: a legend inside would hide points.
        ax.legend(
            handles=handles,
            fontsize=8,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            title="method family",
            title_fontsize=8,
        )
    _as_text(fig)  # before the layout measures them
    fig.tight_layout()
    _label_points(ax, canvas, rows, front)
    return _png(fig)


def _label_points(ax, canvas: FigureCanvasAgg, rows: list[Point], frontier: list[tuple[float, float]]) -> None:
    # Labels are placed in pixels once the layout is final: draw once, then freeze the limits.
    _as_text(ax.figure)
    canvas.draw()
    ax.set_xlim(ax.get_xlim())
    ax.set_ylim(ax.get_ylim())
    renderer = canvas.get_renderer()
    # The frontier's step line is made of horizontal and vertical segments: thin boxes to keep names off.
    steps = []
    front = [tuple(ax.transData.transform(xy)) for xy in frontier]
    for (x0, y0), (x1, y1) in itertools.pairwise(front):
        steps += [Box(x0, y0 - 1, x1, y0 + 1), Box(x1 - 1, min(y0, y1), x1 + 1, max(y0, y1))]
    names = [p.label if p.complete else f"{p.label} *" for p in rows]
    sizes = []
    for name in names:
        probe = ax.text(0, 0, name, fontsize=_LABEL_SIZE, parse_math=False)
        extent = probe.get_window_extent(renderer)
        sizes.append((extent.width, extent.height))
        probe.remove()
    anchors = [tuple(ax.transData.transform((p.params, p.accuracy))) for p in rows]
    frame = ax.get_window_extent(renderer)
    bounds = Box(frame.x0 + 2, frame.y0 + 2, frame.x1 - 2, frame.y1 - 2)
    pixels_per_point = ax.figure.dpi / 72
    # Every marker is kept clear as if it were ringed: a name never touches the frontier's rings either.
    marker_radius = math.sqrt(_RING_AREA) / 2 * pixels_per_point
    for name, p, place in zip(names, rows, place_labels(anchors, sizes, bounds, marker_radius, steps), strict=True):
        far = math.hypot(place.dx, place.dy) > marker_radius + 4
        ax.annotate(
            name,
            (p.params, p.accuracy),
            xytext=(place.dx / pixels_per_point, place.dy / pixels_per_point),
            textcoords="offset points",
            ha=place.ha,
            va=place.va,
            fontsize=_LABEL_SIZE,
            parse_math=False,
            alpha=1.0 if p.complete else 0.6,
            # Under the markers, so that the line to a name set away from its point ends at the marker's edge.
            zorder=2.5,
            arrowprops={"arrowstyle": "-", "color": "0.35", "lw": 0.7, "shrinkA": 1, "shrinkB": 0} if far else None,
        )


def curve_panels(experiments: list[str], family_of: Mapping[str, str], order: list[str]) -> dict[str, list[str]]:
    """The learning-curve panels: family -> its experiments, families in ``order`` first, then as met.

    An experiment without a family (missing from ``family_of``) gets a panel of its own.
    """
    grouped: dict[str, list[str]] = {}
    for name in experiments:
        grouped.setdefault(family_of.get(name, name), []).append(name)
    return {f: grouped[f] for f in _family_order(list(grouped), [f for f in order if f in grouped])}


def render_curves(
    curves: Mapping[str, Mapping[int, float]],
    task: str,
    models: list[str],
    family_of: Mapping[str, str] | None = None,
    families: Mapping[str, str] | None = None,
    cut: Sequence[str] = (),
) -> bytes:
    """PNG bytes of val top-1 per epoch as small multiples: one panel per family, its experiments in colour.

    Each panel draws the other families' curves in light grey behind its own, so a panel reads both
    "did these runs level off before their last epoch?" and "where do they sit among the rest?".

    Args:
        curves: experiment -> epoch -> val top-1 (%) after it.
        task: the task the curves are on (title).
        models: the backbones measured on (title).
        family_of: experiment -> family (an experiment missing here is a family of its own).
        families: family name -> what its methods train (panel subtitles), in panel order; a family
            missing here comes after them.
        cut: the experiments whose seeds' curves have different epochs, each with what its curve keeps (the title
            says that it shows only the epochs every seed has: :func:`petl.bench.curves.cut_curves`).

    """
    families = dict(families or {})
    grouped = curve_panels(list(curves), family_of or {}, list(families))
    order = list(grouped)
    styles = family_styles(order)
    cols = min(3, max(1, len(order)))
    nrows = max(1, math.ceil(len(order) / cols))
    fig = Figure(figsize=(4.4 * cols, 3.0 * nrows + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(nrows, cols, sharex=True, sharey=True, squeeze=False).flat)
    for ax, family in zip(axes, order, strict=False):
        own = grouped[family]
        for name, values in curves.items():
            if name not in own:
                ax.plot(list(values), list(values.values()), color="0.86", lw=0.8, zorder=1)
        for j, name in enumerate(own):
            values = curves[name]
            ax.plot(
                list(values),
                list(values.values()),
                color=_COLOURS[j % len(_COLOURS)],
                marker=_MARKERS[j % len(_MARKERS)],
                markersize=3,
                lw=1.4,
                label=name,
                zorder=3,
            )
        marker, colour = styles[family]
        subtitle = f": {families[family]}" if families.get(family) else ""
        ax.set_title(f"{family}{subtitle}", fontsize=9, color=colour, loc="left")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        # Epochs are whole numbers, not 2.5; min_n_ticks=1: over one epoch (an axis of 0.95 to 1.05) the locator
        # would otherwise give up its integers for eight ticks 0.945 to 1.050.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    for k in range(len(order), len(axes)):
        # Panels left over in the last row stay empty; the panel above each shows the epoch ticks instead.
        axes[k].set_visible(False)
        if k >= cols:
            axes[k - cols].xaxis.set_tick_params(labelbottom=True)
    fig.supxlabel("epoch", fontsize=10)
    fig.supylabel("val top-1 (%)", fontsize=10)
    title = (
        f"val accuracy per epoch on {task}, {', '.join(models)}: one panel per method family (grey: the other families)"
    )
    if cut:
        title += f"; only the epochs every seed's curve has: {', '.join(cut)}"
    # About 46 characters fit above one panel at this size: a board with one or two families wraps its title.
    fig.suptitle(textwrap.fill(title, width=46 * cols), fontsize=10)
    _as_text(fig)  # before the layout measures them
    fig.tight_layout()
    return _png(fig)
