"""``python -m lowlevel`` is the ``lowlevel`` command."""
import sys

from lowlevel.cli import main

sys.exit(main())
