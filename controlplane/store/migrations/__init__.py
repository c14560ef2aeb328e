"""Alembic migrations of the store's schema, run by ``controlplane.store.migrate``."""
