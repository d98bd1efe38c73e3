"""Faults and bad input, issue 52 part A: a run card (model.json) petl cannot build, or that would steer file
loading, is one line naming the file and the key in petl-predict, petl-export and petl-serve (exit 2); options
that would hang or break the server are refused; petl-predict --quiet without out= is refused; hidden class
folders are named.

Each test goes through a public entry point (the commands' mains, the dataset builder).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_run_card import _edit_card, _run_folder

from petl.cli import export as export_cli
from petl.cli import predict as predict_cli
from petl.cli import serve as serve_cli


def _main(main, argv: list[str], capsys) -> tuple[int, str]:
    """A command's exit status and its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code, capsys.readouterr().err


def _image(path: Path) -> Path:
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 36, 3), dtype=np.uint8)).save(path)
    return path


CARD_EDITS = {
    "an unknown kwarg": (
        lambda card: card["backbone"]["kwargs"].update(nonsense=3),
        "backbone.kwargs {",
        "unexpected keyword argument 'nonsense'",
    ),
    "a kwarg of the wrong kind": (
        lambda card: card["backbone"]["kwargs"].update(depth="deep"),
        "backbone.kwargs {",
        "cannot build",
    ),
    "an unknown backbone": (
        lambda card: card["backbone"].update(name="vit_nosuch_patch1"),
        "backbone.name 'vit_nosuch_patch1' is not a model timm",
        "restore the run's model.json",
    ),
    "an unknown method": (lambda card: card.update(method="nosuch"), "method: unknown method 'nosuch'", "lora"),
    "another method than the weights": (lambda card: card.update(method="vpt"), "method is 'vpt'", "holds 'lora'"),
    # model.json never steers file loading: timm would have read these files as weights.
    "pretrained_cfg_overlay": (
        lambda card: (
            card["backbone"].update(pretrained=True),
            card["backbone"]["kwargs"].update(pretrained_cfg_overlay={"file": "/etc/passwd"}),
        ),
        "backbone.kwargs.pretrained_cfg_overlay.file: petl takes only input_size of it",
        "load a file petl does not check",
    ),
    "checkpoint_path": (
        lambda card: card["backbone"]["kwargs"].update(checkpoint_path="/etc/passwd"),
        "backbone.kwargs.checkpoint_path would make timm load a file",
        "backbone.checkpoint",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CARD_EDITS))
def test_a_card_petl_cannot_build_is_one_line_naming_model_json_and_the_key(tmp_path, capsys, case):
    edit, *messages = CARD_EDITS[case]
    run_dir = _run_folder(tmp_path / "run")
    _edit_card(run_dir, edit)
    image = _image(tmp_path / "a.png")
    commands = {
        "petl-predict": (predict_cli.main, [str(run_dir), str(image)]),
        "petl-export": (export_cli.main, [str(run_dir), f"out={tmp_path / 'exported'}"]),
        "petl-serve": (serve_cli.main, [str(run_dir), "port=0"]),  # refused while loading: never listens
    }
    for prog, (main, argv) in commands.items():
        code, error = _main(main, argv, capsys)
        assert code == 2, f"{prog}: {error}"
        assert error.startswith(f"{prog}: error: {run_dir / 'model.json'}: ") and error.count("\n") == 1, error
        assert all(message in error for message in messages), error
    assert not (tmp_path / "exported").exists()


def test_quiet_without_out_is_refused_before_anything_loads(tmp_path, capsys):
    """Issue 52: petl-predict RUN IMG --quiet without out= printed nothing and exited 0."""
    (tmp_path / "run").mkdir()  # never read: the command line is refused first
    code, error = _main(predict_cli.main, [str(tmp_path / "run"), str(tmp_path / "a.png"), "--quiet"], capsys)
    assert code == 2
    assert error == (
        "petl-predict: error: --quiet without out= shows and writes nothing: add out=FILE.csv or drop --quiet\n"
    )


def _labelled_folder(root: Path, classes: int = 3) -> Path:
    """``root/{train,test}/c<i>/*.png``: the class names of :func:`_run_folder`'s runs."""
    for split in ("train", "test"):
        for index in range(classes):
            (root / split / f"c{index}").mkdir(parents=True)
            for item in range(2):
                _image(root / split / f"c{index}" / f"{item}.png")
    return root


