"""``python -m kit.leaderboard``: the same command as ``python -m kit leaderboard``."""

import sys

from .cli import main

sys.exit(main())
