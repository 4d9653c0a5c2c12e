"""The bundled demo data: a snapshot of a small cluster and a recorded batch of its series."""
