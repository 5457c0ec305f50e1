"""Every status the gateway answers on a route is in that route's OpenAPI responses (issue 51).

The gateway's layers answer for whole kinds of routes, whatever each route does itself: 421
for another Host (every route but a webhook), 401/403/429 for tokens and 503 for a namespace
it does not serve (every route with a scope), 413 for a body too large and 415 for one that
is not JSON (the writes). Each is provoked here on every operation of its kind, and the
status answered must be documented on that operation; and every status the gateway's code
can answer must be one the document describes.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from jetloop.services.embedded import EmbeddedServer
from jetloop.services.gateway.app import make_app
from jetloop.services.gateway.openapi import (
    ANSWERED_BY_KIND,
    PROBLEMS,
    kinds,
    openapi_document,
)
from tests.test_gateway import ALL, Api, make_config

GATEWAY = Path(__file__).resolve().parent.parent / "jetloop" / "services" / "gateway"
DOC = openapi_document()
OPERATIONS = [
    (path, method, op) for path, ops in DOC["paths"].items() for method, op in ops.items()
]
# A value each path parameter's pattern takes.
PATH_VALUES = {"call_key": "s.t.1.0", "seq": "1", "asset": "x.js"}
OTHER = {"Authorization": "Bearer other-token-0123456789"}


def url_of(path: str, op: dict[str, Any]) -> str:
    for p in op.get("parameters", []):
        if p["in"] == "path":
            path = path.replace("{" + p["name"] + "}", PATH_VALUES.get(p["name"], "x"))
    return path


def scoped(op: dict[str, Any]) -> bool:
    return bool(op["security"])


def has_body(op: dict[str, Any]) -> bool:
    return "requestBody" in op


async def status_of(api: Api, method: str, url: str, **kw: Any) -> int:
    resp = await api.request(method.upper(), url, **kw)
    status = resp.status
    resp.close()  # an event stream that was let through is not read
    return status


@pytest.fixture
async def api(nats_ready: EmbeddedServer, tmp_path: Path) -> AsyncIterator[Api]:
    """The gateway with one failed token allowed per address, a token that may act in a
    namespace this gateway does not serve, and anonymous reads (so the Host rule holds)."""
    config = make_config(
        tmp_path,
        max_auth_failures=1,
        anonymous_scopes=["read"],
        tokens={
            "all-token-0123456789": {"name": "alice", "scopes": ["read", "write", "approve"]},
            "other-token-0123456789": {
                "name": "olga",
                "scopes": ["read", "write", "approve"],
                "namespaces": ["default", "other"],
            },
        },
    )
    async with TestClient(TestServer(make_app(config, nats_ready.url))) as c:
        yield c


def test_each_operation_documents_what_its_kinds_answer() -> None:
    """Every operation lists, with a description, each status of every kind it is of (a
    route written outside the table would miss some)."""
    for _, _, op in OPERATIONS:
        scope = "read" if scoped(op) else None
        for kind in kinds(scope, op["operationId"] == "receiveWebhook", has_body(op)):
            for status in ANSWERED_BY_KIND[kind]:
                assert status in op["responses"], (op["operationId"], kind, status)
                assert op["responses"][status]["description"] == PROBLEMS[status]


def test_every_status_the_gateway_code_answers_is_described() -> None:
    """Each status literal a gateway module answers with (``Problem(…)``, a browser rule's
    refusal, the connection guard's raw 503) is one the document describes; 500 is a bug's
    answer, never one by design (the fuzz test holds that no request gets it)."""
    found: set[str] = set()
    for source in GATEWAY.glob("*.py"):
        text = source.read_text()
        found |= set(re.findall(r"Problem\(\s*(\d{3})\b", text))
        found |= set(re.findall(r"_refuse\(\s*request,\s*(\d{3})\b", text))
        found |= set(re.findall(r"HTTP/1\.1 (\d{3}) ", text))
    assert {"421", "415", "429", "503"} <= found, found  # the search finds what it should
    assert found - {"500"} <= set(PROBLEMS), sorted(found - set(PROBLEMS))


async def test_each_kinds_answers_are_documented_on_each_operation(api: Api) -> None:
    """Provoked on every operation of its kind, the answer is the kind's status and it is in
    the operation's responses: another Host (421), a guessing address (429), a namespace not
    served here (503, or the route's own answer when it needs none), a body not JSON (415),
    a body too large (413)."""
    seen: dict[int, int] = {}

    def documented(op: dict[str, Any], status: int) -> None:
        assert str(status) in op["responses"], (op["operationId"], status)
        seen[status] = seen.get(status, 0) + 1

    for path, method, op in OPERATIONS:
        url = url_of(path, op)
        if op["operationId"] != "receiveWebhook":
            got = await status_of(api, method, url, headers={"Host": "evil.example"})
            assert got == 421, (op["operationId"], got)
            documented(op, got)
        if has_body(op):
            big = await status_of(
                api,
                method,
                url,
                data=b"[" + b"0," * 4000 + b"0]",
                headers={**ALL, "Content-Type": "application/json"},
            )
            assert big == 413, (op["operationId"], big)
            documented(op, big)
        if not scoped(op):
            continue
        if has_body(op):
            text = await status_of(
                api, method, url, data=b"hello", headers={**ALL, "Content-Type": "text/plain"}
            )
            assert text == 415, (op["operationId"], text)
            documented(op, text)
        elsewhere = await status_of(
            api, method, url, params={"namespace": "other"}, headers=OTHER, json={}
        )
        documented(op, elsewhere)

    # One unknown token from this address: from then on its requests with a token get 429.
    assert (
        await status_of(api, "get", "/v1/whoami", headers={"Authorization": "Bearer nope"}) == 401
    )
    for path, method, op in OPERATIONS:
        if scoped(op):
            got = await status_of(api, method, url_of(path, op), headers=ALL, data=b"{}")
            assert got == 429, (op["operationId"], got)
            documented(op, got)
    assert seen[503] >= 10, seen  # most routes act in the namespace, and say it is not served
