"""``python -m parallm``: the same program as the ``parallm`` console script."""

import sys

from .cli import main

sys.exit(main())
