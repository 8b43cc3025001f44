"""WSGI entry point, for management tooling only: the inference APIs stream and need the ASGI app."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = get_wsgi_application()
