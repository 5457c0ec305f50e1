"""Large payloads go to the ``jl_blobs`` object store; records and history hold a reference.

The name of a blob comes from the identity of what it holds (and the attempt that made it),
so writing it again writes the same thing under the same name.
"""

from __future__ import annotations

from nats.js.object_store import ObjectStore

from jetloop.schemas import BlobRef


class BlobStore:
    def __init__(self, store: ObjectStore, threshold: int) -> None:
        self.store = store
        self.threshold = threshold

    def too_big(self, data: bytes) -> bool:
        return len(data) > self.threshold

    async def put(self, name: str, data: bytes) -> BlobRef:
        await self.store.put(name, data)
        return BlobRef(blob=name, size=len(data))

    async def get(self, ref: BlobRef) -> bytes:
        res = await self.store.get(ref.blob)
        data: bytes = res.data or b""
        return data
