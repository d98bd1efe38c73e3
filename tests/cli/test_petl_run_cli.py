"""petl-run's command line: composition (hydra.compose), the schema, error messages, exit codes, sweeps."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_run
from omegaconf import OmegaConf

import petl
from petl.cli import run as cli
from petl.run import default_config
from petl.store.run_card import FILE_KWARGS, OVERLAY
from petl.train import config
from petl.train.config import ConfigError
from petl.train.engine import TrainSettings

TINY = tiny_run()


def test_defaults_are_the_vtab1k_recipe():
    cfg = default_config()
    assert OmegaConf.get_type(cfg) is config.RunConfig
    train = cfg.train
    assert (train.lr, train.weight_decay, train.batch_size, train.warmup_frac) == (1e-3, 1e-4, 64, 0.1)
    assert train.label_smoothing == 0 and train.precision == "auto" and train.cache_features and not train.trackers
    assert cfg.model.drop_path == 0.1 and cfg.data.split == "train800" and cfg.seed == 0
    # The engine's defaults and the CLI's are one source.
    assert all(train[f.name] == f.default for f in dataclasses.fields(TrainSettings) if f.name != "epochs")
    assert default_config(["data=vtab/dtd"]).train.epochs == 100
    # Default epochs come from the dataset registry, their one home.
    from petl import data
    from petl.data import mini

    assert default_config(["data=mini/digits"]).train.epochs == mini.EPOCHS == data.get_info("mini/digits").epochs
    assert data.get_info("vtab/dtd").epochs == data.PROTOCOL_EPOCHS == 100
    slug = cfg.data.name.replace("/", "-")
    assert cfg.output_dir == f"runs/{slug}/vit_fractal_tiny_patch4_32.fractaldb/lora/seed0"


@pytest.mark.parametrize("method", petl.list_methods())
def test_method_group_is_generated_from_the_dataclasses(method):
    cfg = default_config([f"method={method}"])
    spec = petl.get_method(method)
    fields = [f.name for f in dataclasses.fields(spec.config_cls) if f.name != "num_classes"]
    assert list(cfg.method.keys()) == ["name", *fields]
    defaults = dataclasses.asdict(spec.config_cls())
    assert {k: v for k, v in OmegaConf.to_container(cfg.method).items() if k != "name"} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items() if k != "num_classes"
    }


def test_overrides_are_applied_and_type_checked():
    cfg = default_config(["method=lora", "method.rank=4", "method.targets=[q,k,v]", "train.lr=0.01", "seed=3"])
    assert cfg.method.rank == 4 and list(cfg.method.targets) == ["q", "k", "v"]
    assert cfg.train.lr == 0.01 and cfg.output_dir.endswith("/lora/seed3")
    assert config.method_options(cfg)["targets"] == ("q", "k", "v")
    with pytest.raises(ConfigError, match=r"method.rank: Value 'four' of type 'str' could not be converted to Integer"):
        default_config(["method.rank=four"])
    with pytest.raises(ConfigError, match=r"train.cache_features: Value .maybe. is not a valid bool"):
        default_config(["train.cache_features=maybe"])


def test_data_epochs_is_checked_under_its_own_name_and_refused_where_train_epochs_overrides_it():
    # data.epochs=0 was refused as "train.epochs=0", a key not given; beside another train.epochs it did nothing.
    with pytest.raises(ConfigError, match=r"^data.epochs=0 is out of range: allowed \[1, inf\]$"):
        default_config(["data.epochs=0"])
    with pytest.raises(ConfigError, match=r"^data.epochs=3 cannot act: train.epochs=2 is given, and the run trains"):
        default_config(["data.epochs=3", "train.epochs=2"])
    assert default_config(["data.epochs=3"]).train.epochs == 3  # followed where train.epochs is not given
    assert default_config(["data.epochs=3", "train.epochs=3"]).train.epochs == 3
    assert default_config(["train.epochs=2"]).data.epochs == 10  # the dataset's own stays


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method=lorax"], r"unknown method 'lorax'; choose one of: adapter, .*lora, .*mlp, noah, partial"),
        (["data=vtab/cifar1000"], r"unknown dataset 'vtab/cifar1000'; choose one of: .*vtab/cifar100"),
        (["model=vit_base_patch16_224.nope"], r"unknown model 'vit_base_patch16_224.nope'; did you mean: vit_base"),
        (["train=fastest"], r"unknown train recipe 'fastest'; choose one of: smoke, vtab1k"),
        (["method.rnk=4"], r"unknown config key 'method.rnk'; valid keys under 'method' \(method lora\): name, rank"),
        (["trian.lr=1"], r"unknown config key 'trian'; valid keys at the top level: method, data, model, train, seed"),
        (["method.rank=0"], r"method lora: rank=0 is out of range: allowed \[1, inf\]"),
        (["train.lr=-0.1"], r"train.lr=-0.1 is out of range: allowed \(0, inf\]"),
        (["train.lr=nan"], r"train.lr=nan is not a finite number: allowed \(0, inf\]"),
        (["train.warmup_frac=nan"], r"train.warmup_frac=nan is not a finite number: allowed \[0, 1\]"),
        (["train.weight_decay=inf"], r"train.weight_decay=inf is not a finite number: allowed \[0, inf\]"),
        # 1 made every target uniform, whatever its label: the run trained and learned nothing, without a word.
        (["train.label_smoothing=1"], r"^train.label_smoothing=1.0 is out of range: allowed \[0, 1\)$"),
        # Refused only as each job built its backbone: a sweep's check let it through, and every job failed (exit 1).
        (
            ["model.pretrained=false", "model.checkpoint=weights.safetensors"],
            r"^model.checkpoint is set but model.pretrained=false: the file would be ignored$",
        ),
        (["model.drop_path=nan"], r"model.drop_path=nan is not a finite number: allowed \[0, 1\]"),
        (["method.alpha=nan"], r"method lora: alpha=nan is not a finite number$"),
        (["method=adapter", "method.scale=-inf"], r"method adapter: scale=-inf is not a finite number"),
        (["method=partial", "method.k=7"], r"method partial: k=7 is out of range: allowed \[1, 6\]"),
        (["train.precision=fp8"], r"train.precision='fp8' is not valid: choose one of auto, no, tf32, bf16, fp16"),
        (["data.split=test"], r"data.split='test' is not valid: choose one of train800, train800val200"),
        (["seed=1,2"], r"^Ambiguous value for argument 'seed=1,2': to sweep over the values add --multirun"),
        # A folder named with a letter beyond ASCII, a bracket, a comma: said how to quote it in a shell.
        (
            ["data.root=Fotos ü"],
            r"""^cannot parse override 'data.root=Fotos ü': .*in a shell: "data.root='Fotos ü'"\)$""",
        ),
        (
            ["data.root=a,b"],
            r"""one value holding commas \(a folder's name\) quote it, in a shell: "data.root='a,b'"$""",
        ),
        (["+method.rank=3"], r"^Could not append to config. An item is already at 'method.rank'.$"),
        (
            ["hydra/launcher=submitit_slurm"],
            r"Could not find 'hydra/launcher/submitit_slurm' \(is the Hydra plugin that provides it installed\?\)$",
        ),
    ],
)
def test_bad_input_gives_one_line_naming_what_is_valid(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        default_config(overrides)
    assert "\n" not in str(caught.value)


def test_the_unknown_model_lines_command_lists_one_model_a_line(tmp_path):
    # The hint printed every name on one line, which the grep a reader looks a name up with returns whole.
    message = config.unknown_choice_message("model", "resnet50")
    command = message.split("(all: ", 1)[1].removesuffix(")").replace("grep NAME", "grep -x vit_base_patch16_224")
    assert command.startswith("python -c ")
    command = shlex.quote(sys.executable) + command.removeprefix("python")  # the python this test runs
    env = {**os.environ, "PYTHONPATH": str(Path(petl.__file__).parents[1])}
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "vit_base_patch16_224\n", (command, done.stdout[:300], done.stderr)


@pytest.mark.parametrize("key", sorted(FILE_KWARGS - {OVERLAY}))
def test_file_loading_model_kwargs_are_refused_before_training(tmp_path, key):
    """Issue 52: +model.kwargs.checkpoint_path=... trained, then the run folder was refused on load."""
    message = rf"^model.kwargs.{key} would make timm load a file .* model.checkpoint=PATH"
    with pytest.raises(ConfigError, match=message) as caught:
        default_config([f"+model.kwargs.{key}={tmp_path / 'weights.pth'}", f"output_dir={tmp_path / 'run'}"])
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=message):  # the Python API's path (petl.train) too
        config.to_config({"method": "lora", "model": {"kwargs": {key: str(tmp_path / "weights.pth")}}})
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overlay", "message"),
    [
        # Its input_size alone is carried into model.json; it was refused whole, as "would make timm load a file".
        ("{file:w.pth}", r"^model.kwargs.pretrained_cfg_overlay.file: petl takes only input_size of it .*checkpoint="),
        ("w.pth", r'^model.kwargs.pretrained_cfg_overlay="w.pth" is not a mapping: petl takes only \{input_size'),
        # A size is fixed in the size (it said "give weights as model.checkpoint=PATH" too).
        (
            "{input_size:[3,32,48]}",
            r"^model.kwargs.pretrained_cfg_overlay.input_size=\[3, 32, 48\] is not \[3, N, N\] \(petl's images are "
            r"square RGB\)$",
        ),
        ("{input_size:[3,32,32],mean:[0,0,0]}", r"^model.kwargs.pretrained_cfg_overlay.mean: petl takes only input"),
        # A ViT is built for its img_size: the overlay's size would be an option with no effect.
        ("{input_size:[3,64,64]}", r"input_size=\[3, 64, 64\]: vit_fractal_tiny_patch4_32 is built for 32 px .*=64"),
    ],
)
def test_a_pretrained_cfg_overlay_other_than_a_size_the_model_takes_is_refused(tmp_path, overlay, message):
    with pytest.raises(ConfigError, match=message) as caught:
        default_config([*tiny_run(), f"+model.kwargs.pretrained_cfg_overlay={overlay}", f"output_dir={tmp_path}/r"])
    assert "\n" not in str(caught.value)
    # The size the model is built for is taken (a ViT's own: nothing changes).
    default_config([*tiny_run(), "+model.kwargs.pretrained_cfg_overlay={input_size:[3,32,32]}"])


