"""``python -m wds_cloud``: the ``wds-cloud`` command."""

import sys

from .cli import main

sys.exit(main())
