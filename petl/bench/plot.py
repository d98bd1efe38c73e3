"""The accuracy-versus-parameters plot of a leaderboard, with its Pareto frontier."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

# The Figure/Agg canvas pair draws without pyplot, so no global backend is chosen behind the user's back.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


@dataclass(frozen=True)
class Point:
    """One experiment on the plot: trainable parameters (head included), task-mean top-1, all tasks run."""

    label: str
    params: float
    accuracy: float
    complete: bool


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")


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


def render_pareto(points: list[Point], num_tasks: int, models: list[str]) -> bytes:
    """PNG bytes of task-mean top-1 against trainable parameters (log x), one marker per experiment.

    The x axis counts the head too: linear probing trains nothing else, and a log axis needs a
    positive value.

    Args:
        points: one per experiment; those without an accuracy or with no parameters are left out.
        num_tasks: how many tasks a complete experiment's mean covers (axis label).
        models: the backbones measured on (title).

    """
    rows = [p for p in points if not math.isnan(p.accuracy) and p.params > 0]
    fig = Figure(figsize=(9.5, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, p in enumerate(rows):
        label = p.label if p.complete else f"{p.label} (not all tasks or seeds)"
        marker = _MARKERS[i % len(_MARKERS)]
        ax.scatter(
            [p.params], [p.accuracy], marker=marker, s=60, label=label, zorder=3, alpha=1.0 if p.complete else 0.35
        )
        ax.annotate(p.label, (p.params, p.accuracy), textcoords="offset points", xytext=(5, 4), fontsize=8)
    # A mean over fewer tasks is not comparable, so only experiments run on every task make the frontier.
    complete_points = [(p.params, p.accuracy) for p in rows if p.complete]
    front = [complete_points[i] for i in pareto_front(complete_points)]
    if len(front) > 1:
        # A step line: between two frontier points, the better accuracy is only reached at the larger budget.
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="0.4", ls="--", lw=1.2, zorder=2)
    if front:
        xs, ys = zip(*front, strict=True)
        ax.scatter(xs, ys, s=170, facecolors="none", edgecolors="0.3", zorder=2, label="Pareto frontier")
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters, head included (mean over runs, log scale)")
    ax.set_ylabel(f"task-mean top-1 (%) over {num_tasks} tasks")
    ax.set_title(f"petl, measured on {', '.join(models)}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if rows:
        # Beside the axes, not on them: with twenty experiments a legend inside hides points.
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def render_curves(curves: dict[str, list[float]], task: str, models: list[str]) -> bytes:
    """PNG bytes of val top-1 per epoch, one line per experiment: does each run level off before its last epoch?

    Args:
        curves: experiment -> val top-1 (%) after each epoch.
        task: the task the curves are on (title).
        models: the backbones measured on (title).

    """
    fig = Figure(figsize=(9.5, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (label, values) in enumerate(curves.items()):
        epochs = range(1, len(values) + 1)
        ax.plot(epochs, values, marker=_MARKERS[i % len(_MARKERS)], markersize=4, lw=1.3, label=label)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers, not 2.5
    ax.set_ylabel("val top-1 (%)")
    ax.set_title(f"val accuracy per epoch on {task}, {', '.join(models)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
