"""The `shardline` command: a root (root.py), one module per command, and the helpers they share (_utilities.py).

`shardline` (the console script) and `python -m flows.cli` both run `main`.
"""

from flows.cli.root import main

__all__ = ["main"]
