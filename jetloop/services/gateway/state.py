"""What the gateway's handlers share: the NATS clients and read models of the namespaces, the
stop flag (aiohttp ``AppKey``s, set up by ``jetloop.services.gateway.app``'s ``cleanup_ctx``).

A namespace is a NATS account of its own (``jetloop.services.namespaces``): what a connection
sees is its credential's namespace and nothing else. So the gateway holds one connection per
namespace it acts in, and one read model each (the projector of each namespace writes its
own database). The default namespace's connection is made at start-up and, closed, ends the
gateway as before (a supervisor starts a new one); another namespace's is made on its first
request, through the ``urls_for`` the app was given, and one that closes is dropped and made
again on the next request, so one namespace's trouble does not take the others down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
from aiohttp import web
from nats.aio.client import Client as Nats

from jetloop.schemas.errors import NotAuthorized
from jetloop.services import namespaces
from jetloop.services.client import Client
from jetloop.services.gateway.config import GatewayConfig
from jetloop.services.gateway.http import Problem
from jetloop.services.readmodel.model import ReadModel, ReadModelMissing
from jetloop.streams.connection import connect, credentials_in, finish

log = structlog.get_logger("jetloop.gateway")

# The server URLs, with a credential of the namespace, to act in a namespace other than the
# default (``Settings.for_namespace(ns).nats_urls``).
UrlsFor = Callable[[str], Sequence[str]]


class ReadModelReader:
    """The read model, opened on first use: the projector may not have written it yet."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._model: ReadModel | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> ReadModel:
        if self.path is None:
            raise Problem(503, "read model not configured", "set the read model's database")
        async with self._lock:
            if self._model is None:
                try:
                    self._model = await ReadModel.open(self.path, readonly=True)
                except ReadModelMissing:
                    raise Problem(
                        503, "read model not available yet", "no projector has written it"
                    ) from None
            return self._model

    async def close(self) -> None:
        if self._model is not None:
            await self._model.close()
            self._model = None


def make_client(nc: Nats, config: GatewayConfig) -> Client:
    """A client on the gateway's connection ``nc``, sealing and verifying as configured."""
    return Client(
        nc,
        retry_for=config.nats_retry_seconds,
        sealer=config.sealer,
        verify=not config.read_unverified,
    )


def not_served(namespace: str) -> Problem:
    return Problem(503, "namespace not served here", f"this gateway does not act in {namespace!r}")


class Namespaces:
    """The clients and read models of the namespaces, each made on first use."""

    def __init__(
        self,
        config: GatewayConfig,
        default: Client,
        default_reader: ReadModelReader,
        urls_for: UrlsFor | None,
    ) -> None:
        self.config = config
        self.urls_for = urls_for
        self._clients: dict[str, Client] = {namespaces.DEFAULT: default}
        self._readers: dict[str, ReadModelReader] = {namespaces.DEFAULT: default_reader}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    def _serves(self, namespace: str) -> None:
        if self._closed:
            raise Problem(503, "stopping", "the gateway is stopping")
        if namespace != namespaces.DEFAULT and self.urls_for is None:
            raise not_served(namespace)

    async def client(self, namespace: str) -> Client:
        self._serves(namespace)
        found = self._clients.get(namespace)
        if namespace == namespaces.DEFAULT:
            assert found is not None
            return found
        if found is not None and not found.nc.is_closed:
            return found
        async with self._locks.setdefault(namespace, asyncio.Lock()):
            found = self._clients.get(namespace)
            if found is not None and not found.nc.is_closed:
                return found
            client = await self._connect(namespace)
            if self._closed:
                await client.nc.close()
                raise Problem(503, "stopping", "the gateway is stopping")
            self._clients[namespace] = client
            return client

    async def _connect(self, namespace: str) -> Client:
        assert self.urls_for is not None
        try:
            urls = list(self.urls_for(namespace))
        except namespaces.NamespaceError as exc:
            log.warning("gateway.namespace_unknown", namespace=namespace, error=str(exc))
            raise not_served(namespace) from None
        # The credential is the namespace: one of another would act there, silently.
        user = credentials_in(urls)[0]
        if user is None or namespaces.identity(user)[0] != namespace:
            log.error("gateway.namespace_credential", namespace=namespace, user=user)
            raise not_served(namespace)

        async def on_closed() -> None:
            if not self._closed:
                log.warning("gateway.namespace_connection_closed", namespace=namespace)

        try:
            nc = await connect(
                urls,
                name=f"jetloop-gateway-{namespace}",
                # Bounded: a request waits on the first connect, and a connection that stays
                # away this long closes, to be made again by the next request.
                give_up_after=self.config.nats_retry_seconds,
                closed_cb=on_closed,
            )
        except NotAuthorized:
            log.error("gateway.namespace_refused", namespace=namespace, user=user)
            raise not_served(namespace) from None
        log.info("gateway.namespace_connected", namespace=namespace)
        return make_client(nc, self.config)

    def reader(self, namespace: str) -> ReadModelReader:
        self._serves(namespace)
        found = self._readers.get(namespace)
        if found is None:
            db = self.config.readmodel_db
            found = ReadModelReader(namespaces.readmodel_path(db, namespace) if db else None)
            self._readers[namespace] = found
        return found

    async def close(self) -> None:
        """Close every namespace's connection and read model but the default's, which the
        app's start-up made and closes."""
        self._closed = True
        for namespace, client in list(self._clients.items()):
            if namespace == namespaces.DEFAULT:
                continue
            await finish(client.nc)
        for namespace, reader in list(self._readers.items()):
            if namespace != namespaces.DEFAULT:
                await reader.close()


NATS_URLS: web.AppKey[tuple[str, ...]] = web.AppKey("nats_urls")
URLS_FOR: web.AppKey[UrlsFor | None] = web.AppKey("urls_for")
# The default namespace's client and read model (``/readyz`` asks the first).
CLIENT = web.AppKey("client", Client)
READMODEL = web.AppKey("readmodel", ReadModelReader)
NAMESPACES = web.AppKey("namespaces", Namespaces)
STOPPING = web.AppKey("stopping", asyncio.Event)
# Set when the default namespace's connection closes while the gateway is not stopping: it
# will not reopen.
NATS_CLOSED = web.AppKey("nats_closed", asyncio.Event)
# The namespace a request acts in (``jetloop.services.gateway.app.in_namespace``).
NAMESPACE = web.RequestKey("namespace", str)


def namespace_of(request: web.Request) -> str:
    """The namespace the request acts in: the one its token's grant allowed, else (open routes,
    webhooks) the default."""
    return request[NAMESPACE] if NAMESPACE in request else namespaces.DEFAULT


async def client_of(request: web.Request, namespace: str | None = None) -> Client:
    """The client of the request's namespace (or of ``namespace``)."""
    return await request.app[NAMESPACES].client(namespace or namespace_of(request))


def readmodel_of(request: web.Request) -> ReadModelReader:
    """The read model of the request's namespace."""
    return request.app[NAMESPACES].reader(namespace_of(request))
