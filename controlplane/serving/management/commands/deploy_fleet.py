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
        parser.add_argument("--num-cpus", type=float, default=None,
                            help="Ray CPUs per replica whose settings name none (default 1; with --fit-cpus, "
                                 "an equal share of those)")
        parser.add_argument("--fit-cpus", type=float, default=None,
                            help="size replicas that name no num_cpus so that all of them fit in this many CPUs")
        parser.add_argument("--models", default="", help="comma-separated model names (default: every installed one)")

    def handle(self, *args: Any, **options: Any) -> None:
        from fleet.app import connect, deploy

        wanted = {m.strip() for m in options["models"].split(",") if m.strip()}
        entries = [e for e in catalog().values() if not wanted or e.name in wanted]
        missing = wanted - {e.name for e in entries}
        if missing:
            self.stderr.write(f"not in the catalog: {', '.join(sorted(missing))}")
        num_cpus = options["num_cpus"] or 1.0
        if options["fit_cpus"]:
            # Ray places a replica only where its CPUs are free, so a machine with fewer cores than replicas
            # would wait forever on the last ones; a share each (Ray's CPUs are logical) lets them all start.
            count = sum(options["replicas"] for e in entries if e.installed)
            num_cpus = max(0.01, round(options["fit_cpus"] / max(1, count), 2))
        specs = deploy_specs(entries, replicas=options["replicas"], num_cpus=num_cpus)
        connect(options["address"])
        for name in deploy(specs):
            self.stdout.write(f"deployed {name}")
        self.stdout.write(self.style.SUCCESS(f"fleet: {len(specs)} model(s) deployed"))
