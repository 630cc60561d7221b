"""`kvql serve`: its command-line flags and the process that serves one model over HTTP.

Start-up, in order: the flags and the port are checked (a port in use is one line and exit 1, before
any model is loaded), a `loading ...` line, the load, one banner line (model, device, dtype, context
length, KV cache in tokens and bytes), then `kvql serving NAME on URL`. Logs go to stderr through a
thread of their own, so a slow reader of stderr never stalls the server.

SIGINT/SIGTERM: stop accepting, let in-flight requests finish for `--shutdown-timeout` seconds, then
cancel them (a second signal cancels them at once): a non-streaming one is answered 503, a stream ends
with an error event and `[DONE]`; the engine stops (with `--disk-cache`, what only memory holds is written
there then: kvql.engine.cache.persistence) and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import logging.handlers
import os
import queue
import signal
import socket
import sys
import threading
import time

from ..arguments import (DTYPE_HELP, MODEL_HELP, SPECULATE_HELP, at_least, disk_options,
                         non_negative, size)
from ..backends.dtype import DEFAULT, NAMES
from ..backends.weights import HELP as WEIGHTS_HELP, WEIGHTS
from ..registry import DEFAULT_MODEL


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `kvql serve`, each with a help text; argument types check them before anything loads."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP.replace(", or http://HOST:PORT/v1", ""))
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...; checked before the model loads")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (0.0.0.0: every interface; see --api-key and --allowed-host)")
    p.add_argument("--port", type=at_least(1, 65535), default=8000,
                   help="the TCP port to listen on (one in use is an error before the load)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: --model, which stays accepted as an alias)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="cap the context (prompt + generated tokens) below the model's own")
    p.add_argument("--dtype", choices=NAMES, default=DEFAULT, help=DTYPE_HELP)
    p.add_argument("--weights", choices=WEIGHTS, default=None, help=WEIGHTS_HELP)
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) replacing the tokenizer's")
    p.add_argument("--plain-content", action="store_true",
                   help="tokenize chat messages' content as plain text: a special token's text in it (<|im_start|>) "
                        "stays text and cannot open a turn (default: it becomes the control token, as in vLLM)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error", "critical"), default="info",
                   help="info: an access line per request and a throughput line every 10 s while busy")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long in-flight requests may finish before they are cancelled")
    p.add_argument("--header-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="close a connection that has not sent a whole request head this long after it opened or "
                        "after its last response (slow or idle clients)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections at most (default: the open-file limit, raised to its hard limit, less "
                        "64); at the cap a new connection closes the longest-idle one, and requests past it get 503")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require Authorization: Bearer KEY on all but /health (repeatable: any of them); a key "
                        "lets its holder generate, never run code, unless --playground-run")
    p.add_argument("--metrics-auth", action=argparse.BooleanOptionalAction, default=True,
                   help="with --api-key, GET /metrics needs a key too (default); --no-metrics-auth leaves it "
                        "open for a Prometheus scraper, as vLLM does")
    p.add_argument("--playground", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the query playground's page at /playground (running queries there is off unless "
                        "--playground-run)")
    p.add_argument("--playground-run", action="store_true",
                   help="let the playground run queries: a query is Python run in this process as its user, so "
                        "whoever may run one has a shell: with --api-key every key holder, without keys every "
                        "loopback client that did not come through a proxy (off by default)")
    p.add_argument("--salt-per-key", action="store_true",
                   help="each API key gets its own prefix-cache partition (tenants cannot probe each other)")
    p.add_argument("--allowed-host", action="append", metavar="HOST",
                   help="a host name accepted in the Host header besides IP addresses, localhost and --host "
                        "(repeatable; '*': any)")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=True, help=SPECULATE_HELP)
    p.add_argument("--cache-budget", type=size, default=None, metavar="SIZE",
                   help="KV cache size, e.g. 512MB or 2GiB (default: a quarter of free memory, at most 4 GiB, on CPU)")
    disk_options(p)
    p.add_argument("--cache-save-interval", type=non_negative, default=300.0, metavar="SECONDS",
                   help="with --disk-cache: seconds between writes of what only memory holds while idle (0: only on "
                        "shutdown)")
    p.add_argument("--max-body-bytes", type=at_least(1), default=1 << 20, metavar="BYTES",
                   help="a request body over this is answered 413")
    p.add_argument("--max-tokens-cap", type=at_least(1), default=4096, metavar="TOKENS",
                   help="the most tokens one request may generate: a larger max_tokens is answered 400; a chat "
                        "without max_tokens runs to the end of the context, within this cap")


def serve(args) -> None:
    sock = _bind(args.host, args.port)  # before loading: a port in use fails at once
    template = _chat_template(args.chat_template)
    if args.max_model_len is not None and args.max_model_len < 2:
        _fail(f"--max-model-len must be at least 2, got {args.max_model_len}")
    if not args.header_timeout > 0:
        _fail(f"--header-timeout must be a number of seconds > 0, got {args.header_timeout}")
    if args.max_connections is not None and args.max_connections < 1:
        _fail(f"--max-connections must be at least 1, got {args.max_connections}")
    if args.salt_per_key and not args.api_key:  # before the load: a usage error costs no seconds
        _fail("--salt-per-key needs --api-key (it gives each key its own cache partition)")
    if args.playground_run and not args.playground:
        _fail("--playground-run needs the playground (drop --no-playground)")
    if args.playground_run and args.salt_per_key:
        _fail("--playground-run with --salt-per-key: the playground runs no queries on a server that partitions "
              "its cache by key (a query's requests would not be partitioned)")
    listener = _log_to_stderr(args.log_level)
    try:
        _serve(args, sock, template)
    except KeyboardInterrupt:  # during the load: nothing is served yet
        print("kvql serve: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        _drain(listener)


def _serve(args, sock: socket.socket, template: str | None) -> None:
    import uvicorn

    from . import connections
    from .app import create_app

    m = _loaded(args, template)
    app = create_app(m, name=args.served_model_name, aliases=[args.model], api_key=args.api_key,
                     salt_per_key=args.salt_per_key, allowed_hosts=[args.host, *(args.allowed_host or ())],
                     max_body_bytes=args.max_body_bytes, max_tokens_cap=args.max_tokens_cap,
                     metrics_auth=args.metrics_auth, playground=args.playground,
                     playground_run=args.playground_run, plain_content=args.plain_content)
    grace = max(0.0, args.shutdown_timeout)
    quiet = args.log_level not in ("debug",)
    connections.raise_fd_limit()
    cap = connections.connection_cap(args.max_connections)
    connections.quiet_accept_errors()
    print(f"kvql serving {args.served_model_name or args.model} on http://{args.host}:{args.port}/v1"
          + (f" · playground http://{args.host}:{args.port}/playground" if args.playground else ""), flush=True)
    if args.playground_run:
        print("kvql serve: WARNING --playground-run is on: the playground runs queries (Python, as this process's "
              "user) for " + ("every API key holder" if args.api_key else "every loopback client not behind a "
              "proxy (a same-host forwarder counts as local)"), flush=True)
    config = uvicorn.Config(app, log_level="warning" if quiet else args.log_level, access_log=False,
                            # uvicorn's 503 when open connections (or requests) pass this: all of them busy, as
                            # the protocol closes idle ones at the cap; the margin covers closes still under way
                            timeout_graceful_shutdown=grace + 10, limit_concurrency=cap + connections.MARGIN,
                            http=connections.protocol(args.header_timeout, cap))
    _graceful(app, grace)(config).run(sockets=[sock])


def _loaded(args, template: str | None):
    """The served model, loaded with its loading line and banner; `--max-model-len` and the chat template applied,
    llguidance's view of its tokenizer built on a thread (the first constrained request would pay it)."""
    from ..backends.dtype import name
    from ..factory import check, make, size_text

    options = check(args.model, device=args.device, dtype=args.dtype, cache_budget=args.cache_budget,
                    cache_save_interval=args.cache_save_interval, speculate=args.speculate,
                    disk_cache=args.disk_cache, disk_budget=args.disk_budget,
                    weights=args.weights)  # the device, before the "loading" line
    print(f"kvql serve: loading {args.model} on {args.device} ({name(options.dtype)}) ...", flush=True)
    m = make(args.model, options)
    if args.max_model_len is not None:
        if args.max_model_len > m.context_length:
            _fail(f"--max-model-len {args.max_model_len} is over the model's context of {m.context_length} tokens")
        m.context_length = args.max_model_len
    if template is not None:
        m.tokenizer.chat_template = template
    threading.Thread(target=m.warm_up, name="kvql-grammar-warm-up", daemon=True).start()
    print(f"kvql serve: model {m.name} | device {m.device} | dtype {name(m.dtype)} | context {m.context_length} "
          f"tokens | KV cache {m.cache_slots} tokens ({size_text(m.cache_bytes)})"
          + (f" | {m.quantization}" if m.quantization else ""), flush=True)
    return m


