"""The fdp command line's own behaviour: errors with the right usage, options, help text."""

import pytest

from fdp import cli
from fdp.launch import _cli as launch_cli


def fails(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_an_unknown_launch_option_is_reported_with_the_launch_usage(capsys):
    err = fails(["launch", "--bogus", "x.py"], capsys)
    assert err.startswith("usage: fdp launch [options] script.py [script args]")
    assert "fdp launch: error: unrecognized arguments: --bogus" in err
    assert "the launcher's options come before the script" in err


def test_a_missing_script_is_named_and_its_arguments_are_optional(capsys):
    err = fails(["launch", "--nproc-per-node", "2"], capsys)
    assert "fdp launch: error: a training script is required" in err
    assert "script_args" not in err


def test_an_abbreviation_of_one_option_with_two_spellings_is_that_option():
    parser = launch_cli.build_parser()
    assert parser.parse_args(["--nproc", "3", "t.py"]).nproc_per_node == 3
    assert parser.parse_args(["--max_r", "2", "t.py"]).max_restarts == 2
    with pytest.raises(SystemExit):  # still ambiguous between two options
        parser.parse_args(["--n", "3", "t.py"])


def test_help_shows_defaults_and_describes_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in (
        "workers on this host (default: 1)",
        "(default: 5.0)",
        "(default: 30.0)",
        "--tee",
        "--console-ranks RANKS",
    ):
        assert shown in text, shown
    with pytest.raises(SystemExit):
        cli.main(["describe", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("MODULE:FUNCTION", "(default: mlp)", "(default: 25.0)", "(default: 1.0)"):
        assert shown in text, shown
    assert "print JSON instead of a table" in text


def test_other_commands_name_their_unknown_options(capsys):
    err = fails(["info", "--bogus"], capsys)
    assert err.startswith("usage: fdp info") and "unrecognized arguments: --bogus" in err
