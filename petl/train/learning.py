"""Whether a training run learned: one definition, used when a run is recorded and when results are read.

A run *did not learn* when its training ended where it began:

* its final training loss is not finite;
* its final training loss is not below its first epoch's (the mean loss over the first epoch, the earliest
  loss a run records; runs of a single epoch skip this test);
* its final training loss is at chance, within :data:`CHANCE_TOLERANCE` of the loss of a classifier that ignores
  its images: ln(classes), where one that predicts the uniform distribution sits, or the entropy of the epoch's
  label shares (:func:`prior_loss`, which the engine computes as ``prior_loss``), where one that learned only how
  often each label comes ends: below ln(classes) where the labels are imbalanced (6, 2 and 2 of 10 images on 3
  classes: 0.950 against ln 3 = 1.099), the same where they are balanced.  Records written before the engine
  computed it are tested against ln(classes) alone;
* or its last epoch's training top-1 is not above chance: the exact one-sided binomial test (:func:`binomial_tail`)
  of its hits among the epoch's images does not reject the rate of always guessing the epoch's most frequent label
  (its ``majority_top1``, which the engine counts; never below 1/classes) at :data:`CHANCE_ALPHA`.  The loss tests
  miss a run that diverged within its first epoch (one epoch at lr 1e3 on mini/digits: loss 22,422, nowhere near
  ln 10, train top-1 9.0 % on 10 classes), or one whose loss, blown up early, fell back below its first epoch's
  without the model predicting better than a guess.  Chance is the majority rate, not 1/classes: a model stuck on
  the most frequent class of mini/fashion_mnist's train800 (95 of 800 images, 11.9 %) scores 11.9 %, which a test
  against 1/10 calls learned (p = 0.046).  Records written before the engine counted it are tested against
  1/classes, the only rate their files give.

Only training-set figures decide (never val or test accuracy), so a selection protocol may use the verdict
without looking at data it must not see.  On the 1,408 mini records committed when the rule was set, the runs
at chance sat within 0.8 % of ln(classes) and the closest run that learned 1.9 % below it (BitFit on dsprites_ori,
test 14.4 % against chance 6.25 %).  On the 2,196 records of benchmarks/results/mini_*/runs now the margin is
narrow: an LST trial on DINOv2's dsprites_loc at lr 1e-2 ends 0.98 % below ln 16 (at chance, val 5.5 %), an SSF
trial on dsprites_ori at lr 1e-2 1.09 % below it (counted as learned, val 4.0 %).  Runs that start far above chance
(a new MLP head: first epoch 8.5 on clevr_count) and end above ln(classes) learned, and are not flagged.  Of the
2,229 committed records the accuracy test against 1/classes adds one: a Convpass trial on DINOv2's digits at lr 1e-2
(final loss 2.329, 1.1 % above ln 10; train top-1 11.4 % of 800 images, p = 0.11; val 12.0 %), not the point its
search chose.  They predate the majority count; against their tasks' majority rates (recounted from the mini data)
two more would not have learned, both trials their searches did not choose: a VPT-shallow trial on the Swin's
dsprites_ori at lr 1e-3 (7.9 % of 800 against 6.25 % gave p = 0.04; against the 7.4 % of its most frequent
orientation p = 0.31) and an SSF trial on DINOv2's dsprites_ori at lr 1e-2 (8.75 %, p = 0.08).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from petl.store.files import read_metrics
from petl.utils.text import plural

CHANCE_TOLERANCE = 0.01  # relative distance to ln(classes) that counts as "at chance"
CHANCE_ALPHA = 0.05  # the binomial test's level: a train top-1 whose p against the majority rate is at or above it
# Fewer optimizer steps than this in a whole run are worth a warning before it trains: on the README's own-data
# example (60 images, batch 64, 5 epochs: 5 steps) LoRA ended at 42 % on 3 classes.  A lower bound on what a
# method needs, not a recipe: the published VTAB-1k protocol takes 100 epochs x 13 steps.
FEW_STEPS = 50
# binomial_tail sums its terms up to this many trials (at most a fifth of a second on a 2-core CPU), scipy above it.
SUMMED_TRIALS = 100_000


def few_steps(steps: int, images: int, batch_size: int, epochs: int) -> str | None:
    """A warning for a run of fewer than :data:`FEW_STEPS` optimizer steps, naming what to change; else ``None``."""
    if steps >= FEW_STEPS:
        return None
    return (
        f"this run takes only {plural(steps, 'optimizer step')} ({plural(images, 'training image')} in batches of "
        f"{batch_size}, {plural(epochs, 'epoch')}), too few to learn much: aim for {FEW_STEPS} or more with more "
        "train.epochs or a smaller train.batch_size"
    )


def not_learned(
    losses: Sequence[float | None],
    num_classes: int | None,
    train_top1: float | None = None,
    train_images: float | None = None,
    majority_top1: float | None = None,
    label_prior_loss: float | None = None,
) -> str | None:
    """Why a run with these per-epoch training losses did not learn, or ``None`` when it learned.

    Args:
        losses: the mean training loss of each epoch, first to last (``None`` where an epoch recorded none).
        num_classes: the task's class count (chance is ln of it, and 1/classes of the images); ``None`` skips both
            chance tests.
        train_top1: the last epoch's training top-1 (%); ``None`` skips the accuracy test.
        train_images: the images that top-1 is over; ``None`` (or 0) skips the accuracy test.
        majority_top1: the top-1 (%) of always guessing the most frequent label among those images; ``None`` (a record
            that predates it) tests against 1/classes.
        label_prior_loss: the last epoch's loss of always predicting its label shares (:func:`prior_loss`); ``None``
            (a record that predates it), or no value such a loss can have (not in (0, ln(classes)]), tests the final
            loss against ln(classes) alone.

    Returns:
        A short reason ("final train loss 2.307 is at chance, ln(10) = 2.303"), or ``None``.

    """
    known = [float(v) for v in losses if v is not None]
    if known:
        final = known[-1]
        if not math.isfinite(final):
            return f"final train loss is {final}"
        if len(known) > 1 and final >= known[0]:
            return f"final train loss {final:.3f} is not below the first epoch's {known[0]:.3f}"
    if not num_classes or num_classes < 2:
        return None
    if known:
        uniform = math.log(num_classes)
        if abs(known[-1] - uniform) <= CHANCE_TOLERANCE * uniform:
            return f"final train loss {known[-1]:.3f} is at chance, ln({num_classes}) = {uniform:.3f}"
        prior = label_prior_loss
        # A figure from an edited metrics.jsonl that no labels give is read as a record without it.
        if prior is not None and math.isfinite(prior) and 0 < prior <= uniform * (1 + 1e-9):
            if abs(known[-1] - prior) <= CHANCE_TOLERANCE * prior:
                return (
                    f"final train loss {known[-1]:.3f} is at chance, {prior:.3f}, what always predicting the "
                    f"training labels' shares scores (ln({num_classes}) = {uniform:.3f} for balanced labels)"
                )
    return accuracy_at_chance(train_top1, train_images, num_classes, majority_top1)


def prior_loss(label_counts: Sequence[int], classes: int, label_smoothing: float = 0.0) -> float:
    """The mean training loss of always predicting the labels' shares: where a model that ignores its images ends.

    The entropy of the shares p (ln(classes) where they are balanced, less where they are not), or under
    ``label_smoothing`` e the entropy of the smoothed targets' mean, (1 - e) p + e / classes, where the smoothed loss
    of a prediction that is the same for every image is lowest.

    Args:
        label_counts: images of each label (index = label), as ``torch.bincount`` counts them; at least one.
        classes: the classes the head predicts (a label the epoch did not draw still gets its smoothed share).
        label_smoothing: ``train.label_smoothing``.

    """
    total = sum(label_counts)
    classes = max(classes, len(label_counts))
    shares = [count / total for count in label_counts] + [0.0] * (classes - len(label_counts))
    targets = [(1 - label_smoothing) * share + label_smoothing / classes for share in shares]
    return -math.fsum(t * math.log(t) for t in targets if t > 0)


def accuracy_at_chance(
    top1: float | None, images: float | None, num_classes: int, majority_top1: float | None = None
) -> str | None:
    """Why a training top-1 of ``top1`` % over ``images`` is at chance for ``num_classes``, or ``None``.

    At chance: the exact one-sided binomial test of its hits (``top1`` % of ``images``, rounded) against the larger
    of 1/classes and ``majority_top1`` % (what always guessing the most frequent label scores) gives p at or above
    :data:`CHANCE_ALPHA`.  ``None`` also when ``top1`` or ``images`` is missing or no figure an epoch can have (a
    top-1 outside [0, 100], a count of images that is no whole number from 1: an edited ``metrics.jsonl``, whose
    1e308 % overflowed the count of hits, is read as the records that predate the figures are); a ``majority_top1``
    that is missing, not finite or outside [0, 100] leaves 1/classes.
    """
    if top1 is None or images is None or not (math.isfinite(top1) and 0 <= top1 <= 100):
        return None
    if not (math.isfinite(images) and images >= 1 and images == int(images)):
        return None
    images = int(images)  # metrics.jsonl may hold the count as a float
    hits = min(images, max(0, round(top1 * images / 100)))
    uniform = 1 / num_classes
    chance = uniform
    if majority_top1 is not None and math.isfinite(majority_top1) and 0 <= majority_top1 <= 100:
        chance = max(uniform, majority_top1 / 100)
    p = binomial_tail(hits, images, chance)
    if p < CHANCE_ALPHA:
        return None
    said = f"100/{num_classes} = {100 / num_classes:.1f} %"
    if chance > uniform:
        said = f"{100 * chance:.1f} %, what always guessing its most frequent label scores"
    return (
        f"final epoch's train top-1 {top1:.1f} % of {plural(images, 'image')} is not above chance, "
        f"{said} (one-sided binomial p = {p:.2g})"
    )


def binomial_tail(hits: int, trials: int, chance: float) -> float:
    """P(X >= ``hits``) for X ~ Binomial(``trials``, ``chance``): the exact one-sided binomial test's p-value.

    :func:`scipy.stats.binomtest`'s ``greater`` p (its ``binom.sf(hits - 1)``), summed in log space without scipy up
    to :data:`SUMMED_TRIALS`: importing scipy.stats costs 0.5 to 1.5 s, which the first run a process records would
    pay, and petl-bench choose's estimate times a run's own cost on the first run of its process.  Above it, scipy's
    ``binom.sf``: the sum takes a term per hit count (an edited metrics.jsonl's 1e8 images held a report over a
    minute, 1e12 ran out of memory), and an epoch of that many images dwarfs the import.
    """
    if hits <= 0:
        return 1.0
    if hits > trials:
        return 0.0
    if chance >= 1:
        return 1.0  # every trial hits: log1p(-1) would be -inf
    if trials > SUMMED_TRIALS:
        from scipy import stats

        return float(stats.binom.sf(hits - 1, trials, chance))
    log_chance, log_miss = math.log(chance), math.log1p(-chance)
    whole = math.lgamma(trials + 1)
    terms = [
        whole - math.lgamma(k + 1) - math.lgamma(trials - k + 1) + k * log_chance + (trials - k) * log_miss
        for k in range(hits, trials + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))


def epoch_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The per-epoch rows of ``run_dir/metrics.jsonl``, first to last (empty when the file is missing)."""
    return [row for row in read_metrics(run_dir) if "epoch" in row]


