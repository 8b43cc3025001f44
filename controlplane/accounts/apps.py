from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "controlplane.accounts"
    label = "accounts"
    verbose_name = "Accounts and API keys"

    def ready(self) -> None:
        from controlplane.accounts import signals  # noqa: F401  (connects key-cache invalidation)
