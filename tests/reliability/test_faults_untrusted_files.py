"""Faults and bad input, second pass (issue 21): nothing finished is lost, one bad file never brings the
harness down, and untrusted files (result.json, YAML, split lists, weights metadata) stay harmless.

Each test is one case of the issue, numbered as there; each goes through a public entry point
(petl-run's, petl-bench's and petl-pretrain's mains, ``petl.load_trainable``, the dataset builders).
"""

from __future__ import annotations

import csv
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import command_status, perturb_trainable, tiny_run
from safetensors import safe_open
from safetensors.torch import save_file
from test_harness import FakeEngine, fake_result, write_run
from test_vtab_fgvc_folders import SMALL, make_vtab_task

import petl
from petl import data as petl_data
from petl.backbones import models
from petl.bench import protocol, sweep
from petl.bench import suite as suites
from petl.bench.report import write_report
from petl.cli import bench as bench_cli
from petl.cli import pretrain as pretrain_cli
from petl.cli import run as cli
from petl.presets import configs_dir
from petl.run import default_config, train
from petl.store import files
from petl.train import pretrain

TINY = tiny_run(batch_size=32)
RUN_FILES = ("result.json", "trainable.safetensors", "config.yaml", "metrics.jsonl")


def tiny(out: Path, *overrides: str) -> dict:
    return train(default_config([*TINY, f"output_dir={out}", *overrides]))


def petl_run(capsys, *args: str) -> tuple[int, str]:
    """``petl-run ARGS`` on the tiny settings: its exit status and its stderr."""
    code, _, err = command_status(capsys, cli.main, *TINY, *args)
    return code, err


def petl_bench(capsys, *args: str) -> tuple[int, str, str]:
    """``petl-bench ARGS``: its exit status, stdout and stderr."""
    return command_status(capsys, bench_cli.main, *args)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in RUN_FILES}


# --- 1. a replacement run deletes nothing before its input is valid, and moves the old run aside ------


@pytest.mark.slow
def test_1_a_replacement_run_keeps_the_finished_run_until_it_can_start(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    tiny(run, "method=linear")
    before = snapshot(run)
    code, err = petl_run(
        capsys, f"output_dir={run}", "resume=false", "model.pretrained=true", f"model.checkpoint={tmp_path}/no.pt"
    )
    assert code == 2 and err.count("\n") == 1 and "no such file" in err
    assert snapshot(run) == before

    def bad_data(*args, **kwargs):
        raise petl_data.BadImagesError("mini/digits", [(Path("/data/x.png"), "cannot decode")])

    with monkeypatch.context() as patch:
        patch.setattr(petl_data, "build_dataset", bad_data)
        code, err = petl_run(capsys, f"output_dir={run}", "resume=false", "method=linear")
    assert code == 2 and "x.png" in err and snapshot(run) == before  # unreadable images: bad input (issue 35)

    code, err = petl_run(capsys, f"output_dir={run}", "resume=false", "method=linear", "train.lr=0.01")
    assert code == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and snapshot(aside[0]) == before  # the old run, whole
    assert json.loads((run / "result.json").read_text())["config"]["train"]["lr"] == 0.01
    assert f"moved to {aside[0]}" in err and err.count("moved to") == 1


# --- 2. petl-pretrain never writes into the installed package ---------------------------------------------


@pytest.mark.slow
def test_2_pretrain_writes_to_an_output_folder_not_into_the_package(tmp_path, monkeypatch, capsys):
    shipped = {p.name: p.read_bytes() for p in models.WEIGHTS_DIR.iterdir() if p.is_file()}
    monkeypatch.chdir(tmp_path)
    args = ["--classes", "2", "--instances", "4", "--epochs", "1", "--batch-size", "4", "--no-progress"]
    pretrain_cli.main(args)
    assert {p.name: p.read_bytes() for p in models.WEIGHTS_DIR.iterdir() if p.is_file()} == shipped
    written = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "runs").rglob("*") if p.is_file())
    assert written == [
        f"runs/pretrain/{pretrain.ARCH}.fractaldb.json",
        f"runs/pretrain/{pretrain.ARCH}.fractaldb.safetensors",
    ]
    # A second run into the same folder replaces nothing unless asked.
    # (Checked under the folder's lock, by pretrain() itself, before any image is generated.)
    monkeypatch.setattr(pretrain, "generate", lambda *a, **k: pytest.fail("must be refused before training"))
    with pytest.raises(SystemExit) as caught:
        pretrain_cli.main(args)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1
    assert "runs/pretrain" in err and "--overwrite" in err
    with pytest.raises(SystemExit) as caught:
        pretrain_cli.main(["--help"])
    assert "runs/pretrain" in capsys.readouterr().out


