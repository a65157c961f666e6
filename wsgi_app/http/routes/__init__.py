"""The app's HTTP routes, one blueprint per module, each named for the routes it serves.

``completions`` (``POST /v1/completions``), ``completions_get`` (``GET /v1/completions``, the
``EventSource`` stream), ``chat`` (``/v1/chat/completions``), ``responses`` (``/v1/responses``, and
``GET`` / ``DELETE /v1/responses/{id}``), ``models`` (``/v1/models``), ``ops`` (probes,
``/debug/*``), ``stats`` (``/metrics``, ``/stats``, ``/stats/history``), ``pages`` (``/``,
``/status``, ``/assets/*``) and ``openapi`` (``/openapi.json``).
"""
