"""`make cluster`: on one machine, a local Ray head, the fleet and the control plane on it, in the foreground.

Ctrl-C or SIGTERM stops everything this started, Ray included. Several machines: see docs/deploy.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = "Start a local Ray head, deploy every installed model as fleet replicas, and serve with HEARTH_ENGINE=ray."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--replicas", type=int, default=int(os.environ.get("REPLICAS", "2")))
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        # Not 6379, Ray's default: that is Redis's port, and the control plane may be using Redis.
        parser.add_argument("--ray-port", type=int, default=int(os.environ.get("RAY_PORT", "6390")))
        parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)

    def handle(self, *args: Any, **options: Any) -> None:
        ray = [sys.executable, "-m", "ray.scripts.scripts"]
        address = f"127.0.0.1:{options['ray_port']}"
        stopping = False

        def stop(*_: Any) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        server: subprocess.Popen[bytes] | None = None
        # Ray's token authentication: a driver given an explicit address only uses it when told to, so the
        # head, deploy_fleet and the server all run with it said outright, and the token (~/.ray/auth_token)
        # is made here when this machine has none yet. RAY_AUTH_MODE=disabled in the environment opts out.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if os.environ["RAY_AUTH_MODE"] == "token":
            subprocess.run([*ray, "get-auth-token", "--generate"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([*ray, "start", "--head", f"--port={options['ray_port']}", f"--num-cpus={options['num_cpus']}",
                        "--include-dashboard=false", "--disable-usage-stats"], check=True)
        try:
            os.environ["RAY_ADDRESS"] = address
            call_command("deploy_fleet", address=address, replicas=options["replicas"],
                         fit_cpus=options["num_cpus"], stdout=self.stdout)
            env = {**os.environ, "HEARTH_ENGINE": "ray", "RAY_ADDRESS": address,
                   "HEARTH_BATCH_WORKER": os.environ.get("HEARTH_BATCH_WORKER", "inprocess")}
            server = subprocess.Popen([sys.executable, "-m", "uvicorn", "controlplane.asgi:application",
                                       "--host", options["host"], "--port", str(options["port"])], env=env)
            self.stdout.write(self.style.SUCCESS(
                f"serving on http://{options['host']}:{options['port']} with {options['replicas']} replica(s) per "
                f"model on Ray at {address}; Ctrl-C stops everything"))
            while not stopping and server.poll() is None:
                time.sleep(0.5)
        finally:
            if server is not None and server.poll() is None:
                server.terminate()
                try:
                    server.wait(15)
                except subprocess.TimeoutExpired:
                    server.kill()
            subprocess.run([*ray, "stop", "--force"], check=False)
            self.stdout.write("cluster stopped")
