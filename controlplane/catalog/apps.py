from django.apps import AppConfig


class CatalogConfig(AppConfig):
    name = "controlplane.catalog"
    label = "catalog"
    verbose_name = "Model catalog and pricing"

    def ready(self) -> None:
        from controlplane.catalog import signals  # noqa: F401  (connects cache invalidation)
