"""Issue 10 item 4: bwrap's setup failures get the right explanation (pure: classify_setup_failure).

EAGAIN from clone(2) at the caller's process limit made bwrap say "Creating new namespace failed",
which was reported as "the host restricts unprivileged user namespaces" (the end-to-end case is
tests/integration/test_untrusted_inputs.py)."""

from __future__ import annotations

import errno

import pytest

from lowlevel.errors import BwrapNotFoundError
from lowlevel.sandbox.failures import classify_setup_failure


@pytest.mark.parametrize("stderr, expect, not_expect", [
    (b"bwrap: Creating new namespace failed: Resource temporarily unavailable\n", "process limit", "namespace"),
    (b"bwrap: Can't fork for pid 1: Resource temporarily unavailable\n", "process limit", "user namespace"),
    (b"bwrap: Creating new namespace failed: Cannot allocate memory\n", "out of memory", "user namespace"),
    (b"bwrap: Creating new namespace failed: No space left on device\n", "user namespace", "process limit"),
    (b"bwrap: No permissions to create new namespace, likely because the kernel does not allow "
     b"non-privileged user namespaces.\n", "user namespace", "process limit"),
    (b"", "not captured", "without a message"),
])
def test_setup_failure_explained(stderr: bytes, expect: str, not_expect: str) -> None:
    err = classify_setup_failure(stderr, ["bwrap"], ["true"])
    assert expect in str(err) and not_expect not in str(err).split("bwrap said:")[0], str(err)


def test_exec_helper_cannot_run_bwrap() -> None:
    err = classify_setup_failure(b"lowlevel_exec: execv /opt/x/bwrap: Permission denied\n", ["x"], ["true"])
    assert isinstance(err, BwrapNotFoundError) and err.errno == errno.EACCES
    assert "cannot execute bwrap /opt/x/bwrap" in str(err)