@pytest.mark.slow
def test_cli_refuses_a_file_loading_model_kwarg_with_exit_2_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["+model.kwargs.checkpoint_path=w.pth", f"output_dir={tmp_path / 'run'}"])
    assert caught.value.code == cli.USAGE_ERROR == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("petl-run: error: model.kwargs.checkpoint_path would make timm load a file")
    assert "\n" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cli_error_exits_2_with_one_line_and_checks_every_sweep_job(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--multirun", "method=lora,partial", "method.k=2"])
    assert caught.value.code == cli.USAGE_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("petl-run: error: unknown config key 'method.k'") and "(in job method=lora method.k=2)" in err
    assert "\n" not in err


def test_a_sweep_whose_jobs_share_one_output_dir_is_refused_before_any_job_trains(tmp_path, capsys):
    # The default folder names no lr: the sweep's first job trained there and every other job then failed on it.
    with pytest.raises(SystemExit) as caught:
        cli.main(["--multirun", *TINY, "method=linear", "train.lr=0.001,0.01", f"output_dir={tmp_path}/run"])
    assert caught.value.code == cli.USAGE_ERROR
    err = capsys.readouterr().err.strip()
    assert err == (
        f"petl-run: error: --multirun: jobs train.lr=0.001 and train.lr=0.01 would both write to output_dir "
        f"{tmp_path}/run (train.lr: 0.001 -> 0.01): put the swept keys in it, e.g. "
        f"'output_dir={tmp_path}/run/lr${{train.lr}}'"
    )
    assert not (tmp_path / "run").exists()
    # Jobs of one run (a neutral key swept) share a folder as a resume does.
    cli.check_command_line([*TINY, "method=linear", "train.eval_batch_size=64,128", f"output_dir={tmp_path}/run"], True)


def test_a_sweep_refusing_cache_features_false_and_sharing_a_folder_names_the_option_first(tmp_path, monkeypatch):
    # The jobs refusing the option are not composed, so the folders are compared once every job composes.
    sweep = [*TINY, "train.lr=0.001,0.01", "train.cache_features=false", f"output_dir={tmp_path}/run"]
    with pytest.raises(ConfigError, match=r"^train.cache_features=false cannot act in 2 of the 4 jobs") as caught:
        cli.check_command_line([*sweep, "method=linear,lora"], True)
    assert "train.lr=0.001 method=lora: nothing in front" in str(caught.value) and "output_dir" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"^--multirun: jobs train.lr=0.001 and train.lr=0.01 would both write"):
        cli.check_command_line([*sweep, "method=linear"], True)
    # A sweep larger than the jobs checked says how many were: it said "of the 2 jobs" of a sweep of 3.
    monkeypatch.setattr(cli, "MAX_CHECKED_JOBS", 2)
    with pytest.raises(ConfigError, match=r"^train.cache_features=false cannot act in 2 of the first 2 jobs"):
        cli.check_command_line([*TINY, "method=lora", "train.lr=0.1,0.2,0.3", "train.cache_features=false"], True)


