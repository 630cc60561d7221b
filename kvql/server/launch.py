"""`kvql serve`: its command-line flags and the process that serves one model over HTTP."""

from __future__ import annotations

import argparse
import contextlib
import signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: --model, which stays accepted as an alias)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require Authorization: Bearer KEY on all but /health (repeatable: any of them)")
    p.add_argument("--salt-per-key", action="store_true",
                   help="each API key gets its own prefix-cache partition (tenants cannot probe each other)")
    p.add_argument("--allowed-host", action="append", metavar="HOST",
                   help="a host name accepted in the Host header besides IP addresses, localhost and --host "
                        "(repeatable; '*': any)")
    p.add_argument("--cache-budget", default=None, help="KV cache size, e.g. 512MB or 2GiB")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-tokens-cap", type=int, default=4096)


def serve(args) -> None:
    import uvicorn

    import kvql
    from .app import create_app

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # SIGINT/SIGTERM: stop accepting, let in-flight requests finish (30 s at most), shut down, exit 0
            # (uvicorn's own handlers re-raise the signal afterwards, which exits non-zero)
            def stop(*_):
                self.force_exit = self.should_exit
                self.should_exit = True
            previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    m = kvql.model(args.model, device=args.device, cache_budget=args.cache_budget)
    app = create_app(m, name=args.served_model_name, aliases=[args.model], api_key=args.api_key,
                     salt_per_key=args.salt_per_key, allowed_hosts=[args.host, *(args.allowed_host or ())],
                     max_body_bytes=args.max_body_bytes, max_tokens_cap=args.max_tokens_cap)
    print(f"kvql serving {args.served_model_name or args.model} on http://{args.host}:{args.port}/v1", flush=True)
    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                          timeout_graceful_shutdown=30)).run()
