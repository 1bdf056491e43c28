"""A checkpoint service for JAX state trees, on Orbax. Knows nothing about models."""
