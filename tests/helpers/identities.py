"""The caller identities the CLI-level tests take, in one place (issue 26: the same fixtures
were written in many modules).

The ``who`` fixture (tests/conftest.py) is None for the suite's own uid (root in CI, or the
user running it) and the unprivileged test user's passwd entry otherwise.
"""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path


def owned_tmpdir(who: pwd.struct_passwd | None, prefix: str) -> Path:
    """A fresh 0755 directory under the temp dir, owned by ``who`` (None: by the caller)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, 0o755)
    if who is not None:
        os.chown(path, who.pw_uid, who.pw_gid)
    return path
