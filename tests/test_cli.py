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


def test_serve_runs_uvicorn_with_the_request_heads_deadline(monkeypatch):
    """uvicorn has no setting for it: `prism serve` gives it the h11 protocol with the deadline, from
    PRISM_HEADER_READ_TIMEOUT_S."""
    import uvicorn

    ran = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: ran.update(kwargs))
    monkeypatch.setenv("PRISM_HEADER_READ_TIMEOUT_S", "3.5")
    cli.main(["serve", "--port", "0"])
    assert ran["http"].header_read_timeout_s == 3.5 and ran["port"] == 0


def test_serve_refuses_a_uvicorn_the_deadline_does_not_fit(monkeypatch, capsys):
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: pytest.fail("the server started"))
    monkeypatch.delattr(H11Protocol, "data_received")
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve"])
    assert exited.value.code == 1
    assert "does not fit uvicorn" in capsys.readouterr().err
