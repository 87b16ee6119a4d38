"""Two egress runs in one process, one flooding the shared proxy's resolver (issue 22 item 5).

Run A (a thread) opens ``FLOOD`` CONNECTs to names that never resolve (the scripted
resolver holds each lookup until released), then, while its lookups hang, asks for a name
that does resolve; run B, started when A's program says it has done so (a file in a bound
directory), fetches that same name. The resolver is released only after B ends, so B ran
while A's lookups held their threads. Prints one JSON document: A's program output and
network, B's stdout and network, the lookups blocked when B started.

Used by tests/integration/test_egress.py as root and, through runuser, as the test user.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from origin_servers import Origin  # noqa: E402
from scripted_resolver import ScriptedResolver, override_resolver  # noqa: E402

import lowlevel  # noqa: E402
from lowlevel.net import resolve  # noqa: E402

FLOOD = 120

PROGRAM = r"""
import json, select, socket, sys, time
flood, expect, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def connect(name, p):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=60)
    s.sendall(f"CONNECT {name}:{p} HTTP/1.1\r\nHost: {name}:{p}\r\n\r\n".encode())
    return s
pending = {connect(f"n{i}.never.test", 443) for i in range(flood)}
refused = []
while len(refused) < expect:
    ready, _, _ = select.select(list(pending), [], [], 60)
    if not ready:
        break
    for s in ready:
        refused.append(s.recv(4096).decode("latin-1").split("\r\n")[0])
        pending.discard(s)
probe = connect("b.test", port)
probe_line = probe.recv(4096).decode("latin-1").split("\r\n")[0]
open("/signal/ready", "w").close()
late = []
for s in pending:  # answered once the driver releases the resolver
    try:
        late.append(s.recv(4096).decode("latin-1").split("\r\n")[0][:40])
    except OSError as e:
        late.append(type(e).__name__)
print(json.dumps({"refused": refused, "probe": probe_line, "late": len(late)}))
"""


def main() -> int:
    origin = Origin("b")
    signal = tempfile.mkdtemp(prefix="lowlevel-fair-")
    os.chmod(signal, 0o777)
    workspaces = [tempfile.mkdtemp(prefix="lowlevel-fair-ws-") for _ in range(2)]
    for ws in workspaces:
        os.chmod(ws, 0o755)
    res = ScriptedResolver({"b.test": ["127.0.0.1"]}, blocking=(".never.test",))
    expect = FLOOD - resolve.RESOLVE_PER_RUN - resolve.RESOLVE_QUEUE_PER_RUN
    out: dict[str, object] = {"expect": expect}
    try:
        with override_resolver(res, pretend_public=("127.0.0.1",)):
            policy_a = lowlevel.Policy(
                network=lowlevel.Egress(allow=("*.never.test", "b.test"), allow_ports=(443, origin.port)),
                binds=(lowlevel.Bind(signal, "/signal", writable=True),))
            box: dict[str, lowlevel.Result] = {}
            a = threading.Thread(target=lambda: box.update(a=lowlevel.run(
                ["python3", "-c", PROGRAM, str(FLOOD), str(expect), str(origin.port)], policy=policy_a,
                workspace=workspaces[0], timeout=120)))
            a.start()
            deadline = time.monotonic() + 100
            while not os.path.exists(os.path.join(signal, "ready")) and a.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            out["blocked_when_b_started"] = res.blocked
            policy_b = lowlevel.Policy(network=lowlevel.Egress(allow=("b.test",), allow_ports=(origin.port,)))
            b = lowlevel.run(["curl", "-sS", "--max-time", "60", f"http://b.test:{origin.port}/hello"],
                             policy=policy_b, workspace=workspaces[1], timeout=90)
            out["b_stdout"] = b.stdout.decode(errors="replace")
            out["b_network"] = [[x.host, x.allowed, x.reason] for x in b.network]
            res.release.set()
            a.join(150)
            ra = box.get("a")
            if ra is not None:
                out["a_stdout"] = ra.stdout.decode(errors="replace")
                out["a_stderr"] = ra.stderr.decode(errors="replace")[-2000:]
                out["a_network"] = [[x.host, x.allowed, x.reason] for x in ra.network]
    finally:
        res.release.set()
        origin.close()
        for d in (signal, *workspaces):
            shutil.rmtree(d, ignore_errors=True)
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
