"""Several processes, one run: a launch without a process group is refused; real DDP on CPU makes one run.

``accelerate launch --multi_gpu --num_processes 2`` on a machine without GPUs sets RANK and WORLD_SIZE in
two processes that form no group: each would train alone into the same folder.  With
``ACCELERATE_USE_CPU=1`` the two processes form a gloo group and train one run together.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_run
from safetensors.torch import load_file

from petl.data import mini
from petl.train import build

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    # No GPU: on a GPU machine LOCAL_RANK would make accelerate wait for a NCCL group of two.
    # The checkout first, then what the caller had there (a GPU image's carried packages: hydra, omegaconf).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, **extra}


def _free_port() -> int:
    # A port of its own per launch: tests run side by side (pytest-xdist) would otherwise meet on one fixed port.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Two processes on this machine's CPUs, as ``accelerate launch --multi_gpu --num_processes 2`` starts them."""
    port = str(_free_port())
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    return subprocess.run([*launch, *args], cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_launch_of_several_processes_without_a_process_group_is_refused(tmp_path):
    done = _launch("-m", "petl.run", *tiny_run(), "output_dir=out", cwd=tmp_path)
    assert done.returncode != 0
    refusal = (
        "petl-run: error: RANK/WORLD_SIZE say 2 processes but accelerate formed no process group, so each would "
        "train alone into the same output_dir: on CPUs launch with ACCELERATE_USE_CPU=1 accelerate launch "
        "--multi_gpu --num_processes N -m petl.run ..., or run petl-run as one process"
    )
    assert done.stderr.splitlines().count(refusal) == 1, done.stderr[-3000:]  # said by rank 0 only
    assert not (tmp_path / "out").exists()


# Each rank runs petl-run's entry point; _record is wrapped to keep every rank's trained tensors as well.
_DRIVER = """
    import sys
    import torch
    from petl.model.params import trainable_state
    from petl.cli import run as cli
    from petl.train import runner

    record = runner._record

    def kept(cfg, out, model, result, accelerator, card):
        state = {k: v.detach().cpu().clone() for k, v in trainable_state(accelerator.unwrap_model(model)).items()}
        torch.save(state, f"rank{accelerator.process_index}.pt")
        record(cfg, out, model, result, accelerator, card)

    runner._record = kept
    cli.main(sys.argv[1:])
"""


def _one_process_top1(out: Path, overrides: list[str], split: str, bf16: bool) -> float:
    """Top-1 of a finished run's saved weights over every image of ``split``, evaluated here in one process."""
    from petl.run import default_config
    from petl.store.run_card import load_run

    run = load_run(out)
    cfg = default_config(overrides)
    dataset = build.datasets(cfg, build.create_backbone(cfg))[split]
    right = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for images, labels in torch.utils.data.DataLoader(dataset, batch_size=7):
            right += int((run.model(images).argmax(-1) == torch.as_tensor(labels)).sum())
    return 100 * right / len(dataset)


# bf16: make_accelerator asks accelerate's PartialState about the device before the Accelerator exists; that
# state must be the CPU one ACCELERATE_USE_CPU asks for, or no process group forms.  linear trains on features
# cached by every process (the whole split each), lora on images.
@pytest.mark.slow
@pytest.mark.parametrize(("precision", "method"), [("no", "lora"), ("bf16", "linear")])
def test_two_cpu_processes_train_one_run_with_ddp(tmp_path, precision, method):
    (tmp_path / "driver.py").write_text(textwrap.dedent(_DRIVER))
    # 49 images in batches of 16 a process: the fourth batch has 1, so the second process's sampler pads it with
    # repeated images (so both step together); the record counts the 49 real ones, not the padding (it once said
    # 128 an epoch for 20 images in batches of 64).  One process leaves a lone last image out (a BatchNorm cannot
    # train on it); two never see one, and leaving it out dropped the last round of batches: 32 images an epoch.
    # Val and test (49 each) in batches of 8: the last round is padded too, and the padding must not be scored.
    data = [*tiny_run(subset=49, epochs=2, batch_size=16), f"method={method}", "train.eval_batch_size=8"]
    overrides = [*data, "output_dir=out", f"train.precision={precision}"]
    done = _launch("driver.py", *overrides, cwd=tmp_path, ACCELERATE_USE_CPU="1")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["epochs"] == 2 and result["num_processes"] == 2
    assert result["feature_cache"] == ("pre-logits features" if method == "linear" else None)
    epochs = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [epoch["epoch"] for epoch in epochs] == [1, 2]
    # 4 batches of 16 are 2 a process: 2 optimizer steps an epoch, each stepping the scheduler once per process, so
    # the cosine spans 8; counted from the unsharded loader it ended early and the last steps ran at lr 0.
    cosine = [1e-3 * 0.5 * (1 + math.cos(math.pi * count / 8)) for count in (2, 6)]  # each epoch's last step
    assert [epoch["lr"] for epoch in epochs] == pytest.approx(cosine)
    # The learning verdict's chance: the most frequent label's share of the same 49 images, padding left out.
    labels = build._subset(torch.utils.data.TensorDataset(torch.from_numpy(mini.digits().split("train800")[1])), 49)
    majority = 100 * int(torch.bincount(torch.stack([label for (label,) in labels])).max()) / 49
    for epoch in epochs:
        assert epoch["images"] == 49, epoch
        correct = epoch["train_top1"] * 49 / 100  # the accuracy is over the same 49: a whole number of them right
        assert abs(correct - round(correct)) < 1e-6, epoch
        assert epoch["majority_top1"] == pytest.approx(majority), epoch
    # The recorded accuracies are those of the saved weights over exactly the split's images.
    bf16 = result["precision"] == "bf16"
    for split in ("val", "test"):
        one = _one_process_top1(tmp_path / "out", data, split, bf16)
        assert result[f"{split}_top1"] == pytest.approx(one, abs=1e-9), split
    assert epochs[-1]["val_top1"] == result["val_top1"]
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["out"]
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    assert ranks[0].keys() == ranks[1].keys() and ranks[0]
    for name in ranks[0]:
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
    saved = load_file(tmp_path / "out" / "trainable.safetensors")
    assert set(saved) == set(ranks[0])


# The second process alone fails as the test pass starts (a fault on its shard): the first waits on it.
_FAILING_DRIVER = """
    import os
    import sys
    from petl.cli import run as cli
    from petl.train import runner

    test_once = runner._evaluate_test_once

    def failing(training):
        if os.environ["RANK"] == "1":
            raise runner.RunError("the test split failed on this process")
        return test_once(training)

    runner._evaluate_test_once = failing
    cli.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_failure_of_one_process_is_said_by_it_and_ends_the_launch(tmp_path):
    (tmp_path / "driver.py").write_text(textwrap.dedent(_FAILING_DRIVER))
    done = _launch("driver.py", *tiny_run(epochs=1), "output_dir=out", cwd=tmp_path, ACCELERATE_USE_CPU="1")
    assert done.returncode == 1, done.stderr[-3000:]  # the launcher's status for a failed process
    # Said by rank 0 only, it was never said: the launch ended on rank 0's lost connection to rank 1.
    line = "petl-run: error: rank 1: the test split failed on this process"
    said = [said for said in done.stderr.splitlines() if "failed on this process" in said]
    assert said == [line], done.stderr[:3000]
    out = tmp_path / "out"
    assert not (out / "result.json").exists() and (out / "checkpoint.pt").is_file()  # the finished epoch is kept


def test_accelerate_cpu_launch_of_several_processes_says_it_runs_one(tmp_path):
    # accelerate's --cpu takes its simple launcher, which starts one process whatever --num_processes asks.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    launch += "--num_machines 1 --mixed_precision no --dynamo_backend no --main_process_port".split()
    launch.append(str(_free_port()))
    done = subprocess.run(
        [*launch, "-m", "petl.run", *tiny_run(epochs=1), "output_dir=out"],
        cwd=tmp_path,
        env=_env(),  # with --cpu, accelerate reads no config file of this machine's user
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = (done.stdout + done.stderr).splitlines()
    note = "accelerate launch --cpu started one process whatever --num_processes says: training as one process"
    assert sum(note in line for line in said) == 1, done.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "result.json").read_text())["num_processes"] == 1


def test_a_single_process_run_says_nothing_of_processes(monkeypatch):
    for name in ("ACCELERATE_USE_CPU", "MASTER_ADDR", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert build.single_cpu_launch(1) == ""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")  # accelerate launch --cpu of one process sets no MASTER_ADDR
    assert build.single_cpu_launch(1) == ""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert build.single_cpu_launch(1).startswith("accelerate launch --cpu started one process")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a torchrun-style launch: check_process_group's case, not this one
    assert build.single_cpu_launch(1) == ""


@pytest.mark.parametrize(("rank", "lines"), [("0", 1), ("1", 0)])
def test_a_fault_of_the_data_or_config_every_process_meets_is_warned_by_the_first(
    rank, lines, tmp_path, caplog, monkeypatch
):
    # Each process of a launch read the same folder and config, and each said their faults: one line per GPU.
    from omegaconf import OmegaConf
    from PIL import Image

    from petl.data import folder
    from petl.utils import once

    monkeypatch.setattr(once, "SAID", set())  # what earlier tests in this process said
    monkeypatch.setenv("RANK", rank)
    images = [f"train/{name}/{i}.png" for name in ("red", "blue") for i in range(3)]
    for path in (*images, "train/stray.png"):  # an image outside the class folders
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(tmp_path / path)
    train = {"trackers": [], "precision": "bf16", "compile": False, "grad_accum": 1}
    monkeypatch.setattr(build, "run_device_type", lambda: "cpu")
    monkeypatch.setattr(build, "cpu_supports_bf16", lambda: False)
    with caplog.at_level("WARNING"):
        folder.describe_folder(str(tmp_path))
        build.make_accelerator(OmegaConf.create({"train": train}), tmp_path / "out")  # bf16 on a CPU without it
    said = [record.getMessage() for record in caplog.records]
    assert sum(message.startswith("folder: skipped stray.png in ") for message in said) == lines, said
    assert sum("train.precision=bf16: this CPU has no bf16 instructions" in message for message in said) == lines, said


@pytest.mark.parametrize("missing", ["data", "weights"])
@pytest.mark.parametrize(("rank", "local_rank", "said"), [("0", "0", ""), ("1", "1", None), ("2", "0", "rank 2: ")])
def test_data_or_weights_out_of_reach_are_said_by_the_first_process_of_each_machine(
    missing, rank, local_rank, said, tmp_path, monkeypatch, capsys
):
    # Every process of a launch builds the data and the backbone and met their faults alike: each said 'rank N: ...',
    # one line per GPU.  The first process of each machine says it (another machine may have what this one lacks);
    # every process exits 1.
    import timm

    from petl import data as petl_data
    from petl.cli import run as cli
    from petl.train import runner

    def no_data(*args, **kwargs):
        raise petl_data.DatasetUnavailableError("mini/digits needs scikit-learn: `pip install scikit-learn`")

    create_model = timm.create_model

    def no_weights(*args, **kwargs):
        if kwargs.get("pretrained"):
            raise OSError("the hub cannot be reached")
        return create_model(*args, **kwargs)

    monkeypatch.setattr(petl_data, "build_dataset", no_data)
    monkeypatch.setattr(timm, "create_model", no_weights)
    # The run as far as its data (LOCAL_RANK alone, with no process group, would stop accelerate before it).
    monkeypatch.setattr(runner, "run", lambda cfg, checked=False: build.datasets(cfg, build.create_backbone(cfg)))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    if missing == "data":
        monkeypatch.setattr(build, "create_backbone", lambda cfg: None)
        monkeypatch.setattr(build, "_image_options", lambda cfg, model: {})
        args, why = tiny_run(), "mini/digits needs scikit-learn: `pip install scikit-learn`"
    else:
        args = [o for o in tiny_run() if not o.startswith(("+model.kwargs", "model.pretrained"))]
        why = "cannot load pretrained weights of vit_fractal_tiny_patch4_32: the hub cannot be reached."
    with pytest.raises(SystemExit) as stop:
        cli.main([*args, f"output_dir={tmp_path / 'out'}"])
    assert stop.value.code == 1
    error = capsys.readouterr().err
    assert error == "" if said is None else error.startswith(f"petl-run: error: {said}{why}") and error.count("\n") == 1
