"""The accuracy-versus-parameters plot of a leaderboard, with its Pareto frontier."""

from __future__ import annotations

import io
import math

# The Figure/Agg canvas pair draws without pyplot, so no global backend is chosen behind the user's back.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from petl.bench.report import Leaderboard

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


def render_pareto(board: Leaderboard) -> bytes:
    """PNG bytes of task-mean top-1 against trainable parameters (log x), one marker per experiment.

    The x axis counts the head too: linear probing trains nothing else, and a log axis needs a
    positive value.
    """
    rows = [r for r in board.rows if not math.isnan(r.task_mean) and r.trainable > 0]
    fig = Figure(figsize=(7.5, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    points = [(r.trainable, r.task_mean) for r in rows]
    for i, (row, (x, y)) in enumerate(zip(rows, points, strict=True)):
        complete = board.complete(row)
        label = row.experiment if complete else f"{row.experiment} (not all tasks)"
        marker = _MARKERS[i % len(_MARKERS)]
        ax.scatter([x], [y], marker=marker, s=60, label=label, zorder=3, alpha=1.0 if complete else 0.35)
        ax.annotate(row.experiment, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    # A mean over fewer tasks is not comparable, so only experiments run on every task make the frontier.
    complete_points = [p for p, r in zip(points, rows, strict=True) if board.complete(r)]
    front = [complete_points[i] for i in pareto_front(complete_points)]
    if len(front) > 1:
        # A step line: between two frontier points, the better accuracy is only reached at the larger budget.
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="0.4", ls="--", lw=1.2, zorder=2)
    if front:
        xs, ys = zip(*front, strict=True)
        ax.scatter(xs, ys, s=170, facecolors="none", edgecolors="0.3", zorder=2, label="Pareto frontier")
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters, head included (mean over tasks, log scale)")
    ax.set_ylabel(f"task-mean top-1 (%) over {len(board.tasks)} tasks")
    ax.set_title(f"petl, measured on {', '.join(board.models)}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if rows:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