# --- 3. split lists only name files inside data.root ------------------------------------------------------


def test_3_a_split_list_line_that_escapes_the_data_root_is_refused(tmp_path):
    root = tmp_path / "data"
    make_vtab_task(root / "dtd", SMALL, num_classes=47)
    (tmp_path / "outside").mkdir()
    shutil.copy(root / "dtd" / "images" / "img 0.png", tmp_path / "outside" / "secret.png")
    # A symlink the dataset itself contains is a layout, not an escape.
    (root / "dtd" / "linked").symlink_to(tmp_path / "outside")
    lists = root / "dtd" / "train800.txt"
    good = lists.read_text()
    lists.write_text(good + "linked/secret.png 1\n")
    assert len(petl_data.build_dataset("vtab/dtd", "train800", image_size=8, root=str(root), strict=False)) == 9
    lists.write_text(good + f"../../outside/secret.png 0\n{tmp_path}/outside/secret.png 1\n")
    with pytest.raises(petl_data.BadImagesError, match=r"2 listed image\(s\) cannot be used") as caught:
        petl_data.build_dataset("vtab/dtd", "train800", image_size=8, root=str(root), strict=False)
    assert all("outside data.root" in reason for _, reason in caught.value.bad)
    assert sorted(str(p) for p, _ in caught.value.bad) == sorted(
        [str(root / "dtd" / "../../outside/secret.png"), f"{tmp_path}/outside/secret.png"]
    )


# --- 4. a damaged result.json is named, and the sweep trains that run again --------------------------------


def _mini_sweep(tmp_path: Path) -> list[str]:
    return [
        "suite=mini",
        "methods=linear",
        "tasks=mini/digits",
        "seeds=0,1",
        f"output_dir={tmp_path}",
        "progress=false",
    ]


def test_4_a_truncated_result_is_named_retrained_and_the_leaderboard_rebuilt(tmp_path, monkeypatch, capsys):
    engine = FakeEngine()
    monkeypatch.setattr(sweep, "_default_fns", lambda: (engine.train, engine.compose, None))
    assert petl_bench(capsys, *_mini_sweep(tmp_path))[0] == 0
    damaged = tmp_path / "mini-digits/linear/seed1/result.json"
    damaged.write_text(damaged.read_text()[:60])
    (tmp_path / "leaderboard.md").unlink()
    code, out, err = petl_bench(capsys, *_mini_sweep(tmp_path))
    assert code == 0 and "Traceback" not in err
    assert f"{damaged}: not valid JSON" in out + err
    assert len(engine.trained) == 3 and "resume=false" in engine.trained[-1]  # the damaged run, replaced
    assert (tmp_path / "leaderboard.md").is_file()


