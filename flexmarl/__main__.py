"""`python -m flexmarl` is the `flexmarl` command."""

import sys

from flexmarl.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
