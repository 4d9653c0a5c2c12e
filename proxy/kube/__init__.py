"""Live cluster source: kubernetes-asyncio list/watch -> Karta engine -> pod index."""
