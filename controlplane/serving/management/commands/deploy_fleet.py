"""Deploy the catalog's installed models on the Ray cluster at RAY_ADDRESS (or --address), as fleet replicas."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from controlplane.catalog.services import catalog
from controlplane.serving.fleet_backend import deploy_specs


class Command(BaseCommand):
    help = "Deploy (or update) one Ray Serve application per installed model; replicas from each model's settings."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS)")
        parser.add_argument("--replicas", type=int, default=1,
                            help="replicas per model whose settings name none (default 1)")
        parser.add_argument("--models", default="", help="comma-separated model names (default: every installed one)")

    def handle(self, *args: Any, **options: Any) -> None:
        from fleet.app import connect, deploy

        wanted = {m.strip() for m in options["models"].split(",") if m.strip()}
        entries = [e for e in catalog().values() if not wanted or e.name in wanted]
        missing = wanted - {e.name for e in entries}
        if missing:
            self.stderr.write(f"not in the catalog: {', '.join(sorted(missing))}")
        specs = deploy_specs(entries, replicas=options["replicas"])
        connect(options["address"])
        for name in deploy(specs):
            self.stdout.write(f"deployed {name}")
        self.stdout.write(self.style.SUCCESS(f"fleet: {len(specs)} model(s) deployed"))
