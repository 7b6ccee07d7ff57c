"""shoal's HTTP API server (`shoal serve`): FastAPI app factory, auth/projects/quotas, streaming, metrics.

Import `shoal.server.app.create_app` or `shoal.server.run.serve`; this package itself stays light so
the SDK can import `shoal.server.codec` without web dependencies.
"""
