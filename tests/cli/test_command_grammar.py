"""One grammar for every petl-* command: key=value and flags in any order; --help lists what each command takes."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import command_status

from petl.cli import args as grammar
from petl.cli import bench, export, predict, pretrain, run_help, serve
from petl.cli import run as run_cli

ROOT = Path(__file__).resolve().parents[2]


def _words(module, argv):
    parsed = grammar.parse(module.build_parser(), argv)
    return parsed, grammar.split_items(parsed.words, module.KEYS, module.PROG)


@pytest.mark.parametrize(
    "argv",
    [
        ["RUN", "a.png", "--quiet", "out=preds.csv"],
        ["--quiet", "RUN", "out=preds.csv", "a.png"],
        ["RUN", "out=preds.csv", "--quiet", "a.png"],
    ],
)
def test_petl_predict_takes_flags_and_key_values_in_any_order(argv):
    parsed, (positional, options) = _words(predict, argv)
    assert parsed.quiet and not parsed.merge
    assert positional == ["RUN", "a.png"] and options == {"out": "preds.csv"}


def test_petl_export_takes_out_before_or_after_the_run():
    for argv in (["RUN", "out=model.onnx"], ["out=model.onnx", "RUN"]):
        _, (positional, options) = _words(export, argv)
        assert positional == ["RUN"] and options == {"out": "model.onnx"}


@pytest.mark.parametrize(
    "argv",
    [
        ["runs/a", "--quiet", "port=9000", "task.pets=runs/b"],
        ["--quiet", "task.pets=runs/b", "port=9000", "runs/a"],
        ["port=9000", "runs/a", "task.pets=runs/b", "--quiet"],
    ],
)
def test_petl_serve_takes_flags_key_values_and_task_names_in_any_order(argv):
    parsed = grammar.parse(serve.build_parser(), argv)
    positional, options = grammar.split_items(parsed.words, serve.KEYS, serve.PROG, prefixes=(serve.TASK_PREFIX,))
    assert parsed.quiet and options == {"port": 9000}
    assert sorted(positional) == ["runs/a", "task.pets=runs/b"]


def test_an_unknown_key_or_a_wrong_type_is_one_line_naming_it():
    with pytest.raises(grammar.CommandLineError, match="unknown option 'outt'"):
        _words(predict, ["RUN", "a.png", "outt=x.csv"])
    with pytest.raises(grammar.CommandLineError, match="top_k='many': expected int"):
        _words(predict, ["RUN", "a.png", "top_k=many"])


@pytest.mark.parametrize(
    ("host", "message"),
    [
        # An empty host loaded every run, then failed to bind: exit 1 ("Name or service not known").
        ("", "host='' is not an IP address or a host name"),
        ("http://example.com", "is not an IP address or a host name"),
        ("1.2.3.4.5", "is not an IP address or a host name"),
        ("0.0.0.0:9000", "give the port apart, as host=0.0.0.0 port=9000"),
    ],
)
def test_petl_serve_refuses_an_empty_or_malformed_host_before_loading_runs(host, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve.main([str(tmp_path / "not-a-run"), f"host={host}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1", "localhost", "gpu-node_7.cluster.local"])
def test_petl_serve_takes_addresses_and_host_names(host):
    serve.check_host(host)


def test_petl_export_refuses_a_missing_out_with_status_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        export.main(["RUN"])
    assert exit_.value.code == 2 and "no out= given: petl-export RUN out=FOLDER|" in capsys.readouterr().err


def test_petl_export_s_missing_out_line_quotes_a_run_folder_holding_a_space(capsys):
    # Was "petl-export my runs/x out=...": copied, the shell gives petl-export two run folders.
    with pytest.raises(SystemExit):
        export.main(["my runs/x"])
    assert "no out= given: petl-export 'my runs/x' out=FOLDER|" in capsys.readouterr().err


# Every console script with each kind of bad flag it can meet (an unknown flag, a flag missing its value, a bad choice,
# no arguments where some are required), and what its one line must say: the argparse-built parsers printed their
# usage first (petl-run: Hydra's, 7 lines), petl-bench report and compare printed their usage as the line.
BAD_FLAGS = [
    (run_cli, ["--bogus"], "unrecognized arguments: --bogus (see petl-run --help)"),
    (run_cli, ["method=lora", "--cfg"], "argument --cfg/-c: expected one argument (see petl-run --help)"),
    (run_cli, ["--cfg", "bogus"], "argument --cfg/-c: invalid choice: 'bogus' (choose from 'job', 'hydra', 'all')"),
    (pretrain, ["--bogus"], "unrecognized arguments: --bogus (see petl-pretrain --help)"),
    (pretrain, ["--epochs"], "argument --epochs: expected one argument (see petl-pretrain --help)"),
    (pretrain, ["--precision", "fp8"], "argument --precision: invalid choice: 'fp8' (choose from"),
    (predict, ["RUN", "a.png", "--bogus"], "unrecognized arguments: --bogus (see petl-predict --help)"),
    (predict, ["RUN", "--quiet=yes"], "argument --quiet: ignored explicit argument 'yes' (see petl-predict --help)"),
    (predict, [], "no run folder given: petl-predict RUN_DIR"),
    (export, ["--bogus", "RUN", "out=x.onnx"], "unrecognized arguments: --bogus (see petl-export --help)"),
    (export, [], "no run folder given: petl-export RUN_DIR out="),
    (export, ["RUN", "out="], "expected RUN_DIR out="),
    (serve, ["RUN", "--bogus"], "unrecognized arguments: --bogus (see petl-serve --help)"),
    (serve, ["--quiet=yes", "RUN"], "argument --quiet: ignored explicit argument 'yes' (see petl-serve --help)"),
    (serve, [], "no run folder given"),
    (bench, ["--bogus"], "unknown command '--bogus'"),
    (bench, [], "no suite= given"),
    (bench, ["commands", "methods=lora"], "no suite= given: name one (petl-bench list shows each"),
    (bench, ["run", "--bogus"], "unknown flag '--bogus'"),
    (bench, ["list", "--bogus"], "expected key=value, got '--bogus' (see petl-bench --help)"),
    (bench, ["list", "suit=mini"], "unknown argument(s) ['suit=mini']; known: configs_dir, suite"),
    (bench, ["report", "--bogus"], "unknown flag '--bogus'"),
    (bench, ["compare", "a", "b", "--bogus"], "unknown flag '--bogus'"),
    (bench, ["report"], "expected RESULTS_DIR [out=DIR] [configs_dir=DIR] [suite=NAME], got nothing"),
    (bench, ["compare"], "[configs_dir=DIR], got nothing"),
    (bench, ["compare", "a", "b", "suites=x"], "suites=x: name two suites"),
    (bench, ["speed", "options=bogus"], "options=bogus: choose among"),
]


@pytest.mark.parametrize(
    ("module", "argv", "said"), BAD_FLAGS, ids=[f"{m.PROG} {' '.join(a)}".strip() for m, a, _ in BAD_FLAGS]
)
def test_a_bad_flag_is_one_line_prog_error_and_exit_2(module, argv, said, capsys):
    code, _, err = command_status(capsys, module.main, *argv)
    assert code == 2 and err.count("\n") == 1, err
    assert re.match(rf"{module.PROG}( \w+)?: error: ", err) and said in err, err


@pytest.mark.parametrize("module", [run_cli, pretrain, predict, export, serve], ids=lambda m: m.PROG)
def test_every_command_parser_is_the_one_line_parser(module):
    made = grammar.hydra_parser(module.PROG) if module is run_cli else module.build_parser()
    assert isinstance(made, grammar.Parser)
    with pytest.raises(grammar.CommandLineError, match=rf"^unrecognized arguments: --x \(see {module.PROG} --help\)$"):
        made.parse_args(["--x"])


@pytest.mark.parametrize("module", [predict, export, serve], ids=lambda m: m.PROG)
def test_an_unknown_key_exits_2_with_one_line(module, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.main(["RUN", "colour=red"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"{module.PROG}: error: unknown option 'colour'")


@pytest.mark.parametrize("module", [predict, export, serve], ids=lambda m: m.PROG)
def test_help_lists_every_key_and_flag_the_command_takes(module, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    for key in module.KEYS:
        assert f"{key.name}=VALUE" in text
    flags = {o for a in module.build_parser()._actions for o in a.option_strings}
    assert flags <= set(re.findall(r"--?[\w-]+", text))
    # The help names no option the command would refuse (export's `out` is a key, not a positional).
    assert "positional arguments" not in text


def test_petl_pretrain_takes_name_value_as_its_flags():
    made = pretrain.build_parser()
    argv = pretrain.as_flags(["epochs=3", "--seed", "4", "batch_size=16", "--overwrite"], made)
    parsed = made.parse_args(argv)
    assert (parsed.epochs, parsed.seed, parsed.batch_size, parsed.overwrite) == (3, 4, 16, True)


def test_petl_pretrain_takes_a_switch_as_name_true_or_false():
    # overwrite=true (petl-predict's and petl-export's grammar) became '--overwrite true': "unrecognized arguments".
    made = pretrain.build_parser()
    parsed = made.parse_args(pretrain.as_flags(["overwrite=true", "no_progress=False", "epochs=3"], made))
    assert (parsed.overwrite, parsed.no_progress, parsed.epochs) == (True, False, 3)
    with pytest.raises(pretrain.CommandLineError, match=r"^overwrite=yes: expected true or false \(--overwrite alone"):
        pretrain.as_flags(["overwrite=yes"], made)


def test_petl_run_reads_hydra_flags_anywhere():
    made = grammar.hydra_parser("petl-run")
    first = made.parse_intermixed_args(["method=lora", "--cfg", "job", "train.lr=0.1", "-m"])
    second = made.parse_intermixed_args(["--cfg", "job", "-m", "method=lora", "train.lr=0.1"])
    assert first == second and first.overrides == ["method=lora", "train.lr=0.1"]


def test_petl_run_flags_are_the_ones_hydra_reads():
    # Checked against Hydra's own (private) parser here, in a test only: if Hydra adds or drops a flag, this says so.
    from hydra._internal.utils import get_args_parser

    def flags(made):
        return {o for a in made._actions for o in a.option_strings}

    assert flags(grammar.hydra_parser("petl-run")) == flags(get_args_parser())
    assert run_cli.PROG == "petl-run"
    info = next(a for a in get_args_parser()._actions if "--info" in a.option_strings)
    assert tuple(info.choices) == grammar.INFO_TOPICS


def test_an_override_after_petl_runs_info_is_one_line_saying_so():
    """--info's topic is optional, so argparse takes the next word for it: an override there is said to be one
    (Hydra would print its usage and an invalid choice)."""
    made = grammar.hydra_parser("petl-run")
    assert made.parse_intermixed_args(["method=lora", "--info"]).info == "all"
    assert made.parse_intermixed_args(["--info", "config", "method=lora"]).overrides == ["method=lora"]
    with pytest.raises(grammar.CommandLineError, match=r"^argument --info/-i: invalid choice: 'method=lora', an "):
        made.parse_intermixed_args(["--info", "method=lora"])


@pytest.mark.parametrize(
    ("argv", "hydra_gets"),
    [
        (["method=lora", "--info"], ["--info=all", "method=lora"]),
        (["method=lora", "--info", "defaults", "seed=1"], ["--info=defaults", "method=lora", "seed=1"]),
        (["-i", "config", "method=lora"], ["--info=config", "method=lora"]),
    ],
)
def test_petl_run_hands_hydra_info_with_its_topic_as_one_word(argv, hydra_gets, monkeypatch):
    # Hydra gets the flags before the overrides: "method=lora --info" reached it as "--info method=lora", and Hydra
    # printed its 7 lines of usage and "invalid choice: 'method=lora'" (exit 2) for a line petl-run's help allows.
    calls = []
    monkeypatch.setattr(run_cli, "_run_hydra", calls.append)
    run_cli.main(argv)
    assert calls == [hydra_gets]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--info", "-m", "method=lora"], "--multirun and --info cannot be given together: Hydra takes one of --run, "),
        (["--cfg", "job", "-m", "method=lora"], "--multirun and --cfg cannot be given together"),
        (["-r", "-m", "method=lora"], "--run and --multirun cannot be given together"),
        (["--resolve", "method=lora"], "--resolve acts with --cfg only (it resolves the config printed): give --cfg "),
    ],
)
def test_hydra_modes_given_together_are_one_line(argv, said, monkeypatch, capsys):
    # Hydra raised "ValueError: Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified"
    # (or of --resolve without --cfg) once started: a traceback and exit 1, after every job of a sweep was checked.
    monkeypatch.setattr(run_cli, "_run_hydra", lambda argv: pytest.fail("handed to Hydra"))
    monkeypatch.setattr(run_cli, "check_command_line", lambda *a: pytest.fail("checked the jobs first"))
    with pytest.raises(SystemExit) as caught:
        run_cli.main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and err.startswith(f"petl-run: error: {said}"), err


def test_petl_bench_help_answers_before_the_commands_load():
    code = "import sys; from petl.cli import bench; bench.main(['--help']); print(sorted(m for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "petl-bench" in out and "'torch'" not in out and "'petl.bench.commands'" not in out
    assert bench.PROG == "petl-bench"


@pytest.mark.parametrize("argv", [["speed", "--help"], ["report", "runs", "-h"], ["suite=mini", "--help"]])
def test_petl_bench_help_answers_after_a_command_or_a_key(argv, capsys):
    # Was: "petl-bench: error: expected key=value, got '--help'" (exit 2) after a command, as every other petl command
    # takes --help anywhere on its line.
    code, out, err = command_status(capsys, bench.main, *argv)
    assert code == 0 and out.startswith("petl-bench: run a benchmark suite") and err == ""


@pytest.mark.parametrize("module", ["petl.cli.predict", "petl.cli.export", "petl.cli.pretrain", "petl.cli.serve"])
def test_help_imports_neither_torch_nor_timm(module):
    code = f"import sys; sys.argv = ['x', '--help']\nfrom {module} import main\ntry:\n    main()\nexcept SystemExit:\n"
    code += "    pass\nprint([m for m in sys.modules if m in ('torch', 'timm', 'fastapi')])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("[]")


def test_import_petl_loads_nothing_heavy_until_a_name_is_used():
    code = "import sys, petl; print('torch' in sys.modules); petl.apply; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_petl_run_help_imports_neither_torch_nor_timm_nor_hydra():
    code = "import sys\nfrom petl.cli.run import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
    code += "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'timm', 'hydra', 'omegaconf')])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "== Configuration groups ==" in out and out.strip().endswith("[]")


@pytest.mark.slow
def test_petl_run_help_lists_the_groups_and_config_hydras_own_help_lists():
    # Hydra's app help composes the registered schema (torch): in a fresh process, so `model` holds the default only.
    code = "from petl.cli.run import hydra_help; print(hydra_help())"
    hydra = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    fast = run_help.fast_help(run_cli.PROG, run_cli.__doc__)
    for title in (run_help.GROUPS_TITLE, run_help.CONFIG_TITLE):
        stale = "petl/cli/run_choices.py is stale: run python docs/gen.py"
        assert run_help.sections(fast)[title] == run_help.sections(hydra)[title], stale
    assert "method: " in run_help.sections(fast)[run_help.GROUPS_TITLE]
    # Every flag petl-run reads, and the examples of its docstring.
    flags = {o for a in grammar.hydra_parser(run_cli.PROG)._actions for o in a.option_strings} | {"--debug"}
    assert flags <= set(re.findall(r"--?[\w-]+", run_help.sections(fast)["Flags"]))
    assert "petl-run --multirun method=lora,adapter,vpt seed=0,1,2" in fast


def test_petl_run_help_with_an_override_is_hydras_composed_one(monkeypatch):
    # Only a bare --help is petl-run's own; with overrides Hydra composes them (a method's options), as before.
    calls = []
    monkeypatch.setattr(run_cli, "_run_hydra", calls.append)
    run_cli.main(["method=vpt", "--help"])
    assert calls == [["--help", "method=vpt"]]


def test_petl_run_composed_help_points_to_what_each_key_and_option_means():
    # petl-run method=adapter --help listed "dim: null" with no word of where null's meaning is.
    import yaml

    footer = yaml.safe_load((ROOT / "petl" / "conf" / "config.yaml").read_text())["hydra"]["help"]["footer"]
    assert "docs/cli.md" in footer and "docs/methods/NAME.md" in footer
    for page in re.findall(r"docs/[a-z0-9_/-]+\.md", footer):
        assert (ROOT / page).is_file(), page


# Docstring markup that a terminal shows raw: Sphinx roles, RST literals, Markdown code and bold.
MARKUP = re.compile(r":(mod|class|func|data|meth|attr):`|``|`[^`\s][^`]*`|\*\*[^*\s][^*]*\*\*")


@pytest.mark.parametrize("module", [run_cli, pretrain, bench, predict, export, serve], ids=lambda m: m.PROG)
def test_every_help_is_plain_text(module, capsys):
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(module.main(["--help"]))
    text = capsys.readouterr().out
    assert exit_.value.code in (0, None) and module.PROG in text
    assert not MARKUP.search(text), MARKUP.search(text)


@pytest.mark.parametrize("module", [run_cli, pretrain, bench, predict, export, serve], ids=lambda m: m.PROG)
def test_every_page_a_help_points_to_exists(module, capsys):
    # petl-serve's help sent a reader to "petl.deploy.serve" (a Python module) for its routes, not to docs/serving.md.
    with pytest.raises(SystemExit):
        raise SystemExit(module.main(["--help"]))
    text = capsys.readouterr().out
    assert "See petl." not in text
    for page in re.findall(r"docs/[a-z0-9_/-]+\.md", text):  # docs/methods/NAME.md: a placeholder
        assert (ROOT / page).is_file(), page
    if module is serve:
        assert "docs/serving.md" in text


def test_petl_pretrain_help_says_the_default_of_every_option_taking_a_value(capsys):
    # --epochs, --lr, --batch-size... were listed bare: the help gave no idea of what a plain petl-pretrain runs.
    with pytest.raises(SystemExit):
        pretrain.main(["--help"])
    options = capsys.readouterr().out.split("\noptions:\n")[1]
    entries = re.split(r"\n  (?=-)", options)  # one per option, its wrapped help lines with it
    valued = [e for e in entries if re.match(r"--[\w-]+ [A-Z_{]", e)]
    assert len(valued) == 13
    assert [e.split()[0] for e in valued if "(default: " not in " ".join(e.split())] == []


def test_plain_takes_docstring_markup_off():
    text = "``petl-bench`` :class:`~petl.bench.board.Leaderboard` :mod:`petl.cli` `x=1` **bold** Usage::\n"
    assert grammar.plain(text) == "petl-bench petl.bench.board.Leaderboard petl.cli x=1 bold Usage:\n"


# The modules a command imports once it starts (torch, timm, Hydra and petl's heavy parts), against one of which
# Ctrl-C lands while it starts.
HEAVY_IMPORTS = ("torch", "timm", "hydra", "omegaconf", "petl.train", "petl.deploy", "petl.bench.", "petl.store")


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        (run_cli, ["method=linear"]),
        (export, ["RUN", "out=exported"]),
        (predict, ["RUN", "a.png"]),
        (serve, ["RUN"]),
        (bench, ["list"]),
        (pretrain, ["--epochs", "1"]),
    ],
    ids=["petl-run", "petl-export", "petl-predict", "petl-serve", "petl-bench", "petl-pretrain"],
)
def test_ctrl_c_while_a_command_imports_is_one_line_and_130(module, argv, monkeypatch, capsys):
    # petl-run and petl-export printed a traceback of 33 to 60 lines when Ctrl-C came during their imports.
    import builtins

    real = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name.startswith(HEAVY_IMPORTS):
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    try:
        with pytest.raises(SystemExit) as stop:
            module.main(argv)
    except KeyboardInterrupt:
        pytest.fail(f"{module.PROG}: Ctrl-C during its imports went out as a traceback")
    finally:
        monkeypatch.undo()
    err = capsys.readouterr().err
    assert stop.value.code == 130 and err.count("\n") == 1 and "interrupted" in err, err
    assert err.startswith(f"{module.PROG}: ") and "Traceback" not in err


# SIGTERM sent to the command itself as its first heavy module imports (a job's time limit while it starts).
_TERMINATED_WHILE_IMPORTING = """
import builtins, os, signal, sys
from petl.cli import {module} as command

