from django.urls import path

from controlplane.dashboard.consumers import OverviewConsumer

websocket_urlpatterns = [
    path("ws/dashboard/<str:account_id>/overview", OverviewConsumer.as_asgi()),
]
