"""One set of parts per namespace of the store, kept in step with it.

``jetloop up`` serves every namespace (docs/design.md, "Namespaces"), including one made while
it runs: this service looks at the store's namespaces (``jetloop.services.namespaces.names``)
every ``poll`` seconds; when a namespace or a credential was made or removed it first lets
``accept`` make the server know it (``up`` rewrites the server's accounts, has it reload them
and waits until it takes the new namespaces' credentials), and then runs each new
namespace's parts, in stages, under a supervisor of their own, so one
namespace's failing part is restarted without touching the others'. A namespace deleted
from the store has its parts stopped; one whose ``settings`` (what its parts are built from,
e.g. its turn rate) changed has them stopped and built again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import structlog

from jetloop.services import namespaces
from jetloop.services.lifecycle import Service
from jetloop.services.supervisor import Component, Supervisor

log = structlog.get_logger("jetloop.namespaces")


class Namespaced(Service):
    def __init__(
        self,
        store_dir: Path,
        parts: Callable[[str], Sequence[Sequence[Component]]],
        *,
        serve: Callable[[str], bool] = lambda ns: ns != namespaces.DEFAULT,
        accept: Callable[[list[str]], Awaitable[None]] | None = None,
        known: list[str] | None = None,
        settings: Callable[[str], object] = lambda ns: None,
        poll: float = 1.0,
    ) -> None:
        """``known``: the store's credential files (``namespaces.listing``) the server was
        started with; ``accept`` is called only once they change (a reload while clients
        are still connecting can refuse them)."""
        super().__init__()
        self.store_dir = store_dir
        self.parts = parts
        self.serve = serve
        self.accept = accept
        self.poll = poll
        self.settings = settings
        self.running: dict[str, tuple[Supervisor, asyncio.Task[None]]] = {}
        # What each running namespace's parts were built from.
        self._built: dict[str, object] = {}
        self._seen = known

    async def run(self) -> None:
        try:
            while not self._stopping.is_set():
                await self._follow()
                self._started.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.poll)
        finally:
            await asyncio.gather(*(self._end(ns) for ns in list(self.running)))

    async def _follow(self) -> None:
        names = [ns for ns in namespaces.names(self.store_dir) if self.serve(ns)]
        changed = [
            ns for ns in names if ns in self.running and self.settings(ns) != self._built[ns]
        ]
        new = [ns for ns in names if ns not in self.running or ns in changed]
        gone = [ns for ns in self.running if ns not in names or ns in changed]
        for ns, (_, task) in list(self.running.items()):
            if task.done():
                # Its supervisor gave up: fail, and let ours build everything again.
                task.result()
                raise RuntimeError(f"namespace {ns}: its parts stopped")
        # A namespace or a credential made or removed since the last look: the server must
        # know it before anyone uses it.
        seen = namespaces.listing(self.store_dir)
        if seen != self._seen and self.accept is not None:
            await self.accept(new)
        self._seen = seen
        for ns in gone:
            await self._end(ns)
            if ns not in changed:
                log.info("namespace.left", namespace=ns)
        for ns in new:
            self._built[ns] = self.settings(ns)
            if ns in changed:
                log.info("namespace.changed", namespace=ns, settings=self._built[ns])
            sup = Supervisor([list(stage) for stage in self.parts(ns)])
            self.running[ns] = (sup, asyncio.create_task(sup.run(), name=f"namespace:{ns}"))
            log.info("namespace.served", namespace=ns)
        for ns in new:
            sup, task = self.running[ns]
            started = asyncio.create_task(sup.wait_started())
            await asyncio.wait((started, task), return_when=asyncio.FIRST_COMPLETED)
            started.cancel()

    async def _end(self, ns: str) -> None:
        sup, task = self.running.pop(ns)
        self._built.pop(ns, None)
        await sup.stop()
        with contextlib.suppress(Exception):
            await task
