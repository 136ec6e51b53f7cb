"""``python -m fdp`` runs the ``fdp`` command line."""

import sys

from fdp.cli import main

if __name__ == "__main__":
    sys.exit(main())
