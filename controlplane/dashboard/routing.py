from django.urls import path

from controlplane.dashboard.batch_consumers import BatchesConsumer
from controlplane.dashboard.consumers import OverviewConsumer

websocket_urlpatterns = [
    path("ws/dashboard/<str:account_id>/overview", OverviewConsumer.as_asgi()),
    path("ws/dashboard/<str:account_id>/batches", BatchesConsumer.as_asgi()),
]
