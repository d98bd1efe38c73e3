"""Whether a training run learned: one definition, used when a run is recorded and when results are read.

A run *did not learn* when its training ended where it began:

* its final training loss is not finite;
* its final training loss is not below its first epoch's (the mean loss over the first epoch, the earliest
  loss a run records; runs of a single epoch skip this test);
* or its final training loss is at chance, ln(classes), within :data:`CHANCE_TOLERANCE` of it: a classifier
  whose loss sits there predicts the uniform distribution, whatever its accuracy on a few hundred images.

Only training-set figures decide (never val or test accuracy), so a selection protocol may use the verdict
without looking at data it must not see.  On the 1,408 mini records committed when the rule was set, the runs
at chance sat within 0.8 % of ln(classes) and the closest run that learned 1.9 % below it (BitFit on dsprites_ori,
test 14.4 % against chance 6.25 %).  On the 2,196 records of benchmarks/results/mini_*/runs now the margin is
narrow: an LST trial on DINOv2's dsprites_loc at lr 1e-2 ends 0.98 % below ln 16 (at chance, val 5.5 %), an SSF
trial on dsprites_ori at lr 1e-2 1.09 % below it (counted as learned, val 4.0 %).  Runs that start far above chance
(a new MLP head: first epoch 8.5 on clevr_count) and end above ln(classes) learned, and are not flagged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from petl.store.files import read_metrics
from petl.utils.text import plural

CHANCE_TOLERANCE = 0.01  # relative distance to ln(classes) that counts as "at chance"
# Fewer optimizer steps than this in a whole run are worth a warning before it trains: on the README's own-data
# example (60 images, batch 64, 5 epochs: 5 steps) LoRA ended at 42 % on 3 classes.  A lower bound on what a
# method needs, not a recipe: the published VTAB-1k protocol takes 100 epochs x 13 steps.
FEW_STEPS = 50


def few_steps(steps: int, images: int, batch_size: int, epochs: int) -> str | None:
    """A warning for a run of fewer than :data:`FEW_STEPS` optimizer steps, naming what to change; else ``None``."""
    if steps >= FEW_STEPS:
        return None
    return (
        f"this run takes only {plural(steps, 'optimizer step')} ({plural(images, 'training image')} in batches of "
        f"{batch_size}, {plural(epochs, 'epoch')}), too few to learn much: aim for {FEW_STEPS} or more with more "
        "train.epochs or a smaller train.batch_size"
    )


def not_learned(losses: Sequence[float | None], num_classes: int | None) -> str | None:
    """Why a run with these per-epoch training losses did not learn, or ``None`` when it learned.

    Args:
        losses: the mean training loss of each epoch, first to last (``None`` where an epoch recorded none).
        num_classes: the task's class count (chance is ln of it); ``None`` skips that test.

    Returns:
        A short reason ("final train loss 2.307 is at chance, ln(10) = 2.303"), or ``None``.

    """
    known = [float(v) for v in losses if v is not None]
    if not known:
        return None
    final = known[-1]
    if not math.isfinite(final):
        return f"final train loss is {final}"
    if len(known) > 1 and final >= known[0]:
        return f"final train loss {final:.3f} is not below the first epoch's {known[0]:.3f}"
    if num_classes and num_classes > 1:
        chance = math.log(num_classes)
        if abs(final - chance) <= CHANCE_TOLERANCE * chance:
            return f"final train loss {final:.3f} is at chance, ln({num_classes}) = {chance:.3f}"
    return None


def epoch_losses(run_dir: Path) -> list[float | None]:
    """The training loss of each epoch in ``run_dir/metrics.jsonl`` (empty when the file is missing)."""
    losses: list[float | None] = []
    for row in read_metrics(run_dir):
        if "epoch" in row:
            loss = row.get("loss")
            losses.append(float(loss) if isinstance(loss, int | float) and not isinstance(loss, bool) else None)
    return losses


def run_not_learned(run_dir: Path, result: Any) -> str | None:
    """:func:`not_learned` for a finished run: its record's own verdict, else judged from its files.

    Records written before the verdict existed carry none; their ``metrics.jsonl`` and final loss decide, by
    the same rule.  A selection trial that diverged (no scores) did not learn either.
    """
    if getattr(result, "diverged", None):
        return f"diverged: {result.diverged}"
    if getattr(result, "not_learned", None):
        return str(result.not_learned)
    losses = epoch_losses(run_dir)
    final = getattr(result, "final_train_loss", None)
    if final is not None and (not losses or losses[-1] != final):
        losses.append(float(final))
    return not_learned(losses, getattr(result, "num_classes", None))