def test_4_a_truncated_trial_is_retrained_not_left_waiting(tmp_path):
    suite = suites.Suite("s", ["e"], ["mini/digits"], [0], search={"train.lr": [1e-3, 1e-2]})
    cells = protocol.plan_cells(suite, [suites.Experiment("e", {"name": "lora"})], ["mini/digits"], [0], tmp_path)
    trained: list = []

    def compose(overrides):
        return {k: v.strip("'") for k, _, v in (o.partition("=") for o in overrides)}

    def fake(cfg):
        trained.append(cfg)
        out = Path(cfg["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        trial = cfg.get("train.eval_test") == "false"
        result = {"dataset": cfg["data"], "seed": 0, "val_top1": 50.0 if trial else None, "test_top1": 40.0}
        (out / "result.json").write_text(json.dumps({**result, "config": {"train": {"lr": float(cfg["train.lr"])}}}))
        return result

    protocol.run_protocol(cells, progress=False, train_fn=fake, compose_fn=compose)
    trial = cells[0].trials[1].run.run_dir / "result.json"
    trial.write_text(trial.read_text()[:30])
    (cells[0].finals({})[0].run_dir / "result.json").unlink()
    trained.clear()
    summary = protocol.run_protocol(cells, progress=False, train_fn=fake, compose_fn=compose)
    assert not summary.waiting and not summary.failed
    assert [c["output_dir"] for c in trained] == [str(trial.parent), str(cells[0].finals({})[0].run_dir)]
    assert trained[0]["resume"] == "false"


# --- 5. one result.json with a bad field is skipped, named and counted ----------------------------------------


def test_5_a_result_with_a_bad_field_is_skipped_named_and_counted(tmp_path, capsys):
    write_run(tmp_path, "mini/digits", "linear", 0, top1=50.0)
    write_run(tmp_path, "mini/digits", "lora", 0, top1=60.0)
    bad = {
        "test_top1": ("adapter", lambda r: r.update(test_top1="n/a")),
        "trainable_params": ("vpt", lambda r: r.pop("trainable_params")),
        "total_params": ("ssf", lambda r: r.update(total_params=0)),
        "train_seconds": ("bitfit", lambda r: r.update(train_seconds="n/a")),
    }
    for experiment, change in bad.values():
        path = tmp_path / "mini-digits" / experiment / "seed0" / "result.json"
        path.parent.mkdir(parents=True)
        result = fake_result("mini/digits", experiment, 0, 55.0)
        change(result)
        path.write_text(json.dumps(result))
    code, out, err = petl_bench(capsys, "report", str(tmp_path))
    assert code == 0 and "Traceback" not in err
    for field, (experiment, _) in bad.items():
        assert f"{tmp_path}/mini-digits/{experiment}/seed0/result.json" in err and field in err
    rows = list(csv.DictReader(io.StringIO((tmp_path / "leaderboard.csv").read_text())))
    assert [r["experiment"] for r in rows] == ["lora", "linear"]
    assert "4 result.json files were skipped" in (tmp_path / "leaderboard.md").read_text()


# --- 6. names are drawn as text, never as mathtext -------------------------------------------------------------


def test_6_dollar_signs_in_names_do_not_break_the_plots(tmp_path):
    write_run(tmp_path, "mini/digits", "cost_$5_vs_$10", 0, top1=50.0)
    write_run(tmp_path, "mini/digits", "lora", 0, top1=60.0)
    (tmp_path / "mini-digits/cost_$5_vs_$10/seed0/metrics.jsonl").write_text('{"val_top1": 40}\n{"val_top1": 45}\n')
    write_report(tmp_path)
    for name in ("leaderboard.md", "leaderboard.csv", "leaderboard.html", "pareto.png", "learning_curves.png"):
        assert (tmp_path / name).is_file()
    assert "cost_$5_vs_$10" in (tmp_path / "leaderboard.md").read_text()


def test_6_tick_labels_keep_their_mathtext_while_names_are_text():
    # A log axis's tick labels are matplotlib's own mathtext ("$\\mathdefault{10^{3}}$"): drawn as text they
    # showed those characters under the Pareto plot.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from petl.bench.plot import _as_text

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.set_xscale("log")
    ax.plot([1e3, 1e5], [1, 2])
    name = ax.annotate("cost_$5_vs_$10", (1e4, 1.5))
    _as_text(fig)
    fig.canvas.draw()
    labels = [t for t in ax.xaxis.get_ticklabels() if t.get_text()]
    assert labels and all(t.get_parse_math() for t in labels) and "mathdefault" in labels[0].get_text()
    assert not name.get_parse_math()


# --- 7. a malformed YAML is named with its line and column; list lists the rest ---------------------------------


def test_7_a_malformed_yaml_is_one_line_and_list_still_lists_the_rest(tmp_path, capsys):
    configs = tmp_path / "configs"
    shutil.copytree(configs_dir(), configs)
    (configs / "suites" / "broken.yaml").write_text("experiments: [linear\ntasks: [mini/digits]\n")
    (configs / "experiments" / "broken_exp.yaml").write_text("method:\n  name: lora\n rank: 4\n")
    code, out, err = petl_bench(capsys, "list", f"configs_dir={configs}")
    assert code == 2 and "suite mini:" in out and "experiment lora:" in out and "Traceback" not in err
    assert f"{configs}/suites/broken.yaml:" in err and f"{configs}/experiments/broken_exp.yaml:" in err
    assert err.count("\n") == 2
    code, out, err = petl_bench(capsys, "suite=broken", f"configs_dir={configs}", f"output_dir={tmp_path}/out")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"petl-bench: error: {configs}/suites/broken.yaml:2:6: malformed YAML")


# --- 8. Ctrl-C on petl-bench: one line, status 130 ------------------------------------------------------------------


@pytest.mark.parametrize("epochs", [0, 1], ids=["before-the-first-epoch", "after-one-epoch"])
def test_8_ctrl_c_on_petl_bench_is_one_line_saying_whether_the_run_kept_an_epoch(tmp_path, monkeypatch, capsys, epochs):
    # Interrupted before its run's first epoch ended, the line said "an interrupted run resumes from its last finished
    # epoch": there was none, and the same command trains that run from the start (petl-run's line says so).
    def interrupted(cfg):
        out = Path(cfg["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        # What petl-run writes as the run starts (a damaged one is set aside: the run trained anew, no epoch kept).
        (out / files.CONFIG_FILE).write_text("method: {}\ndata: {}\nmodel: {}\ntrain: {}\n")
        if epochs:
            (out / files.CHECKPOINT_FILE).write_bytes(b"an epoch")
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "_default_fns", lambda: (interrupted, FakeEngine().compose, None))
    code, out, err = petl_bench(capsys, *_mini_sweep(tmp_path))
    assert code == 130 and err.count("\n") == 1 and "Traceback" not in err
    if epochs:
        assert err == (
            "petl-bench: error: interrupted; run the same command again to go on (finished runs are kept, an "
            "interrupted run resumes from its last finished epoch)\n"
        )
    else:
        assert err == (
            "petl-bench: error: interrupted before the first epoch of mini/digits linear seed0 finished, so no epoch "
            "of it is kept: run the same command again to go on (finished runs are kept, that run trains from the "
            "start)\n"
        )


def test_8_ctrl_c_on_petl_bench_before_any_run_names_none(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "_default_fns", lambda: (FakeEngine().train, interrupted, None))
    code, out, err = petl_bench(capsys, *_mini_sweep(tmp_path))
    assert code == 130 and err == (
        "petl-bench: error: interrupted; run the same command again to go on (finished runs are kept)\n"
    )


# --- exit codes and --debug are petl-run's in petl-bench and petl-pretrain too ----------------------------------------


@pytest.mark.slow
def test_petl_bench_bad_input_exits_2_and_debug_shows_the_traceback(capsys):
    code, out, err = petl_bench(capsys, "suite=nope")
    assert code == 2 and err.count("\n") == 1 and err.startswith("petl-bench: error: unknown suite 'nope'")
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        bench_cli.main(["suite=nope", "--debug"])
    code, out, err = petl_bench(capsys, "report", "/nonexistent/results")
    assert code == 2 and err.count("\n") == 1 and "/nonexistent/results" in err


@pytest.mark.slow
def test_petl_pretrain_ctrl_c_and_debug(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain, "pretrain", interrupted)
    with pytest.raises(SystemExit) as caught:
        pretrain_cli.main(["--out", str(tmp_path)])
    assert caught.value.code == 130 and capsys.readouterr().err.count("\n") == 1

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pretrain, "pretrain", broken)
    with pytest.raises(SystemExit) as caught:
        pretrain_cli.main(["--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert caught.value.code == 1 and err.count("\n") == 1 and "No space left on device" in err
    with pytest.raises(OSError):
        pretrain_cli.main(["--out", str(tmp_path), "--debug"])


# --- 9. a damaged checkpoint.pt: one line naming it ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "garbage", "pickle"])
def test_9_a_damaged_checkpoint_is_named_in_one_line(tmp_path, capsys, damage):
    run = tmp_path / "run"
    code, _ = petl_run(capsys, f"output_dir={run}", "train.epochs=1", "train.keep_checkpoint=true")
    assert code == 0
    (run / "result.json").unlink()  # as if killed after the checkpoint
    path = run / "checkpoint.pt"
    data = path.read_bytes()

    class Payload:
        def __reduce__(self):
            return (print, ("payload ran",))

    path.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": b"\x00" * 100, "pickle": pickle.dumps(Payload())}[damage]
    )
    code, err = petl_run(capsys, f"output_dir={run}", "train.epochs=1", "train.keep_checkpoint=true")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{path} is damaged" in err and "resume=false" in err
    assert "weights_only" not in err and "payload ran" not in capsys.readouterr().out


# --- 10. a damaged result.json, or a diverged trial's record, in an output_dir --------------------------------------


@pytest.mark.slow
def test_10_a_damaged_result_in_an_output_dir_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    tiny(run, "method=linear")
    path = run / "result.json"
    path.write_text(path.read_text()[:100])
    code, err = petl_run(capsys, f"output_dir={run}", "method=linear")
    assert code == 2 and err.count("\n") == 1 and f"{path}: not valid JSON" in err and "resume=false" in err
    code, err = petl_run(capsys, f"output_dir={run}", "method=linear", "resume=false")
    assert code == 0  # replaced, the damaged record moved aside


# --- 11. crafted weights metadata is bounded and checked against the file's tensors ---------------------------------


def _saved(tiny_vit, tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    model = petl.apply(tiny_vit(seed=1), "lora", num_classes=4, rank=2)
    perturb_trainable(model)
    petl.save_trainable(model, path)
    return path


def _with_config(path: Path, **changes) -> None:
    """Rewrite the file's method options, its metadata hash made anew: the hash finds an edit, not a crafted file."""
    from petl.model.io import METADATA_HASH, metadata_hash

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads(meta["config"])
    config.update(changes)
    meta = {**meta, "config": json.dumps(config)}
    save_file(tensors, str(path), metadata={**meta, METADATA_HASH: metadata_hash(meta)})


def test_11_nested_metadata_is_refused_naming_the_field(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    nested = '{"rank": ' + "[" * 100_000 + "]" * 100_000 + "}"
    save_file(tensors, str(path), metadata={**meta, "config": nested})
    model = tiny_vit()
    with pytest.raises(ValueError, match=rf"^{path}: metadata field 'config' is malformed"):
        petl.load_trainable(model, path)
    assert getattr(model, "petl_method", None) is None


@pytest.mark.parametrize("rank", [2**30, 2**17])
def test_11_a_claimed_size_is_checked_against_the_tensors_before_building(tiny_vit, tmp_path, monkeypatch, rank):
    path = _saved(tiny_vit, tmp_path)
    _with_config(path, rank=rank)
    from petl.methods import lora

    built = []
    real_init = lora.LoraLinear.__init__

    def watched(self, base, slices, rank, *args):
        built.append(base.weight.device.type)
        real_init(self, base, slices, rank, *args)

    monkeypatch.setattr(lora.LoraLinear, "__init__", watched)
    model = tiny_vit()
    with pytest.raises(ValueError, match=rf"^{path}: .*has shape .* the config .*needs"):
        petl.load_trainable(model, path)
    assert set(built) <= {"meta"}  # nothing was allocated for the claimed size
    assert getattr(model, "petl_method", None) is None


def test_11_integer_metadata_is_range_checked(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path)
    _with_config(path, rank=2**33)
    with pytest.raises(ValueError, match=rf"^{path}: metadata field 'config' is malformed \(.*out of range"):
        petl.load_trainable(tiny_vit(), path)


# --- 12. undecodable split lists and malformed FGVC jsons name the file


def test_12_a_latin1_split_list_is_named_with_its_line(tmp_path):
    make_vtab_task(tmp_path / "dtd", SMALL, num_classes=47)
    lists = tmp_path / "dtd" / "train800.txt"
    lists.write_bytes(lists.read_bytes() + "images/caf\xe9.png 1\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{lists}:9: not UTF-8 text"):
        petl_data.build_dataset("vtab/dtd", "train800", image_size=8, root=str(tmp_path), strict=False)


def _fgvc(folder: Path, train: str) -> None:
    (folder / "images").mkdir(parents=True)
    (folder / "train.json").write_text(train)
    (folder / "val.json").write_text("{}")
    (folder / "test.json").write_text("{}")


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ('{"a.jpg": 1,', r"malformed JSON \(Expecting"),
        ('{"a.jpg": null}', r"label of 'a.jpg' is None, not an integer"),
        ('["a.jpg"]', r"expected an object mapping image paths to labels"),
    ],
)
def test_12_a_malformed_fgvc_json_is_named(tmp_path, train, message):
    _fgvc(tmp_path / "CUB_200_2011", train)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/CUB_200_2011/train.json: {message}"):
        petl_data.build_dataset("fgvc/cub", "train800", image_size=8, root=str(tmp_path), strict=False)


# --- 13. an output_dir name too long for the file system is bad input


@pytest.mark.slow
def test_13_a_too_long_output_dir_exits_2(tmp_path, capsys):
    code, err = petl_run(capsys, f"output_dir={tmp_path}/{'x' * 300}/run")
    assert code == 2 and err.count("\n") == 1 and "cannot be written (File name too long)" in err
    assert list(tmp_path.iterdir()) == []


# --- 14. leaderboards: CSV cells are never formulas, Markdown cells never HTML or a row break


def test_14_csv_and_markdown_cells_are_inert(tmp_path):
    names = ["=HYPERLINK(x)", "-2+3", "@SUM(A1)", "+1"]
    for i, name in enumerate(names):
        write_run(tmp_path, "mini/digits", name, 0, top1=50.0 + i, method="lora")
    path = tmp_path / "mini-digits/<script>x/seed0/result.json"
    path.parent.mkdir(parents=True)
    result = fake_result("mini/digits", "lora", 0, 40.0)
    result["method_config"] = {"num_classes": 10, "note": "<svg onload=alert(1)>\nsecond line"}
    path.write_text(json.dumps(result))
    write_report(tmp_path)
    cells = [cell for row in csv.reader(io.StringIO((tmp_path / "leaderboard.csv").read_text())) for cell in row]
    assert not [c for c in cells if c[:1] in ("=", "+", "-", "@")]
    assert {f"'{n}" for n in names} <= set(cells)
    md = (tmp_path / "leaderboard.md").read_text()
    assert "<script>" not in md and "<svg" not in md and "&lt;svg onload=alert(1)&gt;" in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    # The main and the details table: a header, a rule and five rows each, none split by the newline.
    assert len(table) == 2 * (2 + 5) and all(line.endswith("|") for line in table)


# --- 15. new modules take the mode of the module they wrap


@pytest.mark.parametrize("method", petl.list_methods())
def test_15_a_method_applied_to_an_eval_model_stays_in_eval(tiny_vit, method):
    model = petl.apply(tiny_vit().eval(), method, num_classes=4)
    assert [name for name, m in model.named_modules() if m.training] == []
    model.train()
    assert all(m.training for m in model.modules())


def test_15_the_parallel_adapter_dropout_is_off_in_eval(tiny_vit, images):
    model = tiny_vit().eval()
    petl.apply_adapter(model, style="parallel")
    perturb_trainable(model)
    with torch.no_grad():
        assert torch.equal(model(images), model(images))
