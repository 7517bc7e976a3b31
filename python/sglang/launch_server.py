"""`python -m sglang.launch_server [flags]`: start the HTTP server (SGLang's flags; see --help).

A bad flag prints one sentence naming it and exits with status 2; a failed start prints one sentence
and exits with status 1. No traceback in either case. Once serving, the server exits with status 1 when
its scheduler or detokenizer process exits or the scheduler stalls (--watchdog-timeout); in-flight
requests get HTTP 503 first.
"""

from __future__ import annotations

import time

# (Before the imports below: the start's log says what they and the flags' checks took, `main`.)
_MODULE_START = time.perf_counter()

if __name__ == "__main__":
    import sys

    from sglang.srt.entrypoints import prestart

    # The scheduler's and the detokenizer's processes, spawned now: their imports run beside this
    # process's imports and flag checks instead of after them (`prestart.py`).
    prestart.prestart(sys.argv[1:])

import errno  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

# The server's own modules are imported in the functions, not here: every child the server spawns runs
# this module again as `__mp_main__` (multiprocessing's spawn imports the parent's main module), and they
# took ~2.4 s of CPU in each (the detokenizer's whole start, which needs none of them).
if TYPE_CHECKING:
    from sglang.srt.entrypoints.process_launcher import LaunchedProcesses
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger("sglang.launch_server")

# Seconds the server keeps answering after its backend failed, so that waiting requests and health
# checks get their 503 before it shuts down: a full poll period of the waiters (DISCONNECT_POLL_S), plus
# a margin (a waiter whose poll just missed the failure sees it on its next one).
BACKEND_FAILURE_DRAIN_MARGIN_S = 0.5


def launch_server(server_args: ServerArgs) -> int:
    """Bind the port, start the subprocesses, load the tokenizer and wait for the subprocesses (each
    failure is one sentence, and nothing is left running), then serve HTTP until interrupted (status 0)
    or until the backend fails (status 1); the subprocesses stop with it."""
    from sglang.srt.entrypoints.process_launcher import check_flag_support, start_subprocesses

    check_flag_support(server_args)  # before anything else fails for a flag that is refused anyway
    if server_args.node_rank > 0:
        return serve_other_node(server_args)
    sock = bind_socket(server_args.host, server_args.port)
    try:
        starting = start_subprocesses(server_args)
    except BaseException:
        sock.close()
        raise
    try:
        # While the children import torch and load the model, this process loads the tokenizer and
        # imports its HTTP stack (~2.8 s on a 2-core VM), which it used to do before starting them.
        tokenizer = load_server_tokenizer(server_args)
        _import_http_stack()
        launched = starting.wait_ready()
    except BaseException:
        starting.shutdown()
        sock.close()
        raise
    return _serve(server_args, sock, tokenizer, launched)


def serve_other_node(server_args: ServerArgs) -> int:
    """--node-rank above 0: this node's tensor-parallel ranks only (node 0 serves HTTP and talks to them
    through its rank 0). Runs until one of them exits (status 1: a rank of another node is gone, or
    this one), or until interrupted (status 0); the ranks stop with it."""
    from sglang.srt.entrypoints.process_launcher import start_subprocesses

    signal.signal(signal.SIGTERM, _raise_system_exit)
    launched = start_subprocesses(server_args).wait_ready()
    logger.info(
        "Node %d of %d: its %d rank(s) are ready; node 0 serves HTTP.",
        server_args.node_rank, server_args.nnodes, server_args.tp_size_per_node,
    )  # fmt: skip
    try:
        while (failure := launched.failure()) is None:
            time.sleep(0.5)
    finally:
        launched.shutdown()
    logger.error("%s Node %d stops.", failure, server_args.node_rank)
    return 1


def _import_http_stack() -> None:
    """Import the modules `_serve` needs (then its own imports are look-ups)."""
    import uvicorn  # noqa: F401

    from sglang.srt.entrypoints import http_guard, http_server  # noqa: F401


