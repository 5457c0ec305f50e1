"""Requests a web page makes: a gateway that serves requests without a token is for one
person on one machine, and a page open in that person's browser must not act for them.

A browser sends a "simple" request to any address without asking first (no CORS
preflight): a form, or ``fetch(url, {mode: "no-cors"})`` with a ``text/plain`` body. A page
on another origin could thus start a turn on ``jetloop up`` or approve a held write, and a
page whose name is made to point at 127.0.0.1 (DNS rebinding) could even read the answers,
being then "the same origin". A request that names a token carries no such authority (a
page cannot make a browser add one), so only what ``anonymous_scopes`` open needs the
rules below; ``docs/security.md`` ("The HTTP gateway", **Browsers.**) says what they cover.

Two middlewares: ``browser_rules`` (Host, Origin) between ``problems`` and ``auth``, so
that a page is refused before anything else is said to it; ``json_writes`` (content type)
after ``auth``, so that a client without the scope hears that first. Both refuse before the
body is read:

- **Host** (421): with anonymous scopes, a request that came in on a loopback address must
  name a loopback host (``127.0.0.1``, ``[::1]``, ``localhost``) and the port it came in on.
  A rebinding page names its own host. Every route but a signed one (a webhook through a
  tunnel names the tunnel's host; its signature is what it is judged by).
- **Origin** (403): with anonymous scopes, a request to a route that needs a scope, from a
  page of another origin: an ``Origin`` that is not this gateway's own, or a
  ``Sec-Fetch-Site`` other than ``same-origin`` / ``none`` (a person typing the address).
  The console is served by the gateway itself, so its requests are same-origin.
- **Content type** (415), whatever the tokens: a write with a body, to a route that needs
  a scope, must send it as ``application/json``: a page can send that to another origin
  only after a preflight, which the gateway does not answer. (A write without a body, like
  ``curl -X POST …/cancel``, passes whatever its type; a browser sends it with an
  ``Origin``, which the rule above judges.)

Routes are told apart by the route table's scopes (``jetloop.services.gateway.app``): a
route with a scope serves data or changes something; one without is open (the console's
files, health, metrics, the OpenAPI document) or, when it changes something, signed (webhooks).
"""

from __future__ import annotations

import ipaddress
import re

import structlog
from aiohttp import web

from jetloop.services.gateway.config import is_loopback
from jetloop.services.gateway.http import CONFIG, SCOPES, Handler, Problem

log = structlog.get_logger("jetloop.gateway")

SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
# What a browser says about who made a request: the page's own origin, or a person (the
# address typed, a bookmark). Anything else (same-site, cross-site) is another page.
OWN_FETCH_SITES = frozenset({"same-origin", "none"})
JSON = "application/json"
# A Host header: a name or an IPv4 or [IPv6] address, and maybe a port. Nothing else (no
# user part, no path) is a host a browser would send.
HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::([0-9]{1,5}))?")


def _local(request: web.Request) -> tuple[str, int] | None:
    """The address and port the request came in on (None when the socket is gone)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return None
    return str(sockname[0]), int(sockname[1])


def _loopback_address(address: str) -> bool:
    # A dual-stack socket shows an IPv4 peer as ::ffff:127.0.0.1.
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _host_error(host: str, port: int) -> str | None:
    """Why ``Host: host`` is not this loopback gateway on ``port``, or None."""
    m = HOST_RE.fullmatch(host)
    if m is None or not is_loopback(m.group(1).lower()) or int(m.group(2) or 80) != port:
        return (
            f"the Host {host!r} is not this gateway: without a token it answers only to "
            f"127.0.0.1:{port}, localhost:{port} or [::1]:{port} (a page whose name was "
            "pointed at this machine is refused; set JETLOOP_GATEWAY_TOKENS to reach it by "
            "another name)"
        )
    return None


def _foreign(request: web.Request) -> str | None:
    """Why the request comes from a page of another origin, or None."""
    origin = request.headers.get("Origin")
    # The Host header itself: aiohttp's ``request.host`` looks up this machine's name
    # without one.
    own = f"{request.scheme}://{request.headers.get('Host', '')}".lower()
    if origin is not None and origin.lower() != own:
        return f"the request comes from {origin!r}, not from {own!r}"
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site.lower() not in OWN_FETCH_SITES:
        return f"the browser says the request comes from a {site!r} page"
    return None


def _refuse(request: web.Request, status: int, title: str, detail: str) -> Problem:
    log.info(
        "gateway.browser_refused",
        status=status,
        reason=title,
        method=request.method,
        path=request.path,
        host=request.headers.get("Host"),
        origin=request.headers.get("Origin"),
    )
    return Problem(status, title, detail)


@web.middleware
async def browser_rules(request: web.Request, handler: Handler) -> web.StreamResponse:
    name = request.match_info.route.name
    scope = request.app[SCOPES].get(name) if name else None
    writes = request.method not in SAFE
    if name is not None and scope is None and writes:
        return await handler(request)  # signed (a webhook): its signature decides
    anonymous = bool(request.app[CONFIG].anonymous_scopes)
    local = _local(request)
    if anonymous and local is not None and _loopback_address(local[0]):
        host = request.headers.get("Host")
        # No Host at all is no browser (it always names one): HTTP/1.0 probes pass.
        why = _host_error(host, local[1]) if host is not None else None
        if why is not None:
            raise _refuse(request, 421, "not this gateway's host", why)
    if scope is None:
        return await handler(request)
    if anonymous:
        why = _foreign(request)
        if why is not None:
            raise _refuse(
                request,
                403,
                "cross-origin request",
                f"{why}; without a token this gateway answers only its own pages",
            )
    return await handler(request)


@web.middleware
async def json_writes(request: web.Request, handler: Handler) -> web.StreamResponse:
    name = request.match_info.route.name
    scoped = name is not None and request.app[SCOPES].get(name) is not None
    if scoped and request.method not in SAFE and request.body_exists:
        if request.content_type != JSON:
            raise _refuse(
                request,
                415,
                "JSON required",
                f"send the body as Content-Type: {JSON} (got {request.content_type!r})",
            )
    return await handler(request)
