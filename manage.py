#!/usr/bin/env python
"""Runs the sample shop (sample_project) that shows outbox_app in use."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sample_project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
