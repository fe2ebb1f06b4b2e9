"""`prism serve`'s command line: bad flags are argparse errors (exit status 2 and a usage line), before any model
loads (review, session 28: a port of 99999 loaded the model and then failed with a traceback; a bad log level, a
missing --model directory or --config file each printed a traceback)."""

from __future__ import annotations

import pytest

from prism import cli


@pytest.mark.parametrize("argv, words", [
    (["serve", "--port", "99999"], "a port is in [0, 65535]"),
    (["serve", "--port", "http"], "a port is an integer"),
    (["serve", "--log-level", "foo"], "invalid choice"),
    (["serve", "--model", "/no/such/model"], "--model '/no/such/model' is not a directory"),
    (["serve", "--config", "/no/such/config.json"], "is not a file"),
])
def test_bad_flags_are_command_line_errors(argv, words, capsys, monkeypatch):
    def no_server(*args, **kwargs):
        raise AssertionError("the server started")

    import uvicorn

    monkeypatch.setattr(uvicorn, "run", no_server)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err
