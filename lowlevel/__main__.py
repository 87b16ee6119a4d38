"""``python -m lowlevel`` is the ``lowlevel`` command."""
import sys

from .cli import main

sys.exit(main())
