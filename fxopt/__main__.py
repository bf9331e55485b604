"""`python -m fxopt ...` is the `fxopt` command line."""
import sys

from .frontends.cli import main

sys.exit(main())
