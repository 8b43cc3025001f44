"""The overview's WebSocket: on connect and after each usage notice, the same snapshot the page was rendered
with (stats.overview). Only a signed-in member of the account (or an operator) may open it."""

from __future__ import annotations

import asyncio
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.utils import timezone

from controlplane.accounts.models import Account
from controlplane.accounts.services import user_can_access
from controlplane.api import layer
from controlplane.dashboard import live, stats

BURST_S = 0.2  # a notice is followed by others in a burst: read once they have landed
# Engine gauges (KV-cache use, queue) move without any usage event: an open overview re-reads this often anyway.
TICK_S = 5.0


@database_sync_to_async
def _snapshot(account_id: str) -> dict[str, Any] | None:
    account = Account.objects.filter(pk=account_id).first()
    return stats.overview(account, timezone.now()) if account is not None else None


@database_sync_to_async
def may_watch(user: Any, account_id: str) -> bool:
    """A signed-in member of the account, or an operator: who may open any of the account's sockets."""
    return bool(user is not None and user.is_authenticated and user_can_access(user, account_id))


class OverviewConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        self.account_id = self.scope["url_route"]["kwargs"]["account_id"]
        self.group = None
        self._dirty = False
        self._refresher: asyncio.Task | None = None
        self._ticker: asyncio.Task | None = None
        if not await may_watch(self.scope.get("user"), self.account_id):
            await self.close(code=4403)
            return
        layer.remember_server_loop()
        self.group = live.group_name(self.account_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self._send_snapshot()
        self._ticker = asyncio.create_task(self._tick())

    async def disconnect(self, code: int) -> None:
        for task in (self._refresher, self._ticker):
            if task is not None:
                task.cancel()
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def usage_changed(self, event: dict[str, Any]) -> None:
        self._dirty = True
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.create_task(self._refresh())

    async def _refresh(self) -> None:
        # Read after the burst, then once more after the publisher's throttle window: an event whose own notice
        # was skipped is in one of the two reads.
        while self._dirty:
            self._dirty = False
            await asyncio.sleep(BURST_S)
            await self._send_snapshot()
            await asyncio.sleep(live.REREAD_AFTER_S)
            await self._send_snapshot()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if self._refresher is None or self._refresher.done():
                await self._send_snapshot()

    async def _send_snapshot(self) -> None:
        snapshot = await _snapshot(self.account_id)
        if snapshot is not None:
            await self.send_json({"type": "overview", "data": snapshot})