def _serve(server_args: ServerArgs, sock: socket.socket, tokenizer: Any, launched: LaunchedProcesses) -> int:
    """Serve HTTP on `sock` with the started subprocesses until interrupted or the backend fails; the
    subprocesses and the socket end with it."""
    import uvicorn

    from sglang.srt.entrypoints.http_guard import timed_h11_protocol
    from sglang.srt.entrypoints.http_server import create_app
    from sglang.srt.environ import envs
    from sglang.srt.managers.tokenizer_manager import DISCONNECT_POLL_S, TokenizerManager
    from sglang.srt.server_args_frontend import filter_access_log, uvicorn_ssl

    drain_s = DISCONNECT_POLL_S + BACKEND_FAILURE_DRAIN_MARGIN_S

    class Server(uvicorn.Server):
        backend_error: str | None = None
        failed_at = 0.0

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)  # the app's lifespan: start-up and warm-up request
            if not self.should_exit and tm.health.error() is None:
                logger.info("The server is fired up and ready to roll!")

        async def on_tick(self, counter: int) -> bool:
            # Every 0.1 s. A dead child or a stalled scheduler ends the server rather than leave it up
            # and unable to serve: for `drain_s` it still answers (503 for waiting requests, /health
            # and new requests), then it shuts down.
            should_exit = await super().on_tick(counter)
            if self.backend_error is None:
                self.backend_error = tm.health.error()
                if self.backend_error is None:
                    return should_exit
                self.failed_at = time.monotonic()
                logger.error("%s The server shuts down.", self.backend_error)
            return should_exit or time.monotonic() - self.failed_at >= drain_s

    # uvicorn re-raises SIGTERM after its graceful shutdown; as an exception (not the default action,
    # which ends the process on the spot) it lets the `finally` below stop the subprocesses.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        tm = TokenizerManager(
            server_args, launched.port_args, launched.model_info, launched.failure, tokenizer=tokenizer
        )
        app = create_app(server_args, tm, launched.model_info)
        config = uvicorn.Config(
            app,
            log_level=server_args.log_level,
            access_log=server_args.log_requests,
            timeout_keep_alive=5,
            # In-flight requests must not hold the shutdown (and the subprocesses) forever.
            timeout_graceful_shutdown=5,
            loop="asyncio",
            http=timed_h11_protocol(envs.SGLANG_HTTP_READ_TIMEOUT.get()),
            **uvicorn_ssl(server_args),  # --ssl-keyfile / --ssl-certfile (server_args_frontend)
        )
        filter_access_log(server_args)
        server = Server(config)
        server.run(sockets=[sock])
    finally:
        launched.shutdown()
        sock.close()
    return 1 if server.backend_error is not None else 0


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything starts: a port in use fails at once. It listens only
    once uvicorn serves on it (`create_server` calls listen), so a client that connects while the model
    loads is refused at once instead of hanging in the backlog; "ready" is logged after that."""
    from sglang.srt.entrypoints.process_launcher import ServerStartupError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise ServerStartupError(f"--host {host!r} cannot be resolved: {e.strerror}.") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServerStartupError(
                f"--port {port} is already in use on {host}; stop what holds it or pick another --port."
            ) from None
        raise ServerStartupError(f"--host {host} --port {port} cannot be bound: {e.strerror}.") from None
    return sock


def load_server_tokenizer(server_args: ServerArgs) -> Any:
    """The TokenizerManager's tokenizer, loaded before the subprocesses (which load it too) start; None
    with --skip-tokenizer-init."""
    from sglang.srt.entrypoints.process_launcher import ServerStartupError
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    if server_args.skip_tokenizer_init:
        return None

    try:
        return get_tokenizer(server_args.tokenizer_path)
    except Exception as e:  # noqa: BLE001 - any failure is the flag's: one sentence, no traceback
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ServerStartupError(
            f"--tokenizer-path {server_args.tokenizer_path!r}: the tokenizer cannot be loaded ({reason})."
        ) from None


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from sglang.srt.entrypoints.process_launcher import ServerStartupError
    from sglang.srt.server_args import ServerArgsError, prepare_server_args

    imported = time.perf_counter()
    try:
        server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    except ServerArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    )
    # (An H200's start spent 10.6 s before its scheduler started, 2.3 s on a 2-core CPU VM: which part.)
    logger.info(
        "Server process: imports %.2f s, flags and their checks %.2f s.",
        imported - _MODULE_START, time.perf_counter() - imported,
    )  # fmt: skip
    try:
        return launch_server(server_args)
    except ServerStartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
