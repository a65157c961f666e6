"""gunicorn configuration for greenserve in a checkout: ``gunicorn -c gunicorn.conf.py``.

The settings and hooks live in the package (``wsgi_app/gunicorn_config.py``), so that the installed
``greenserve`` command finds them from any folder; this file only re-exports them for gunicorn, which
reads the names of the settings and hooks from this module's namespace.
"""

from wsgi_app.gunicorn_config import *  # noqa: F403
