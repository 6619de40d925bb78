"""``python -m parallm.integrations.tinker --model ... --tp 2 --port 8000``: the Tinker-API server (docs/tinker.md)."""

import sys

from .launcher import main

sys.exit(main())