real = builtins.__import__

def importing(name, *args, **kwargs):
    if name.startswith({heavy!r}):
        builtins.__import__ = real
        os.kill(os.getpid(), signal.SIGTERM)
    return real(name, *args, **kwargs)

builtins.__import__ = importing
command.main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("run", ["method=linear"]),
        ("export", ["RUN", "out=exported"]),
        ("predict", ["RUN", "a.png"]),
        ("bench", ["list"]),
        ("pretrain", ["--epochs", "1"]),
        ("serve", ["RUN"]),
    ],
)
def test_sigterm_interrupts_a_command_as_ctrl_c_does_in_one_line_and_143(module, argv, tmp_path):
    # Every command died of the signal without a word (status -15); SIGTERM is what a job scheduler's time limit
    # sends.  petl-serve leaves SIGTERM to uvicorn (a graceful shutdown, then the signal's own end).
    script = _TERMINATED_WHILE_IMPORTING.format(module=module, heavy=HEAVY_IMPORTS)
    done = subprocess.run([sys.executable, "-c", script, *argv], cwd=tmp_path, capture_output=True, text=True)
    prog = f"petl-{module}"
    if module == "serve":
        assert (done.returncode, done.stderr) == (-signal.SIGTERM, ""), done.stderr
        return
    assert done.returncode == 143 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"{prog}: ") and "terminated (SIGTERM)" in done.stderr, done.stderr


