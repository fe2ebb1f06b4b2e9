"""`prism serve`: run the OpenAI-compatible server with flags instead of environment variables."""

from __future__ import annotations

import argparse
import logging
import os


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="prism")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("--model", help="HF Qwen3-VL directory (default: the embedded tiny random checkpoint)")
    serve.add_argument("--config", help="engine config JSON (see configs/)")
    serve.add_argument("--served-model-name", help="the model name clients must send")
    serve.add_argument("--media-root", help="allow local image files under this directory")
    serve.add_argument("--allow-remote-media", action="store_true", help="allow http(s) image URLs")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug",
                                                                "trace"))
    args = parser.parse_args(argv)

    import uvicorn

    from .serving.app import create_app
    from .serving.header_deadline import header_deadline_protocol
    from .serving.settings import ServerSettings

    env = dict(os.environ)
    for flag, variable in (
        (args.model, "PRISM_MODEL"),
        (args.config, "PRISM_CONFIG"),
        (args.served_model_name, "PRISM_SERVED_MODEL_NAME"),
        (args.media_root, "PRISM_MEDIA_ROOT"),
    ):
        if flag:
            env[variable] = flag
    if args.allow_remote_media:
        env["PRISM_ALLOW_REMOTE_MEDIA"] = "1"
    try:  # a bad --model or --config is the command line's error, before anything loads
        settings = ServerSettings.from_env(env)
    except ValueError as error:  # (its message names the variable the flag set: name the flag)
        serve.error(str(error).replace("PRISM_MODEL=", "--model ").replace("PRISM_CONFIG=", "--config "))
    logging.basicConfig(level=logging.DEBUG if args.log_level == "trace" else args.log_level.upper())
    # uvicorn's h11 protocol with the request head's deadline (uvicorn has no setting for one): before the model loads,
    # a uvicorn it does not fit is an error here
    try:
        protocol = header_deadline_protocol(settings.header_read_timeout_s)
    except RuntimeError as error:
        parser.exit(1, f"prism serve: {error}\n")
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level, http=protocol)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {port}")
    return port


if __name__ == "__main__":
    main()