def _graceful(app, grace: float):
    """uvicorn's server whose SIGINT / SIGTERM exit 0 (uvicorn's own handlers re-raise the signal: non-zero) and
    whose shutdown gives in-flight requests `grace` seconds; a second signal cancels them at once."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()

            def stop(*_):
                if self.should_exit:  # the second signal: cancel what is in flight now
                    loop.call_soon_threadsafe(app.state.shutdown)
                self.should_exit = True
            previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets=None):
            logging.getLogger("kvql.server").info("shutting down: in-flight requests have %g s to finish", grace)
            timer = asyncio.get_running_loop().call_later(grace, app.state.shutdown)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server


def _fail(message: str):
    print(f"kvql serve: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (uvicorn serves on it): a port in use is an error before any load."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        _fail(f"cannot resolve --host {host}: {e.strerror}")
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            _fail(f"port {port} on {host} is already in use (another server?); choose another with --port")
        _fail(f"cannot listen on {host}:{port}: {e.strerror}")
    sock.set_inheritable(True)
    return sock


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself; checked to be Jinja before any load."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif "{" not in value:
        _fail(f"--chat-template {value!r} is neither a file nor a Jinja template")
    import jinja2
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        _fail(f"--chat-template is not a valid Jinja template: {e.message} (line {e.lineno})")
    return value


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """Never waits: when 10,000 lines are waiting for stderr, more are dropped."""

    def enqueue(self, record):
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(record)


def _log_to_stderr(level: str) -> logging.handlers.QueueListener:
    q: queue.Queue = queue.Queue(maxsize=10_000)
    out = logging.StreamHandler(sys.stderr)
    out.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    listener = logging.handlers.QueueListener(q, out)
    listener.start()  # a daemon thread
    for name in ("kvql.server", "kvql.access", "kvql.cache"):
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())
        logger.addHandler(_DroppingQueueHandler(q))
        logger.propagate = False
    return listener


def _drain(listener, timeout: float = 1.0) -> None:
    """Give the log thread `timeout` seconds to write what is waiting (not longer: stderr may be full)."""
    deadline = time.monotonic() + timeout
    while not listener.queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