@pytest.mark.slow
def test_a_sweep_names_every_job_where_cache_features_false_cannot_act_before_any_starts(tmp_path, capsys):
    # The augmented task's job was refused only when it ran (the runner's check), after the others had trained; each
    # such job is named now, in one line, before Hydra starts any.
    with pytest.raises(SystemExit) as caught:
        cli.main(
            ["--multirun", "data=mini/digits,fgvc/cub", "method=linear,lora", "train.cache_features=false"]
            + [f"hydra.sweep.dir={tmp_path / 'sweep'}"]
        )
    assert caught.value.code == cli.USAGE_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("petl-run: error: train.cache_features=false cannot act in 3 of the 4 jobs"), err
    assert "\n" not in err
    assert "data=fgvc/cub method=linear: the training images are augmented" in err
    assert "data=mini/digits method=lora: nothing in front" in err and "data=mini/digits method=linear" not in err
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_cli_refuses_nan_with_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["method=lora", "method.alpha=nan"])
    assert caught.value.code == cli.USAGE_ERROR == 2
    err = capsys.readouterr().err.strip()
    assert err == "petl-run: error: method lora: alpha=nan is not a finite number"


@pytest.mark.slow
def test_debug_shows_the_traceback_of_bad_input_too(monkeypatch, capsys):
    # --debug (or HYDRA_FULL_ERROR=1) shows the traceback instead of the one line, as petl-run --help says; the
    # command line's own checks used to print the line anyway.
    with pytest.raises(ConfigError, match="rank=-1 is out of range"):
        cli.main(["method=lora", "method.rank=-1", "--debug"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        cli.main(["method=nope"])
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_cli_multirun_sweeps_methods_and_seeds(tmp_path, capsys):
    cli.main(
        [
            "--multirun",
            *TINY,
            "method=linear,mlp",
            "seed=0,1",
            f"hydra.sweep.dir={tmp_path}/sweep",
            f"output_dir={tmp_path}/" + "${method.name}-${seed}",
        ]
    )
    results = {p.parent.name: json.loads(p.read_text()) for p in tmp_path.glob("*/result.json")}
    assert sorted(results) == ["linear-0", "linear-1", "mlp-0", "mlp-1"]
    assert results["mlp-1"]["method"] == "mlp" and results["mlp-1"]["seed"] == 1
    assert capsys.readouterr().out.count("-> ") == 4


@pytest.mark.slow
def test_cli_run_failure_exits_1(tmp_path, monkeypatch, capsys):
    # A dataset that cannot be reached fails the run (not the input): status 1, one line, no traceback.
    from petl import data

    def unreachable(*args, **kwargs):
        raise data.DatasetUnavailableError("mini/digits is not cached here; set data.root")

    monkeypatch.setattr(data, "build_dataset", unreachable)
    with pytest.raises(SystemExit) as caught:
        cli.main([*TINY, f"output_dir={tmp_path}"])
    assert caught.value.code == cli.RUN_ERROR
    assert capsys.readouterr().err.strip().endswith("petl-run: error: mini/digits is not cached here; set data.root")
    assert not (tmp_path / "result.json").exists()


@pytest.mark.slow
def test_cli_bad_images_stop_the_run_before_training_with_one_line(tmp_path, capsys):
    from test_vtab_fgvc_folders import FULL, make_vtab_task

    make_vtab_task(tmp_path / "root" / "dtd", FULL, num_classes=47)
    (tmp_path / "root" / "dtd" / "images" / "img 7.png").write_bytes(b"")  # listed in test.txt only
    (tmp_path / "root" / "dtd" / "images" / "img 9.png").write_bytes(b"garbage")
    args = [a for a in TINY if not a.startswith("data=")]
    with pytest.raises(SystemExit) as caught:
        cli.main([*args, "data=vtab/dtd", f"data.root={tmp_path / 'root'}", f"output_dir={tmp_path / 'out'}"])
    # Bad data is the user's input or the run's fault depending on the runner; either way one line, no training.
    assert caught.value.code in (cli.USAGE_ERROR, cli.RUN_ERROR)
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "2 listed image(s) cannot be used" in err
    assert "img 7.png (empty file)" in err and "img 9.png (not a readable image" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists() and not (tmp_path / "out" / "result.json").exists()


def _petl_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "petl.run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_subprocess_bad_value_exits_2_without_traceback(tmp_path):
    proc = _petl_run("method=lora", "method.rank=0", cwd=tmp_path)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1] == "petl-run: error: method lora: rank=0 is out of range: allowed [1, inf]"
    )
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written for a run that never started


@pytest.mark.slow
def test_subprocess_two_epoch_run(tmp_path):
    proc = _petl_run(*TINY, "method=adapter", "output_dir=out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["method"] == "adapter" and result["epochs"] == 2 and result["dataset"] == "mini/digits"
    assert "adapter on mini/digits" in proc.stdout and "epoch 2/2" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
        "model.json",
        "result.json",
        "trainable.safetensors",
    ]


@pytest.mark.parametrize("name", ["photos (2)", "Fotos ü", "it's", "x=y", "a,b", "p[1]", "cost $5!"])
def test_the_quoting_an_unparsable_override_is_told_gives_the_value_through_a_shell(tmp_path, name):
    # Hydra reads an unquoted value of ASCII letters, digits and a few signs only; the hint was key='a=b', whose
    # quotes a shell removes before petl-run sees them.
    argument = config.shell_quoted(f"output_dir={tmp_path / name}")
    (override,) = shlex.split(argument)  # as bash hands it over
    assert default_config([override]).output_dir == str(tmp_path / name)
