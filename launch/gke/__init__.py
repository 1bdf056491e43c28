"""GKE: the JobSet (one pod per TPU host) and verifier Job manifest (manifest.py)."""
