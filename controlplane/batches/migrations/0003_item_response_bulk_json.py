from django.db import migrations

import controlplane.batches.fields


class Migration(migrations.Migration):
    """Item.response is written and read by orjson (controlplane/batches/fields.py). The column stays what it
    was (text on SQLite, jsonb on PostgreSQL), so only the model's state changes: without this, SQLite would
    copy the whole items table to alter nothing."""

    dependencies = [
        ("batches", "0002_dispatched_count"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="item",
                    name="response",
                    field=controlplane.batches.fields.BulkJSONField(blank=True, null=True),
                ),
            ],
            database_operations=[],
        ),
    ]