def test_predict_writes_over_nothing_it_did_not_write_without_overwrite(tmp_path, capsys):
    """Issue 52: petl-predict out=notes.csv replaced the user's file; out=/confusion= in another run's folder
    replaced that run's files (only the runs given were checked)."""
    run_dir, other = _run_folder(tmp_path / "run"), _run_folder(tmp_path / "other", seed=1)
    (other / "result.json").write_text("{}")
    image = _image(tmp_path / "a.png")
    data = _labelled_folder(tmp_path / "images")
    evaluate = ["data=folder", f"data.root={data}"]
    mine = {name: tmp_path / name for name in ("notes.csv", "cm.png", "cm_run.png")}
    for path in mine.values():
        path.write_text(f"the user's own {path.name}")
    others = {p.name: p.read_bytes() for p in other.iterdir()}

    def refused(argv: list[str], message: str, runs: tuple[Path, ...] = (run_dir,)) -> None:
        code, error = _main(predict_cli.main, [*map(str, runs), *argv], capsys)
        assert code == 2 and message in error and error.count("\n") == 1, error

    refused([str(image), f"out={mine['notes.csv']}"], f"{mine['notes.csv']} already exists: write elsewhere, or add")
    refused([*evaluate, f"confusion={mine['cm.png']}"], "cm.png already exists")
    # Several runs: each matrix goes to cm_<run>.png, each checked.
    refused([*evaluate, f"confusion={mine['cm.png']}"], "cm_run.png already exists", (run_dir, other))
    for target in (other / "preds.csv", other / "sub" / "p.csv", run_dir / "p.json"):
        refused([str(image), f"out={target}", "overwrite=true"], "is inside the run folder")
    refused([*evaluate, f"confusion={other / 'cm.png'}", "overwrite=true"], f"inside the run folder {other}")
    refused([str(image), f"out={tmp_path / 'p.csv'}", "overwrite=yes"], "overwrite='yes': expected boolean")
    # Options that act only on one side of data= are refused rather than ignored.
    refused([*evaluate, f"out={tmp_path / 'p.csv'}"], "with data= it would write nothing: drop out=")
    refused([str(image), f"confusion={tmp_path / 'new.png'}"], "confusion= acts only with data=")
    assert {name: path.read_text() for name, path in mine.items()} == {n: f"the user's own {n}" for n in mine}
    assert {p.name: p.read_bytes() for p in other.iterdir()} == others
    assert not list(tmp_path.glob("p.*")) and not (tmp_path / "new.png").exists()
    # Asked for, the files are replaced.
    argv = [str(run_dir), str(image), f"out={mine['notes.csv']}", "overwrite=true", "--quiet"]
    code, error = _main(predict_cli.main, argv, capsys)
    assert code == 0, error
    assert mine["notes.csv"].read_text().startswith("path,")
    argv = [str(run_dir), *evaluate, f"confusion={mine['cm.png']}", "overwrite=true", "--quiet"]
    code, error = _main(predict_cli.main, argv, capsys)
    assert code == 0, error
    assert Image.open(mine["cm.png"]).format == "PNG"


def test_a_hidden_class_folder_with_images_is_named_in_a_warning(tmp_path, caplog):
    """Issue 52: a class folder named .purple was dropped silently.  Decision: names starting with '.' are not
    classes (.git, .ipynb_checkpoints; Hugging Face's imagefolder skips them too); one holding images is named."""
    from petl.data.folder import describe_folder

    for name in ("red", "blue", ".purple"):
        (tmp_path / "train" / name).mkdir(parents=True)
        for i in range(3):
            _image(tmp_path / "train" / name / f"{i}.png")
    (tmp_path / "train" / ".git").mkdir()  # no images: no word about it
    with caplog.at_level("WARNING", logger="petl.data.folder"):
        info = describe_folder(str(tmp_path))
    assert info.num_classes == 2
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 1 and "skipped .purple in " in warned[0] and ".git" not in warned[0], warned
    assert "rename them to use them" in warned[0]


def test_serve_options_are_finite_and_in_range():
    """Issue 52: max_wait_ms=inf hung every request, max_upload_mb=inf made every predict a 500."""
    serve = pytest.importorskip("petl.deploy.serve", reason="petl-serve's extra is not installed")
    for name, value in [("max_wait_ms", float("inf")), ("max_upload_mb", float("inf")), ("max_image_mp", 0.0),
                        ("max_batch", 0), ("max_connections", True), ("shutdown_timeout_s", float("nan"))]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{name}=.*: must be a number from "):
            serve.ServeOptions(**{name: value})
    serve.ServeOptions()  # the defaults are in range
    # petl-serve --help lists the defaults without importing FastAPI: they are ServeOptions' own.
    listed = {key.name: key.default for key in serve_cli.KEYS if key.name in serve_cli.SERVE_OPTIONS}
    assert listed == {name: getattr(serve.ServeOptions(), name) for name in serve_cli.SERVE_OPTIONS}
    assert set(serve.OPTION_RANGES) < set(serve_cli.SERVE_OPTIONS)  # every range-checked option is a CLI key


@pytest.mark.slow
def test_a_taken_port_exits_1_naming_it(tmp_path, capsys):
    """Issue 52: a port in use exited 3 (uvicorn's start-up failure), documented 1: petl's status for a server
    that could not run is 1, with one line naming the address."""
    pytest.importorskip("fastapi", reason="petl-serve's extra is not installed")
    import socket

    run_dir = _run_folder(tmp_path / "run")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, error = _main(serve_cli.main, [str(run_dir), f"port={port}", "--quiet"], capsys)
    assert code == 1
    assert error.splitlines()[-1] == (
        f"petl-serve: error: cannot listen on 127.0.0.1:{port}: the port is in use: stop what holds it, or choose "
        "another port="
    )
