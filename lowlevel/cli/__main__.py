"""``python -m lowlevel.cli`` is the ``lowlevel`` command too (as ``python -m lowlevel``)."""
import sys

from lowlevel.cli import main

sys.exit(main())
