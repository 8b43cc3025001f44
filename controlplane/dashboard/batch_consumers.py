"""The Batches page's WebSocket: forwards the account's `batch.progress` events (published by
controlplane/batches/events.py on every status change and, throttled, on count changes) to the open page. Only a
signed-in member of the account (or an operator) may open it; anyone else is closed with 4403."""

from __future__ import annotations

from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.api import layer
from controlplane.batches import events
from controlplane.dashboard.consumers import may_watch

# What the page needs of an event; anything else a publisher adds later stays on the server.
FIELDS = ("batch_id", "api", "status", "total", "completed", "failed", "cancelled")


class BatchesConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        self.account_id = self.scope["url_route"]["kwargs"]["account_id"]
        self.group: str | None = None
        if not await may_watch(self.scope.get("user"), self.account_id):
            await self.close(code=4403)
            return
        layer.remember_server_loop()
        self.group = events.group_name(self.account_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def batch_progress(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": events.EVENT_TYPE, **{k: event.get(k) for k in FIELDS}})
