"""``petl-bench params suite=vtab1k``: petl's trainable-parameter counts beside the published ones.

For each experiment of the suite, the method is applied to the suite's backbone built on PyTorch's
``meta`` device (shapes, no storage, no download) and counted without the classifier head, the way
V-PETL's tables count (linear probing = 0M).  The count is compared with the published row the
experiment file names (``published:``) at the precision the figure was published at (``0.29M``: two
decimals in millions).  A difference fails the command unless the experiment file says why
(``published_note:``), so a published column can never sit beside a different method unnoticed.

A suite's ``per_task`` ``method.*`` options (VPT's prompt length, say) are applied task by task: the count
shown is the mean over the suite's tasks that the table covers, as a published per-task configuration is
counted, with the range when tasks differ.  On another architecture than the published table's (its
pretrained tag aside), counts are printed but cannot fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from petl.bench import suite as suites
from petl.bench.args import CONFIGS_KEYS, configs_folder, parse_args
from petl.bench.published import PUBLISHED_BACKBONE, TABLES, PublishedRow, PublishedTable

PARAMS_KEYS = {"suite", "methods", "model"} | CONFIGS_KEYS


@dataclass(frozen=True)
class ParamsLine:
    """One experiment against one published table.

    Attributes:
        experiment: the experiment name.
        count: petl's trainable parameters without head on the backbone (mean over the suite's tasks).
        published: the published row, or ``None`` when the experiment names none in this table.
        note: the experiment file's reason for a difference (``""``: none given).
        task_range: the smallest and largest per-task count when per-task options make them differ.
        published_backbone: whether the counts are of the table's own backbone (else a difference is expected).
        refused: why ``petl.apply`` refuses the method on this (not the published) backbone (``count`` is then 0),
            else ``""``.

    """

    experiment: str
    count: float
    published: PublishedRow | None
    note: str
    task_range: tuple[int, int] | None = None
    published_backbone: bool = True
    refused: str = ""

    @property
    def status(self) -> str:
        """``ok``, ``differs (explained)``, ``differs (other backbone)``, ``DIFFERS``, ``no published row`` or
        ``refused``.
        """
        if self.refused:
            return "refused"
        if self.published is None or self.published.params is None:
            return "no published row"
        if self.published.params_match(self.count):
            return "ok"
        if not self.published_backbone:
            return "differs (other backbone)"
        return "differs (explained)" if self.note else "DIFFERS"


def count_without_head(model_name: str, method: dict, num_classes: int) -> int:
    """Trainable parameters outside the head of ``method`` on ``model_name``, built on the meta device."""
    import timm
    import torch

    import petl.methods  # noqa: F401  (importing the methods registers them)
    from petl.model.params import count_params
    from petl.model.surgery import apply

    options = {k: v for k, v in method.items() if k != "name"}
    # Meta tensors have shapes but no storage: a ViT-B/16 costs nothing and no weights are fetched.
    with torch.device("meta"):
        model = timm.create_model(model_name, pretrained=False, num_classes=num_classes)
        apply(model, method["name"], num_classes=num_classes, **options)
    return count_params(model).trainable_no_head


def check_model(model_name: str) -> None:
    """Refuse a model petl refuses whole (a distilled DeiT), before the table: each row would say so, exit 0.

    Raises:
        ValueError: naming ``model=`` and why (the backbone's one line).

    """
    import timm
    import torch

    from petl.model.backbone import backbone_of

    with torch.device("meta"):
        model = timm.create_model(model_name, pretrained=False)
    try:
        backbone_of(model).check()
    except ValueError as error:
        raise ValueError(f"model={model_name}: {error}") from None


def note_for(experiment: suites.Experiment, table: PublishedTable) -> str:
    """The experiment's ``published_note`` for ``table`` (one text for all tables, or per table key)."""
    note = experiment.published_note
    return note.get(table.key, "") if isinstance(note, dict) else note


def suite_backbone(suite: suites.Suite) -> str:
    """The backbone a suite runs on: its ``model.name`` if it names one, else the published backbone."""
    return str((suite.groups.get("model") or {}).get("name") or PUBLISHED_BACKBONE)


def method_for_task(suite: suites.Suite, experiment: suites.Experiment, task: str) -> dict:
    """The experiment's method options with the suite's ``per_experiment`` and ``per_task`` ``method.*`` settings."""
    method = dict(experiment.method)
    per_task = suite.per_task.get(experiment.name, {}).get(task, {})
    settings = {**suite.per_experiment.get(experiment.name, {}), **per_task}
    for key, value in settings.items():
        if key.startswith("method."):
            method[key.removeprefix("method.")] = value
    return method


def same_architecture(model_name: str, backbone: str) -> bool:
    """Whether two timm names build the same network (the pretrained tag after the dot does not count)."""
    return model_name.split(".")[0] == backbone.split(".")[0]


def task_counts(
    suite: suites.Suite, experiment: suites.Experiment, tasks: list[str], model_name: str, num_classes: int
) -> list[int]:
    """The experiment's count on each of ``tasks`` (one model build per distinct option set)."""
    counted: dict[str, int] = {}
    counts = []
    for task in tasks:
        method = method_for_task(suite, experiment, task)
        key = repr(sorted(method.items()))
        if key not in counted:
            counted[key] = count_without_head(model_name, method, num_classes)
        counts.append(counted[key])
    return counts


def compare(
    suite: suites.Suite,
    experiments: list[suites.Experiment],
    table: PublishedTable,
    model_name: str,
    num_classes: int,
) -> list[ParamsLine]:
    """Each experiment's petl count beside its published row in ``table``."""
    rows = table.rows()
    tasks = [t for t in suite.tasks if table.covers(t)]
    same = same_architecture(model_name, table.backbone)
    lines = []
    for e in experiments:
        try:
            counts = task_counts(suite, e, tasks, model_name, num_classes)
        except ValueError as error:  # petl.apply's one-line refusal of this model (see its Raises)
            if same:  # the published backbone takes every experiment: a refusal there is the file's fault
                raise
            # One row saying why, the other experiments still counted, as petl-bench speed leaves such a row out.
            lines.append(ParamsLine(e.name, 0, rows.get(e.published), "", None, same, str(error)))
            continue
        spread = (min(counts), max(counts)) if min(counts) != max(counts) else None
        mean = sum(counts) / len(counts)
        published = rows.get(e.published)
        lines.append(ParamsLine(e.name, mean, published, note_for(e, table), spread, same))
    return lines


def format_lines(lines: list[ParamsLine], table: PublishedTable) -> list[str]:
    """A plain-text table: experiment, petl's count, the published row and count, the verdict and any note."""
    out = [f"{'experiment':<20} {'petl M (no head)':>16}  {'published row':<18} {'published':>9}  status"]
    for line in lines:
        pub = line.published
        digits = pub.params_digits if pub is not None else 2
        shown = "-" if line.refused else f"{line.count / 1e6:.{max(digits, 2)}f}"
        row = pub.method if pub is not None else "-"
        figure = f"{pub.params / 1e6:.{digits}f}M" if pub is not None and pub.params is not None else "-"
        out.append(f"{line.experiment:<20} {shown:>16}  {row:<18} {figure:>9}  {line.status}")
        if line.task_range is not None:
            low, high = (f"{n / 1e6:.{max(digits, 2)}f}" for n in line.task_range)
            out.append(f"{'':<20} per-task options: {low} to {high} over the tasks, mean shown")
        if line.refused:
            out.append(f"{'':<20} {line.refused}")
        if line.note and line.status not in ("ok", "differs (other backbone)"):
            out.append(f"{'':<20} note: {line.note}")
    return out


def main(args: Sequence[str]) -> int:
    """``petl-bench params suite=... [methods=...] [model=...] [configs_dir=...]``.

    Returns:
        1 when an experiment's count on the published backbone differs from its published row at the
        published precision and its file gives no ``published_note`` for that table, else 0.

    Raises:
        SystemExit: an unknown argument, ``methods=`` listing nothing, a suite without a published table.
        ValueError: an unknown suite, experiment or model (``ConfigError``), or a model petl refuses whole, before
            any count.

    """
    from petl.bench.args import split_list
    from petl.data import get_info
    from petl.train.config import check_group_choice

    own, rest = parse_args(args, PARAMS_KEYS)
    if rest:
        raise SystemExit(f"petl-bench params: unknown argument(s) {rest}; known: {', '.join(sorted(PARAMS_KEYS))}")
    configs = configs_folder(own)
    suite = suites.load_suite(own.get("suite", "vtab1k"), configs)
    names = split_list(own["methods"]) if "methods" in own else suite.experiments
    if not names:
        # A table of no row that exits 0 would read as every count checked.
        raise SystemExit("petl-bench params: methods= lists nothing: name one or more, or leave it out for the suite's")
    experiments = [suites.load_experiment(n, configs) for n in names]
    tables = [t for t in TABLES if any(t.covers(task) for task in suite.tasks)]
    if not tables:
        raise SystemExit(f"petl-bench params: suite {suite.name} has no published table to compare with")
    model_name = own.get("model", suite_backbone(suite))
    # Before the table's first lines: an unknown name is bad input (exit 2), not timm's RuntimeError mid-table (exit 1).
    check_group_choice("model", model_name)
    check_model(model_name)
    # The head is not counted, so any class count serves; the suite's first task's keeps it realistic.
    num_classes = get_info(suite.tasks[0]).num_classes
    failed = False
    for table in tables:
        print(f"petl-bench params: suite {suite.name} on {model_name} (meta device) vs published {table.key}")
        print(f"  published: {table.title}; {table.source}; backbone {table.backbone}")
        if not same_architecture(model_name, table.backbone):
            print(f"  note: {model_name} is not the published backbone; counts are not expected to match")
        lines = compare(suite, experiments, table, model_name, num_classes)
        for text in format_lines(lines, table):
            print("  " + text)
        failed |= any(line.status == "DIFFERS" for line in lines)
    if failed:
        print("petl-bench params: counts differ from the published ones; fix the experiment or give a published_note")
    return 1 if failed else 0
