"""A value that has no effect is refused in one line naming it (exit 2 from a command), never silently ignored.

Found by a pass over every user-settable value: petl-predict's options that act on one side of ``data=`` only.
"""

from __future__ import annotations

import pytest

from petl.cli import predict as predict_cli


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
