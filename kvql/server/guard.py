"""What every request must show before an endpoint runs: an allowed Host, an API key, a JSON body.

The checks, in order, each answered in OpenAI's error shape:
- `Host` (403, code `host_not_allowed`): an IP address, `localhost`, or a name in `allowed_hosts`
  (`"*"`: any). A web page can make a browser send requests to a local server; by DNS rebinding
  (its own name re-pointed at 127.0.0.1) it can even read the answers. Such requests carry the page's
  host *name*, never an IP literal the page was not served from, so IP literals and `localhost` are safe.
- `Authorization: Bearer KEY` (401) when keys are configured; not for a `GET` of an open path (`/health`;
  also `/metrics` with `kvql serve --no-metrics-auth`). The key matched is put in `scope["kvql.api_key"]`
  for per-key cache salting.
- POST bodies must be `Content-Type: application/json` (415): a page can post `text/plain` or form
  bodies cross-origin without asking; `application/json` needs a CORS preflight, which this server
  never grants.
- A declared `Content-Length` over `max_body_bytes` (413); the app bounds bodies sent without one.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.datastructures import Headers

from .protocol import error_response


class Guard:
    """ASGI middleware (pure ASGI, so that streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, *, api_keys: list[str], allowed_hosts: list[str], max_body_bytes: int,
                 open_paths=("/health",)):
        self.app = app
        self.open_paths = frozenset(open_paths)
        self.api_keys = [k.encode() for k in api_keys]
        self.allowed_hosts = {h.lower().strip("[]") for h in allowed_hosts}
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope):
        headers = Headers(scope=scope)
        host = headers.get("host")
        if host is not None and not self._host_allowed(host):
            return error_response(403, f"Host {host!r} is not allowed (kvql serve --allowed-host NAME allows a name)",
                                  "host", "host_not_allowed")
        if self.api_keys and not (scope["method"] == "GET" and scope["path"] in self.open_paths):
            given = headers.get("authorization", "").encode()
            # every key compared, each in constant time: the answer's timing tells nothing about the keys
            matched = [k for k in self.api_keys if hmac.compare_digest(given, b"Bearer " + k)]
            if not matched:
                return error_response(401, "missing or wrong API key", kind="authentication_error")
            scope["kvql.api_key"] = matched[0].decode()
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return error_response(415, f"Content-Type must be application/json, got {media or 'none'!r}",
                                      code="unsupported_media_type")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return error_response(413, f"request body over {self.max_body_bytes} bytes")
        return None

    def _host_allowed(self, host: str) -> bool:
        if "*" in self.allowed_hosts:
            return True
        name = host.strip().lower()
        if name.startswith("["):  # [IPv6]:port
            name = name[1:name.find("]")] if "]" in name else name
        elif name.count(":") == 1:  # name:port
            name = name.split(":")[0]
        if name in ("localhost", *self.allowed_hosts):
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False
