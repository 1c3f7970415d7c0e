"""`python -m server.cli [flags]`: the same as `kvserve serve [flags]`."""

import sys

from server.cli.runner import main

if __name__ == "__main__":
    sys.exit(main())
