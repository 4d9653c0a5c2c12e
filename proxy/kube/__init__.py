"""Live cluster source: the project's own list/watch loop (``watcher``, over
kubernetes-asyncio's ``call_api``) -> Karta engine -> pod index."""
