"""`python -m autopar ...` is the `autopar` command."""
import sys

from autopar.cli.main import main

sys.exit(main())
