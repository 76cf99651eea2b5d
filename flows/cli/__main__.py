"""`python -m flows.cli`: the `shardline` command."""

import sys

from flows.cli.root import main

sys.exit(main())
