"""Alembic environment of the store, run only through ``controlplane.store.migrate``.

There is no alembic.ini: ``migrate`` builds the ``Config`` and passes an open connection
in ``config.attributes["connection"]``, already inside the transaction (and holding the
lock) that the whole upgrade must run in, so this file never creates an engine.
SQLite gets ``render_as_batch`` because it cannot ALTER most things in place.
"""

from __future__ import annotations

from alembic import context

from fleet.controlplane.store.schema import metadata


def run_migrations() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None or context.is_offline_mode():
        raise RuntimeError("fleet's store migrations run through controlplane.store.migrate "
                           "(fleet db upgrade), with an open connection")
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
