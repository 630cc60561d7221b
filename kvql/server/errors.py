"""How the server answers what goes wrong: OpenAI's error shape for every error (`install`), a model's
`ValueError` / `TypeError` about a request's own options as a 400 (`request_errors`), and a client that
disconnects before its answer as a cancelled request (`unless_disconnected`)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException

from .protocol import RequestError, error_response

POLL_S = 0.1  # how often a non-streaming request checks that its client is still connected
_NAMED = ("logit_bias",)  # options whose checks in the model name them first ("logit_bias: ...")


def install(app: FastAPI, counters: dict) -> None:
    """The app's exception handlers: a `RequestError` as its 4xx, an unknown path 404, a wrong method 405,
    anything else a 500 that says no more (`counters["errors"]` counts the request's faults)."""
    @app.exception_handler(RequestError)
    async def bad(request, exc: RequestError):
        counters["errors"] += 1
        return error_response(exc.status, str(exc), exc.param, exc.code, exc.kind)

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, exc: HTTPException):
        what = {404: f"no endpoint {request.url.path}",
                405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(exc.status_code, what, headers=exc.headers)

    @app.exception_handler(Exception)
    async def fault(request, exc: Exception):
        counters["errors"] += 1
        return error_response(500, "internal server error", kind="server_error")


@contextlib.contextmanager
def request_errors():
    """What the model raises about a request's own options (a bad constraint, a prompt over the
    context) -> a 400."""
    try:
        yield
    except RequestError:
        raise
    except (ValueError, TypeError) as e:
        field = str(e).split(":", 1)[0]
        raise RequestError(str(e), field if field in _NAMED else None) from None
    except RecursionError:
        raise RequestError("the constraint is nested too deeply") from None


async def unless_disconnected(request: Request, awaitable):
    """Await `awaitable`; if the client disconnects first, cancel it (cancelling a generation cancels its
    engine requests) and raise a 499 nobody will read. Until a response starts, nothing else notices."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():  # the client left, or this handler itself was cancelled
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise RequestError("the client disconnected", status=499)
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_S)
