from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("soakapp", "0002_sent"),
    ]

    operations = [
        migrations.AddField(
            model_name="effect",
            name="at",
            field=models.DateTimeField(null=True),
        ),
        migrations.AddField(
            model_name="sent",
            name="at",
            field=models.DateTimeField(null=True),
        ),
    ]
