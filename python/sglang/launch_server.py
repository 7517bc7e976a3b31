"""`python -m sglang.launch_server [flags]`: start the HTTP server (SGLang's flags; see --help).

A bad flag prints one sentence naming it and exits with status 2; a failed start prints one sentence
and exits with status 1. No traceback in either case.
"""

from __future__ import annotations

import logging
import signal
import sys

from sglang.srt.entrypoints.process_launcher import (
    ServerStartupError,
    launch_subprocesses,
)
from sglang.srt.server_args import ServerArgs, ServerArgsError, prepare_server_args

logger = logging.getLogger("sglang.launch_server")


def launch_server(server_args: ServerArgs) -> None:
    """Start the subprocesses, then serve HTTP until interrupted; the subprocesses stop with it."""
    import uvicorn

    from sglang.srt.entrypoints.http_server import create_app
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    launched = launch_subprocesses(server_args)
    # uvicorn re-raises SIGTERM after its graceful shutdown; as an exception (not the default action,
    # which ends the process on the spot) it lets the `finally` below stop the subprocesses.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        tm = TokenizerManager(server_args, launched.port_args, launched.model_info, launched.all_alive)
        app = create_app(server_args, tm, launched.model_info)
        uvicorn.run(
            app,
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.log_level,
            access_log=server_args.log_requests,
            timeout_keep_alive=5,
            # In-flight requests must not hold the shutdown (and the subprocesses) forever.
            timeout_graceful_shutdown=5,
            loop="asyncio",
        )
    finally:
        launched.shutdown()


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    try:
        server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    except ServerArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    )
    try:
        launch_server(server_args)
    except ServerStartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
