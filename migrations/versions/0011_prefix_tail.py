"""the workspace memory's documents keep the end of their latest request's prefix apart, so that
telling a typed-through suggestion reads a few hundred characters, not the whole file; in
PostgreSQL their text is compressed with lz4 rather than pglz (an upsert of a 150 KB file: about
1.7 ms rather than 4.4, on every completion request: benchmarks/memory_writes.py)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def _set_compression(method: str) -> None:
    """PostgreSQL only (SQLite does not compress); a server built without lz4 keeps pglz."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    try:
        with bind.begin_nested():
            op.execute(f"ALTER TABLE workspace_code ALTER COLUMN text SET COMPRESSION {method}")
    except sa.exc.DBAPIError:  # "compression method lz4 not supported"
        pass


def upgrade() -> None:
    with op.batch_alter_table("workspace_code") as batch:
        batch.add_column(sa.Column("prefix_tail", sa.Text(), nullable=True))
    _set_compression("lz4")


def downgrade() -> None:
    _set_compression("pglz")
    with op.batch_alter_table("workspace_code") as batch:
        batch.drop_column("prefix_tail")
