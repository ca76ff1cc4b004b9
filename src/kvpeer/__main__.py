"""``python -m kvpeer``: the same as the ``kvpeer`` command."""

import sys

from kvpeer.cli import main

sys.exit(main())
