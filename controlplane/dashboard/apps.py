from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "controlplane.dashboard"
    label = "dashboard"

    def ready(self) -> None:
        from controlplane.dashboard import live
        from controlplane.usage.services import usage_recorded

        usage_recorded.connect(live.notify, dispatch_uid="dashboard-live-usage")
