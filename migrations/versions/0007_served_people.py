"""the index that answers "has this key served this person?" in one probe

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ingestion checks each person a model_switch or churn names against the sending key
    # (service/events/trust.lookup): with this index a key that never served the person
    # costs a probe, not a walk through everything the person was ever served
    op.create_index("ix_rollouts_user_id_api_key_id", "rollouts", ["user_id", "api_key_id"])


def downgrade() -> None:
    op.drop_index("ix_rollouts_user_id_api_key_id", table_name="rollouts")
