"""A value that has no effect is refused in one line naming it (exit 2 from a command), never silently ignored.

Found by a pass over every user-settable value: petl-predict's options that act on one side of ``data=`` only;
NOAH's ``init=reference`` where it has nothing to re-draw, and a NOAH subnet of zero widths; petl-serve's limits given
above the limit that caps them; ``petl-bench speed tf32=`` on a CPU; a peft ``target_modules`` entry or
``layers_to_transform`` index matching no module; petl-run's keys added with Hydra's ``+`` that nothing reads
(``+train.lrr=0.1``), and a ``train.warmup_frac`` that warms up no step; petl-bench's budget and
``--yes`` without ``data=``.
"""

from __future__ import annotations

import re

import pytest
from conftest import make_tiny_vit

import petl
from petl.bench.speed import make_spec
from petl.cli import predict as predict_cli
from petl.cli import serve as serve_cli


def _refusal(capsys, argv: list[str]) -> tuple[int, str]:
    """petl-predict's exit status and stderr for ``argv``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        predict_cli.main(argv)
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # The evaluation reports top-1 accuracy and the confusion matrix: top_k was read by nothing.
        (["data=folder", "data.root=imgs", "top_k=3"], "top_k=3 ranks the labels of each image; with data= the"),
        # overwrite= replaces out= or confusion=; with neither it was read by nothing.
        (["a.png", "overwrite=true"], "overwrite= replaces an out= or confusion= file, and neither is given"),
        (["data=folder", "data.root=imgs", "overwrite=false"], "and neither is given: add one, or drop overwrite="),
    ],
)
def test_predict_refuses_an_option_that_cannot_act(tmp_path, capsys, argv, message):
    # Refused from the command line alone: the run folder is never read.
    code, error = _refusal(capsys, [str(tmp_path / "run"), *argv])
    assert code == 2
    assert error.startswith("petl-predict: error: ") and message in error and error.count("\n") == 1, error


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # NOAH's reference re-draws LoRA and the adapters only: prompts alone start the same either way.
        (
            {"prompt": "2,1,1", "init": "reference"},
            "init=reference re-draws NOAH's LoRA and adapters, and lora and adapter are off (0) in every block",
        ),
        ({"prompt": "1,0,0", "lora": "0,0,0", "adapter": "", "init": "reference"}, "drop init=reference"),
        # Every width 0: no module at all, so its dropout, init and supernet_dim are read by nothing.
        (
            {"prompt": "0,0,0", "lora": "0,0,0", "adapter": "0,0,0"},
            "prompt, lora and adapter are off (0) in every block: NOAH would train the head alone",
        ),
    ],
)
def test_noah_refuses_values_its_subnet_leaves_without_effect(options, message):
    model = make_tiny_vit()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        petl.apply(model, "noah", num_classes=3, **options)
    assert all(before[name].equal(tensor) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize(
    "options",
    [{"prompt": "2,1,1", "lora": "0,0,1", "init": "reference"}, {"adapter": "1,0,0", "init": "reference"}],
)
def test_noah_takes_init_reference_where_a_lora_or_adapter_is_on(options):
    petl.apply(make_tiny_vit(), "noah", num_classes=3, **options)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # A batch is taken from the images waiting, which max_queue bounds: max_batch above it never filled.
        (["max_batch=512"], "max_batch=512 is above max_queue=256 and could not act"),
        (["max_queue=16", "max_batch=32"], "raise max_queue or lower max_batch"),
        (["max_image_mp=100"], "max_image_mp=100 is above max_request_mp=64 and could not act"),
    ],
)
def test_serve_refuses_a_limit_given_above_the_limit_that_caps_it(tmp_path, capsys, argv, message):
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        serve_cli.main([str(tmp_path / "run"), *argv])  # refused before the run folder is looked at
    error = capsys.readouterr().err
    assert stop.value.code == 2
    assert error.startswith("petl-serve: error: ") and message in error and error.count("\n") == 1, error


def test_serve_takes_a_lower_outer_limit_alone(tmp_path, monkeypatch):
    # Only what is given is refused: max_queue=16 alone caps the default max_batch, which nobody asked for.
    monkeypatch.setattr(serve_cli, "find_runs", lambda runs: {})  # the run folders are not what is tested
    _, options, _ = serve_cli.read_command_line([str(tmp_path), "max_queue=16", "max_request_mp=8"])
    assert (options["max_batch"], options["max_queue"], options["max_request_mp"]) == (32, 16, 8.0)


@pytest.mark.parametrize(
    ("own", "cuda_available"),
    [({"tf32": "false"}, False), ({"tf32": "true", "device": "cpu"}, True), ({"tf32": "false", "device": "cpu"}, True)],
)
def test_bench_speed_refuses_tf32_on_a_cpu(own, cuda_available):
    # A CPU has no TF32: every fp32 row is strict fp32 whatever tf32 says.
    with pytest.raises(SystemExit, match=r"^petl-bench speed: tf32=\w+ acts on a CUDA GPU only: .*drop tf32="):
        make_spec(own, cuda_available=cuda_available)
    assert make_spec({"tf32": own["tf32"]}, cuda_available=True).device == "cuda"  # on the GPU it is taken


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # peft adapted qkv and passed over the typo.
        ({"target_modules": ["qkv", "fc_2"]}, "['fc_2'] of target_modules match no module of this model; its blocks'"),
        # Matched, but layers_to_transform leaves it nothing: peft applies both.  Was "target_modules=['qkv'] match
        # no module of this model; its blocks' Linears are attn.qkv, ...", blaming the module the list then named.
        (
            {"options": '{"layers_pattern": "blocks", "layers_to_transform": [7]}'},
            "options: layers_to_transform [7] match no layer of target_modules=['qkv'] on this model (3 blocks): "
            "peft reads the layer indices 0, 1, 2 here (by layers_pattern 'blocks'): give some of those",
        ),
        # Without layers_pattern peft reads no index in a ViT's names (blocks.N opens them).
        (
            {"options": '{"layers_to_transform": [1]}'},
            'peft reads no layer index in their names: give options {"layers_pattern": "blocks"}',
        ),
        # A layer past the depth beside one within it: peft adapted block 0 and passed over 99.
        (
            {"options": '{"layers_pattern": "blocks", "layers_to_transform": [0, 99]}'},
            "options: layers_to_transform [99] match no layer of target_modules=['qkv'] on this model (3 blocks)",
        ),
        # None at all failed inside peft ("argument of type 'NoneType' is not iterable").
        ({"target_modules": []}, "target_modules is empty and options names none: give the modules to adapt"),
    ],
)
def test_peft_refuses_a_target_module_that_matches_nothing(options, message):
    model = make_tiny_vit()
    with pytest.raises(ValueError, match=re.escape(message)):
        petl.apply(model, "peft", num_classes=3, **options)
    assert not any(p.requires_grad is False for p in model.parameters())  # refused before anything was frozen


def test_peft_layer_indices_on_a_swin_are_named_as_peft_reads_them():
    # peft reads a Swin's layers.S.blocks.N as layer N (the block within its stage): index 3 of petl's four blocks
    # matches none, and the refusal said "target_modules=['qkv'] match no module", naming no index that would.
    from conftest import make_tiny_swin

    with pytest.raises(ValueError, match=re.escape("peft reads the layer indices 0, 1 here (by the first numbered")):
        petl.apply(make_tiny_swin(), "peft", num_classes=3, options='{"layers_to_transform": [3]}')


def test_peft_takes_target_parameters_in_place_of_target_modules():
    # peft's target_parameters (LoRA on a module's parameter) names no module: it was refused as naming no target.
    model = petl.apply(
        make_tiny_vit(),
        "peft",
        num_classes=3,
        target_modules=[],
        options='{"target_parameters": ["attn.qkv.weight"], "r": 2}',
    )
    assert any("qkv.lora_A" in name for name, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("override", "key", "where"),
    [
        # Hydra's + adds a key to a typed node too: the typo of train.lr ran at the default lr, read by nothing.
        ("+train.lrr=0.1", "train.lrr", "under 'train': epochs, lr, "),
        ("++data.subsett=8", "data.subsett", "under 'data': name, split, "),
        ("+model.pretrain=false", "model.pretrain", "under 'model': name, pretrained, "),
        ("+seeds=3", "seeds", "at the top level: method, data, model, train, seed, output_dir, resume"),
    ],
)
def test_petl_run_refuses_a_key_added_with_plus_that_nothing_reads(tmp_path, capsys, override, key, where):
    from conftest import command_status, tiny_run

    from petl.cli import run as run_cli

    # A tiny run: without the check it trained, at the default of what the typo meant.
    argv = [*tiny_run(epochs=1), override, f"output_dir={tmp_path / 'run'}"]
    code, _, error = command_status(capsys, run_cli.main, *argv)
    assert code == 2 and error.count("\n") == 1, error
    assert error.startswith(f"petl-run: error: unknown config key '{key}' (a + before a key adds it, and nothing")
    assert where in error
    assert not (tmp_path / "run").exists()


def test_free_form_model_kwargs_are_still_added_with_plus():
    from petl.train.config import default_config

    assert default_config(["+model.kwargs.depth=2", "++model.kwargs.qkv_bias=false"]).model.kwargs.depth == 2


# 64 images in one batch, 2 epochs: 2 steps.  0.05 of them rounds down to none, and ran as warmup_frac=0 would; 0.5
# to one, whose step runs at the full lr (the first step of a warm-up of w runs at 1/w of it): it was taken and said
# "0.5 or more" warms up.
@pytest.mark.parametrize("warmup_frac", ["0.05", "0.5"])
def test_a_warmup_fraction_that_warms_up_no_step_is_refused_before_anything_is_written(tmp_path, capsys, warmup_frac):
    from conftest import command_status, tiny_run

    from petl.cli import run as run_cli

    argv = [*tiny_run(subset=64, epochs=2), f"train.warmup_frac={warmup_frac}", f"output_dir={tmp_path / 'run'}"]
    code, _, error = command_status(capsys, run_cli.main, *argv)
    assert code == 2 and error.count("\n") == 1, error
    assert error.startswith(
        f"petl-run: error: train.warmup_frac={warmup_frac} cannot act: the run takes 2 optimizer steps (2 epochs of "
        f"1), and {warmup_frac} of them warms up for none (a warm-up of one step runs that step at the full lr); give "
        "train.warmup_frac=1 or more, or 0"
    ), error
    assert not (tmp_path / "run").exists()


def test_the_least_warmup_fraction_the_refusal_names_warms_up():
    import torch

    from petl.train.engine import TrainSettings, build_optimizer

    # The 2-step run above: warmup_frac=1 runs its first step at half the lr; 0.5 ran both at the full lr.
    for warmup_frac, first_lr in ((1.0, 0.5), (0.5, 1.0), (0.0, 1.0)):
        optimizer, _ = build_optimizer(
            torch.nn.Linear(2, 2), TrainSettings(epochs=2, lr=1.0, warmup_frac=warmup_frac), 1
        )
        assert optimizer.param_groups[0]["lr"] == first_lr


@pytest.mark.parametrize("warmup_frac", ["1", "0", "0.1"])  # two steps, none asked, the default
def test_a_warmup_fraction_that_acts_or_asks_for_none_is_taken(tmp_path, warmup_frac):
    from conftest import tiny_run

    from petl.train.config import default_config
    from petl.train.runner import train

    out = tmp_path / "run"
    train(default_config([*tiny_run(subset=64, epochs=2), f"train.warmup_frac={warmup_frac}", f"output_dir={out}"]))
    assert (out / "result.json").exists()


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        # Only a run on your own images reads a budget or --yes: a suite's sweep answered nothing within the budget.
        (["budget.params=1M"], "budget.params=1M"),
        (["budget.train_seconds=600", "--dry-run"], "budget.train_seconds=600"),
        (["--yes"], "--yes"),
        (["suite=choose", "yes=true"], "--yes"),
    ],
)
def test_bench_refuses_a_budget_or_yes_without_own_data(tmp_path, capsys, monkeypatch, argv, shown):
    from conftest import command_status

    from petl.cli import bench as bench_cli

    monkeypatch.chdir(tmp_path)
    suite = [] if any(a.startswith("suite=") for a in argv) else ["suite=mini"]
    code, _, error = command_status(capsys, bench_cli.main, "run", *suite, "methods=linear", "seeds=0", *argv)
    assert code == 2 and error.count("\n") == 1, error
    assert error.startswith(f"petl-bench: error: {shown} acts on a run on your own images only (suite=choose "), error
    assert error.rstrip().endswith(f"add data=, or drop {shown.split('=')[0] + '=' if '=' in shown else shown}")
    assert not (tmp_path / "runs").exists()


def test_bench_takes_yes_false_without_own_data(tmp_path, capsys, monkeypatch):
    from conftest import command_status

    from petl.cli import bench as bench_cli

    monkeypatch.chdir(tmp_path)
    argv = ["run", "suite=mini", "methods=linear", "seeds=0", "tasks=mini/digits", "yes=false", "--dry-run"]
    code, out, error = command_status(capsys, bench_cli.main, *argv)
    assert code == 0 and "todo" in out, error
