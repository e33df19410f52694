"""``python -m jaxckpt ...``: the same command line as the ``jaxckpt`` console script."""

import sys

from jaxckpt.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
