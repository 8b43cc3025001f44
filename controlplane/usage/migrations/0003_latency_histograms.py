# The latency and TTFT histogram columns of the rollups (controlplane/usage/histogram.py): 36 buckets each.
# Written as a loop rather than 144 generated AddField blocks; the bucket count is fixed here on purpose, so a later
# change to histogram.BUCKETS needs a migration of its own.

from django.db import migrations, models

_FIELDS = [f"{kind}_h{i:02d}" for kind in ("latency", "ttft") for i in range(36)]


class Migration(migrations.Migration):
    dependencies = [
        ('usage', '0002_speculation_stats'),
    ]

    operations = [
        migrations.AddField(model_name=model, name=name, field=models.IntegerField(default=0, db_default=0))
        for model in ("usageday", "usageminute")
        for name in _FIELDS
    ]
