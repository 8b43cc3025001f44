"""The dashboard's routes. Each page module owns its own `urlpatterns`; this list only puts them together."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from controlplane.dashboard import views, views_adapters, views_batches, views_models, views_usage

urlpatterns = [
    path("", views.home, name="dashboard"),
    path("login/", auth_views.LoginView.as_view(template_name="dashboard/login.html",
                                                redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("<str:account_id>/", views.overview, name="dashboard-overview"),
    path("<str:account_id>/keys/", views.keys, name="dashboard-keys"),
    *views_models.urlpatterns,
    *views_adapters.urlpatterns,
    *views_batches.urlpatterns,
    *views_usage.urlpatterns,
]
