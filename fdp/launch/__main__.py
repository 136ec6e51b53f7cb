"""``python -m fdp.launch`` runs ``fdp launch``."""

import sys

from fdp.launch._cli import main

if __name__ == "__main__":
    sys.exit(main())
