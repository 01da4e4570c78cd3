"""the reward spec's typed_through_penalty: every spec version stored before it existed keeps
the reward it had (a typed-through suggestion earned 0), so a replay under it is unchanged

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_json = sa.JSON().with_variant(sa.dialects.postgresql.JSONB(), "postgresql")
_specs = sa.table("reward_specs", sa.column("version", sa.Integer()), sa.column("spec", _json))


def upgrade() -> None:
    conn = op.get_bind()
    for version, spec in conn.execute(sa.select(_specs.c.version, _specs.c.spec)).all():
        if "typed_through_penalty" not in spec:
            conn.execute(
                _specs.update()
                .where(_specs.c.version == version)
                .values(spec={**spec, "typed_through_penalty": 0.0})
            )


def downgrade() -> None:
    conn = op.get_bind()
    for version, spec in conn.execute(sa.select(_specs.c.version, _specs.c.spec)).all():
        conn.execute(
            _specs.update()
            .where(_specs.c.version == version)
            .values(spec={k: v for k, v in spec.items() if k != "typed_through_penalty"})
        )
