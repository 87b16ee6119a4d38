"""Per-run uids are never an NSS directory's ids (sssd, LDAP, winbind), not only /etc/passwd's.

A root caller's sandbox runs as a leased uid (lowlevel.workspace.uids.UidLease). Where nsswitch.conf takes
users or groups from a source beyond ``files`` (sssd's default id mapping spans
200000-2000200000, the default per-run range included), a lease handed a directory user's uid
would let that user own the sandbox's files, and the sandbox that user's. The lookup is real:
glibc's NSS, with nss_wrapper (libnss-wrapper) standing in for the directory in a subprocess,
its users and groups in files of our own (the host's /etc is never touched).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lowlevel.workspace import uids

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-run uid leases are for root callers")

NSS_WRAPPER = next((p for p in ("/usr/lib/x86_64-linux-gnu/libnss_wrapper.so", "/usr/lib/aarch64-linux-gnu/"
                                "libnss_wrapper.so", "/usr/lib64/libnss_wrapper.so") if os.path.exists(p)), None)

_LEASE = textwrap.dedent("""
    import json, sys
    from lowlevel.workspace import uids
    uids.NSSWITCH_PATH = sys.argv[1]
    uids.UID_LOCK_PATH = sys.argv[2]  # a lease file (and rotation cursor) of this test's own
    lease = uids.UidLease.acquire()
    print(json.dumps({"uid": lease.uid, "nss_beyond_files": uids.nss_beyond_files()}))
    lease.release()
""")


def _free_pair() -> int:
    """Two consecutive ids of the default range that /etc/passwd and /etc/group do not name."""
    first, count = uids.DEFAULT_UID_RANGE
    taken = uids.account_uids(first, count)
    return next(u for u in range(first + count - 3, first, -1) if u not in taken and u + 1 not in taken)


def _lease(tmp_path: Path, uid: int, *, nsswitch: str, passwd: str = "", group: str = "") -> dict[str, object]:
    conf = tmp_path / "nsswitch.conf"
    conf.write_text(nsswitch)
    (tmp_path / "passwd").write_text(passwd)
    (tmp_path / "group").write_text(group)
    env = dict(os.environ, LOWLEVEL_UID_RANGE=f"{uid}-{uid + 1}", LD_PRELOAD=str(NSS_WRAPPER),
               NSS_WRAPPER_PASSWD=str(tmp_path / "passwd"), NSS_WRAPPER_GROUP=str(tmp_path / "group"))
    proc = subprocess.run([sys.executable, "-c", _LEASE, str(conf), str(tmp_path / "uids.lock")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout)
    return out


@pytest.mark.skipif(NSS_WRAPPER is None, reason="needs libnss-wrapper (apt install libnss-wrapper)")
@pytest.mark.parametrize("kind", ["user", "group"])
def test_a_directory_id_is_never_leased(tmp_path: Path, kind: str) -> None:
    uid = _free_pair()
    directory = {"passwd": f"alice:x:{uid}:{uid}:Directory user:/home/alice:/bin/sh\n"} if kind == "user" \
        else {"group": f"admins:x:{uid}:\n"}
    # The attack's setting: the directory names the first id of the range; it must be skipped.
    got = _lease(tmp_path, uid, nsswitch="passwd: files sss\ngroup: files [NOTFOUND=return] sss\n", **directory)
    assert got == {"uid": uid + 1, "nss_beyond_files": True}
    # Control: the same directory without that id: the first id is leased.
    assert _lease(tmp_path, uid, nsswitch="passwd: files sss\ngroup: files sss\n")["uid"] == uid


@pytest.mark.skipif(NSS_WRAPPER is None, reason="needs libnss-wrapper (apt install libnss-wrapper)")
def test_files_only_hosts_do_not_ask_nss(tmp_path: Path) -> None:
    """files/systemd only: /etc/passwd and /etc/group are read directly, no lookup per run (so
    an id only the preloaded stand-in knows is leased: nothing asked it)."""
    uid = _free_pair()
    got = _lease(tmp_path, uid, nsswitch="passwd: files systemd\ngroup: files systemd\n",
                 passwd=f"alice:x:{uid}:{uid}::/:/bin/sh\n")
    assert got == {"uid": uid, "nss_beyond_files": False}


@pytest.mark.parametrize("text,beyond", [
    ("passwd: files systemd\ngroup: files systemd\nhosts: files dns\n", False),
    ("passwd:         files sss\ngroup: files\n", True),
    ("passwd: files\ngroup: files [NOTFOUND=return] ldap # a comment\n", True),
    ("# passwd: sss\npasswd: compat\n", True),
    ("hosts: files mdns4_minimal [NOTFOUND=return] dns\n", False),
])
def test_nsswitch_sources(tmp_path: Path, text: str, beyond: bool) -> None:
    conf = tmp_path / "nsswitch.conf"
    conf.write_text(text)
    assert uids.nss_beyond_files(str(conf)) is beyond
    assert uids.nss_beyond_files(str(tmp_path / "missing")) is False
