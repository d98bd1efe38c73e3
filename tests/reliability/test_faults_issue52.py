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
        "backbone.kwargs.pretrained_cfg_overlay would make timm load a file",
        "backbone.checkpoint",
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
        "petl-serve": (serve_cli.main, [str(run_dir), "port=1"]),  # refused while loading: never binds
    }
    for prog, (main, argv) in commands.items():
        code, error = _main(main, argv, capsys)
        assert code == 2, f"{prog}: {error}"
        assert error.startswith(f"{prog}: error: {run_dir / 'model.json'}: ") and error.count("\n") == 1, error
        assert all(message in error for message in messages), error
    assert not (tmp_path / "exported").exists()
