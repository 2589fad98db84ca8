"""OpenAI-compatible HTTP server: ``tpspec serve`` (see ``api``)."""