def test_only_a_command_sets_a_sigterm_handler_and_it_puts_back_the_one_it_found():
    # The Python API (imported here by every petl.cli module above) leaves SIGTERM as it is; a command sets its own
    # handler while it runs, unless the program that runs it in-process has one already.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    seen = []

    @grammar.entry_point("petl-x")
    def main(argv=None):
        seen.append(signal.getsignal(signal.SIGTERM))

    main([])
    assert seen[0] not in (signal.SIG_DFL, signal.SIG_IGN, None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    try:
        main([])
        assert seen[1] is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.parametrize("module", ["run", "bench", "predict", "export", "serve", "pretrain"])
def test_a_reader_that_closes_the_output_ends_the_command_quietly(module):
    # `petl-run --help | head -3` printed a BrokenPipeError traceback (exit 1), petl-bench a line "error:
    # BrokenPipeError" (exit 1).  Here the pipe has no reader from the start, as after `head` has read its lines.
    read, write = os.pipe()
    os.close(read)
    code = f"from petl.cli.{module} import main\nraise SystemExit(main(['--help']))"
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_command_started_with_its_output_closed_ends_with_its_own_status(monkeypatch):
    # `petl-export RUN out=x.safetensors >&-` exported, then ended in an AttributeError traceback (exit 1): Python's
    # sys.stdout is None where the process starts with descriptor 1 closed, and the wrapper flushed it.
    monkeypatch.setattr(sys, "stdout", None)
    main = grammar.entry_point("petl-x")(lambda argv: 0)
    assert main([]) == 0


def test_petl_bench_argument_errors_read_prog_error_message():
    assert bench._as_error("petl-bench: unknown key 'budget.param'; petl-bench takes x") == (
        "petl-bench: error: unknown key 'budget.param'; petl-bench takes x"
    )
    assert bench._as_error("petl-bench speed: options=x: choose among a") == (
        "petl-bench speed: error: options=x: choose among a"
    )
    assert bench._as_error("petl-bench: error: already") == "petl-bench: error: already"


def test_petl_run_help_names_every_file_a_finished_run_leaves():
    from petl.store import files

    # The second line listed the output files without model.json (the file petl-predict, -export and -serve read).
    said = run_help.fast_help(run_cli.PROG, run_cli.__doc__).splitlines()[1]
    for name in (files.CONFIG_FILE, files.METRICS_FILE, files.WEIGHTS_FILE, files.MODEL_FILE, files.RESULT_FILE):
        assert name in said, name


def test_petl_run_help_says_each_exit_status():
    from petl.utils import errors

    # petl-pretrain's and the deploy commands' helps said their statuses; petl-run's, the one a newcomer reads, did not.
    said = " ".join(run_help.fast_help(run_cli.PROG, run_cli.__doc__).split())
    for status, meaning in [
        (0, "done"),
        (errors.USAGE_ERROR, "bad input"),
        (errors.RUN_ERROR, "a run that cannot complete"),
        (errors.INTERRUPTED, "Ctrl-C"),
        (errors.TERMINATED, "SIGTERM"),
    ]:
        assert re.search(rf"\b{status} {meaning}", said), (status, meaning)


def test_counts_are_said_in_the_singular_for_one():
    from petl.train.learning import few_steps
    from petl.utils.text import plural

    assert [plural(1, "epoch"), plural(2, "epoch"), plural(0, "row")] == ["1 epoch", "2 epochs", "0 rows"]
    assert plural(2, "run folder holds", "run folders hold") == "2 run folders hold"
    assert "only 1 optimizer step (15 training images in batches of 64, 1 epoch)," in few_steps(1, 15, 64, 1)
