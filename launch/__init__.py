"""How the service runs for real: local pods, schedulers, exit codes and restart policy."""
