"""The unprivileged memory fallback (``RLIMIT_DATA``) says exactly what it bounds (issue 12,
item 7): each claim of :data:`lowlevel.spec.limits.MEMORY_FALLBACK_NOTE` checked by a program.

As root the memory cgroup bounds everything (the shared mapping is OOM-killed too); as the
unprivileged user, without a delegated cgroup, the note is in ``Result.notes`` and the program
shows what it does and does not bound: a private heap over the limit fails, a ``MAP_SHARED``
mapping over it is filled (the documented hole), and ``address_space_bytes`` (``RLIMIT_AS``)
closes that hole.
"""

from __future__ import annotations

import pytest

from lowlevel.spec.limits import MEMORY_FALLBACK_NOTE

pytestmark = [pytest.mark.bwrap, pytest.mark.timeout(180)]

MiB = 1 << 20
LIMIT = 128 * MiB
#: mmap 384 MiB, shared or private, and touch every page.
FILL = """
import mmap, sys
flags = mmap.MAP_SHARED if sys.argv[1] == "shared" else mmap.MAP_PRIVATE
try:
    m = mmap.mmap(-1, 384 << 20, flags=flags | mmap.MAP_ANONYMOUS)
except OSError as e:
    print("mmap failed", e.errno); sys.exit(3)
for i in range(0, len(m), 4096):
    m[i] = 1
print("filled")
"""


@pytest.mark.parametrize("kind", ["private", "shared"])
def test_fallback_note_matches_what_the_kernel_does(sandbox, kind: str) -> None:  # type: ignore[no-untyped-def]
    out = sandbox.run(["python3", "-c", FILL, kind], timeout=60, limits={"memory_bytes": LIMIT})
    assert out.error is None, out.message
    if "cgroup:memory" in out.limits_enforced:
        assert sandbox.identity == "root"
        assert out.killed_by == "memory" and "filled" not in out.out, out
        assert MEMORY_FALLBACK_NOTE not in out.notes
        return
    assert "RLIMIT_DATA" in out.limits_enforced and MEMORY_FALLBACK_NOTE in out.notes, out
    if kind == "private":
        assert out.exit_code == 3 and "mmap failed 12" in out.out, out   # ENOMEM: bounded
    else:
        assert out.exit_code == 0 and "filled" in out.out, out           # MAP_SHARED: not bounded
        assert out.killed_by is None


def test_address_space_limit_bounds_shared_mappings_too(sandbox) -> None:  # type: ignore[no-untyped-def]
    out = sandbox.run(["python3", "-c", FILL, "shared"], timeout=60,
                      limits={"memory_bytes": LIMIT, "address_space_bytes": 256 * MiB})
    assert out.error is None, out.message
    assert "filled" not in out.out, out
