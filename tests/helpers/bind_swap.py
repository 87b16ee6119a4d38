"""Issue 22 red-team follow-up: a bind source swapped for a symlink between two runs of one Policy.

Run as a script by tests/integration/test_bind_swap.py (as root, and as the unprivileged test
user through runuser). argv: SCRATCH SECRET_DIR. Prints one JSON object: what run 2 read, or the
error it got.
"""

import json
import os
import sys

import lowlevel

scratch, secret_dir = sys.argv[1], sys.argv[2]
w = os.path.join(scratch, "w")
os.makedirs(os.path.join(w, "sub"))
if os.geteuid() == 0:  # the sandbox's per-run uid writes w as "others"
    os.chmod(w, 0o777)
pol = lowlevel.Policy(binds=(lowlevel.Bind(w, "/opt/w", writable=True), lowlevel.Bind(os.path.join(w, "sub"),
                                                                                       "/opt/sub")))
first = lowlevel.run(["sh", "-c", f"rm -rf /opt/w/sub && ln -s {secret_dir} /opt/w/sub"], policy=pol,
                     keep_workspace=False)
out: dict = {"swap_exit": first.exit_code}
try:
    second = lowlevel.run(["sh", "-c", "cat /opt/sub/secret"], policy=pol, keep_workspace=False)
    out.update(read=second.stdout.decode(errors="replace"), exit=second.exit_code)
except lowlevel.LowlevelError as err:
    out.update(error=type(err).__name__, message=str(err))
print(json.dumps(out))
