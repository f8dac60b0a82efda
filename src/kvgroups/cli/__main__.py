"""``python -m kvgroups.cli``: the same as the ``kvgroups`` command."""

import sys

from kvgroups.cli.main import main

sys.exit(main())
