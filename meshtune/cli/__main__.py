"""`python -m meshtune.cli ...`: the `meshtune` command, as the console script runs it."""

import sys

from . import main

sys.exit(main())
