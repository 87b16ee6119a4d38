"""What a per-run uid lease and a bind's socket scan cost (issue 22, items 6 and 2).

    sudo python bench/uid_lease.py [--leases N] [--tree DIR]

- ``lease``: ``UidLease.acquire()`` + ``release()`` in a loop (root only: the lease is for root
  callers), on a lock file of its own in a temporary directory (uids.UID_LOCK_PATH) and a
  100-uid range at the top of the default range, so no live sandbox is disturbed. Each lease
  reads and advances the rotation cursor under flock(2): the figure includes that.
- ``scan``: :func:`lowlevel.sandbox.bind_sockets.scan` of ``--tree`` (default: this interpreter's
  prefix, a virtualenv), cold then warm; once per Policy and process, on its first run.
Prints microseconds per lease and milliseconds (and entries) per scan.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leases", type=int, default=20000)
    ap.add_argument("--tree", default=sys.prefix)
    args = ap.parse_args()
    from lowlevel.sandbox import bind_sockets
    from lowlevel.workspace import uids
    if os.geteuid() == 0:
        first = uids.DEFAULT_UID_RANGE[0] + uids.DEFAULT_UID_RANGE[1] - 200
        os.environ["LOWLEVEL_UID_RANGE"] = f"{first}-{first + 99}"
        with tempfile.TemporaryDirectory() as d:
            uids.UID_LOCK_PATH = os.path.join(d, "uids.lock")
            for _ in range(200):
                uids.UidLease.acquire().release()
            t = time.perf_counter()
            for _ in range(args.leases):
                uids.UidLease.acquire().release()
            print(f"lease: {(time.perf_counter() - t) / args.leases * 1e6:.1f} us per acquire+release "
                  f"({args.leases} leases)")
    else:
        print("lease: skipped (root only)")
    tree = os.path.realpath(args.tree)
    entries = sum(len(ds) + len(fs) for _, ds, fs in os.walk(tree))
    for label in ("cold", "warm"):
        t = time.perf_counter()
        found = bind_sockets.scan(tree, "/bench")
        print(f"scan ({label}): {(time.perf_counter() - t) * 1e3:.1f} ms for {entries} entries of {tree}, "
              f"{len(found.sockets)} sockets{', ' + found.incomplete if found.incomplete else ''}")


if __name__ == "__main__":
    main()