def epoch_losses(run_dir: Path) -> list[float | None]:
    """The training loss of each epoch in ``run_dir/metrics.jsonl`` (empty when the file is missing)."""
    return [_number(row.get("loss")) for row in epoch_rows(run_dir)]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def run_not_learned(run_dir: Path, result: Any) -> str | None:
    """:func:`not_learned` for a finished run: its record's own verdict, else judged from its files.

    Records written before the verdict existed (or before its accuracy test) carry none; their ``metrics.jsonl``
    and final loss decide, by the same rule: a record's "learned" is judged again, its "did not learn" kept.  A
    selection trial that diverged (no scores) did not learn either.
    """
    if getattr(result, "diverged", None):
        return f"diverged: {result.diverged}"
    if getattr(result, "not_learned", None):
        return str(result.not_learned)
    rows = epoch_rows(run_dir)
    losses = [_number(row.get("loss")) for row in rows]
    final = getattr(result, "final_train_loss", None)
    if final is not None and (not losses or losses[-1] != final):
        losses.append(float(final))
    last = rows[-1] if rows else {}
    keys = ("train_top1", "images", "majority_top1", "prior_loss")
    top1, images, majority, prior = (_number(last.get(key)) for key in keys)
    return not_learned(losses, getattr(result, "num_classes", None), top1, images, majority, prior)
