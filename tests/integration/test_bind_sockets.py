"""A unix socket inside a bound directory is not a way out (issue 22, item 2).

``Bind`` refuses a socket as the source, but a bound directory may hold one (``/srv/app`` with
``run/app.sock``: a D-Bus, Podman, Docker or Ray socket is code execution on the host), and
Landlock below ABI 9 does not restrict connecting to pathname sockets. The plan masks each
socket found in a directory bind (lowlevel.sandbox.bind_sockets); ``Bind(allow_sockets=True)`` keeps
them. A real AF_UNIX listener on the host, in a directory under /tmp that both identities
reach; the attack connects from inside, read-only and writable binds, as root and as the
unprivileged user; the control is the same connect with ``allow_sockets``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lowlevel
from lowlevel.sandbox import bind_sockets
from lowlevel.host import landlock
from lowlevel.sandbox import landlock_rules

from helpers.servers import AnsweringServer, listener_when, unix_at

RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"

CONNECT = ("import socket, sys\n"
           "s = socket.socket(socket.AF_UNIX)\n"
           "try:\n"
           "    s.connect(sys.argv[1])\n"
           "except OSError as e:\n"
           "    print('refused', e.errno); sys.exit(3)\n"
           "print('connected', s.recv(16).decode())\n")


@pytest.fixture
def app_dir() -> Iterator[tuple[Path, AnsweringServer]]:
    """``/tmp/bind-sockets-*/run/app.sock`` with a live listener; the directories 0777 (a
    writable bind's runs and the test may add files), reachable by every identity."""
    d = Path(tempfile.mkdtemp(prefix="bind-sockets-", dir="/tmp"))
    (d / "run").mkdir()
    for p in (d, d / "run"):
        os.chmod(p, 0o777)
    listener = unix_at(d / "run" / "app.sock")
    yield d, listener
    listener.close()
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("writable", [False, True], ids=["ro", "rw"])
def test_a_socket_in_a_bound_directory_is_masked(sandbox: Any, app_dir: tuple[Path, AnsweringServer], writable: bool) -> None:
    d, listener = app_dir
    r = sandbox.run(["python3", "-c", CONNECT, "/data/run/app.sock"], binds=[(str(d), "/data", writable)],
                    policy_kw={"landlock": "require"}, timeout=60)
    assert r.exit_code == 3 and r.out.startswith("refused"), (r.out, r.err, r.message)
    assert listener.accepted == 0
    assert any("masked 1 unix socket" in n and "/data/run/app.sock" in n for n in r.notes), r.notes


@pytest.mark.parametrize("writable", [False, True], ids=["ro", "rw"])
def test_control_allow_sockets_keeps_it(sandbox: Any, app_dir: tuple[Path, AnsweringServer], writable: bool) -> None:
    d, listener = app_dir
    r = sandbox.run(["python3", "-c", CONNECT, "/data/run/app.sock"], binds=[(str(d), "/data", writable, True)],
                    policy_kw={"landlock": "require"}, timeout=60)
    assert r.exit_code == 0 and r.out == "connected hello\n", (r.out, r.err, r.message)
    assert listener.accepted == 1
    assert any("stay reachable (allow_sockets=True)" in n for n in r.notes), r.notes


def test_a_masked_socket_cannot_be_removed_or_renamed(sandbox: Any, app_dir: tuple[Path, AnsweringServer]) -> None:
    """The mask is a mount point: in a writable bind the sandbox can neither unlink nor rename
    it to reach the socket under it (EBUSY)."""
    d, _listener = app_dir
    script = ("import os, errno\n"
              "for f in (lambda: os.unlink('/data/run/app.sock'),"
              " lambda: os.rename('/data/run/app.sock', '/data/run/x.sock')):\n"
              "    try:\n        f(); print('done')\n"
              "    except OSError as e:\n        print(errno.errorcode[e.errno])\n")
    r = sandbox.run(["python3", "-c", script], binds=[(str(d), "/data", True)], timeout=60)
    assert r.exit_code == 0 and r.out.split() == ["EBUSY", "EBUSY"], (r.out, r.err)
    assert (d / "run" / "app.sock").is_socket()


LATE = ("import os, socket, sys, time\n"
        "open('/data/started', 'w').close()\n"
        "for _ in range(600):\n"
        "    if os.path.exists('/data/late.sock'):\n        break\n"
        "    time.sleep(0.05)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect('/data/late.sock')\n"
        "except OSError as e:\n    print('refused', e.errno); sys.exit(3)\n"
        "print('connected', s.recv(16).decode())\n")


@pytest.mark.skipif(landlock.kernel_abi() >= bind_sockets.RESOLVE_UNIX_ABI,
                    reason="Landlock ABI >= 9 refuses the late socket: test_late_socket_refused_by_landlock")
def test_a_socket_created_after_the_run_started_is_not_covered_and_the_note_says_so(sandbox: Any, app_dir: tuple[Path, AnsweringServer]) -> None:
    """The documented limitation: the scan is at plan time. A socket the host makes in the bind
    once the run has started is reachable (Landlock ABI < 9), and Result.notes says so."""
    d, _listener = app_dir
    with listener_when(d / "started", d / "late.sock"):
        r = sandbox.run(["python3", "-c", LATE], binds=[(str(d), "/data", True)], timeout=90)
    assert r.exit_code == 0 and r.out == "connected hello\n", (r.out, r.err, r.message)
    assert any("created in a bound directory after the scan" in n and "is not masked" in n
               and f"Landlock ABI {landlock.kernel_abi()} cannot refuse" in n for n in r.notes), r.notes


@pytest.mark.skipif(landlock.kernel_abi() < bind_sockets.RESOLVE_UNIX_ABI,
                    reason="needs Landlock ABI 9 (LANDLOCK_ACCESS_FS_RESOLVE_UNIX, Linux 7.1)")
def test_late_socket_refused_by_landlock(sandbox: Any, app_dir: tuple[Path, AnsweringServer]) -> None:
    d, _listener = app_dir
    with listener_when(d / "started", d / "late.sock"):
        r = sandbox.run(["python3", "-c", LATE], binds=[(str(d), "/data", True)], timeout=90,
                        policy_kw={"landlock": "require"})
    assert r.exit_code == 3 and r.out.startswith("refused 13"), (r.out, r.err)  # EACCES


def test_scan_does_not_follow_symlinks_and_says_where_it_stopped(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    s1 = socket.socket(socket.AF_UNIX)
    s1.bind(str(outside / "host.sock"))
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "link-dir").symlink_to(outside)
    (tree / "link.sock").symlink_to(outside / "host.sock")
    s2 = socket.socket(socket.AF_UNIX)
    s2.bind(str(tree / "a" / "b" / "deep.sock"))
    try:
        got = bind_sockets.scan(str(tree), "/data")
        assert got.sockets == ("/data/a/b/deep.sock",) and got.incomplete == ""
        # Bounds: past them the walk stops and says so (and what it found before is kept).
        assert "stopped after 1 entries" in bind_sockets.scan(str(tree), "/data", max_entries=1).incomplete
        assert "directory levels" in bind_sockets.scan(str(tree), "/data", max_depth=1).incomplete
        # A root caller's per-run uid (nobody's) cannot search a 0700 directory: nothing to mask there.
        os.chmod(tree / "a", 0o700)
        assert bind_sockets.scan(str(tree), "/data", ids=(-1, -1)).sockets == ()
    finally:
        os.chmod(tree / "a", 0o755)
        s1.close()
        s2.close()


def test_an_incomplete_scan_is_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(5):
        (tmp_path / f"f{i}").touch()
    monkeypatch.setattr(bind_sockets, "MAX_ENTRIES", 2)
    policy = lowlevel.Policy(binds=(lowlevel.Bind(str(tmp_path), "/data"),))
    notes = bind_sockets.notes(policy, os.geteuid() == 0, 7)
    assert any("socket scan of /data is incomplete (stopped after 2 entries)" in n and "can connect" in n
               for n in notes), notes


def test_landlock_rules_grant_socket_connect_only_where_allowed(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    policy = lowlevel.Policy(binds=(lowlevel.Bind(str(tmp_path / "a"), "/a", writable=True),
                                    lowlevel.Bind(str(tmp_path / "b"), "/b", allow_sockets=True)))
    args = landlock_rules.ruleset_args(policy, ())
    unix = [a for a in args if a.startswith("--ll-unix=")]
    assert unix == ["--ll-unix=/tmp", "--ll-unix=/dev/shm", "--ll-unix=/workspace", "--ll-unix=/b"]
    assert args.index("--ll-unix=/b") == args.index("--ll-rx=/b") + 1
    # A socket bound itself on purpose (allow_sensitive) stays reachable at ABI >= 9 too.
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(tmp_path / "daemon.sock"))
    try:
        sock_bind = lowlevel.Policy(binds=(lowlevel.Bind(str(tmp_path / "daemon.sock"), "/run-d/daemon.sock",
                                                         allow_sensitive=True),))
        assert "--ll-unix=/run-d/daemon.sock" in landlock_rules.ruleset_args(sock_bind, ())
    finally:
        srv.close()
    assert "pathname unix socket" in landlock.describe(9) and "masked" in landlock.describe(7)


def test_allow_sockets_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(lowlevel.PolicyError, match="allow_sockets must be a bool"):
        lowlevel.Bind(str(tmp_path), "/data", allow_sockets="yes")  # type: ignore[arg-type]


def test_allow_sockets_round_trips_through_records_and_old_hashes_hold(tmp_path: Path) -> None:
    from lowlevel.record import canonical_policy, policy_from_canonical, policy_loosening
    plain = lowlevel.Policy(binds=(lowlevel.Bind(str(tmp_path), "/data"),))
    kept = lowlevel.Policy(binds=(lowlevel.Bind(str(tmp_path), "/data", allow_sockets=True),))
    assert "allow_sockets" not in canonical_policy(plain)["binds"][0]  # as records before the field
    assert canonical_policy(kept)["binds"][0]["allow_sockets"] is True
    assert policy_from_canonical(canonical_policy(kept)) == kept != plain
    assert any("allow_sockets" in line for line in policy_loosening(kept))


_TWO_RUNS = textwrap.dedent("""
    import sys
    import lowlevel
    from lowlevel.sandbox import bind_sockets
    if sys.argv[2] == "control":
        bind_sockets.revalidate = lambda policy, caller_is_root: False  # the cached plan, unchecked
    policy = lowlevel.Policy(binds=(lowlevel.Bind(sys.argv[1], "/data", writable=True),))
    first = lowlevel.run(["mv", "/data/run", "/data/moved"], policy=policy, timeout=60)
    assert first.exit_code == 0, first.stderr
    second = lowlevel.run(["python3", "-c", sys.argv[3], "/data/moved/app.sock"], policy=policy, timeout=60)
    sys.stdout.write(second.stdout.decode())
""")


@pytest.mark.parametrize("mode", ["attack", "control"])
def test_a_run_that_moves_a_masked_socket_does_not_unmask_it_for_the_next(sandbox: Any, app_dir: tuple[Path, AnsweringServer],
                                                                          mode: str) -> None:
    """One Policy, two runs in one caller process (the plan is cached per Policy): the first
    renames the directory holding the masked socket in its writable bind (the mask moves with it
    inside that run, the socket moves on the host); the second must still find it masked, since
    the plan is checked before each run and walked again (control: without that check, the
    second run connects)."""
    d, listener = app_dir
    cmd = [sys.executable, "-c", _TWO_RUNS, str(d), mode, CONNECT]
    if sandbox.user is not None:
        cmd = [RUNUSER, "-u", sandbox.user.pw_name, "--", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(lowlevel.__file__).parents[1]),
                               "LANG": "C.UTF-8", "HOME": sandbox.home})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (d / "moved" / "app.sock").is_socket()
    if mode == "attack":
        assert proc.stdout.startswith("refused") and listener.accepted == 0, proc.stdout
    else:
        assert proc.stdout == "connected hello\n" and listener.accepted == 1, proc.stdout


SELF_SERVE = ("import os, socket\n"
              "srv = socket.socket(socket.AF_UNIX); srv.bind('/workspace/own.sock'); srv.listen(1)\n"
              "c = socket.socket(socket.AF_UNIX); c.connect('/workspace/own.sock')\n"
              "conn, _ = srv.accept(); conn.sendall(b'own'); print('connected', c.recv(8).decode())\n"
              "os.unlink('/workspace/own.sock')\n")


@pytest.fixture
def handed_over_workspace(sandbox: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, AnsweringServer]]:
    """The fallback workspace model (no overlay: the directory is bound as it is), holding a host
    daemon's live socket. (Runs there commit: a discard is refused in that model.)"""
    monkeypatch.setenv("LOWLEVEL_NO_OVERLAY", "1")
    ws = sandbox.workspace()
    listener = unix_at(ws / "app.sock")
    yield ws, listener
    listener.close()
    shutil.rmtree(ws, ignore_errors=True)


def test_a_socket_in_a_handed_over_workspace_is_masked(sandbox: Any,
                                                       handed_over_workspace: tuple[Path, AnsweringServer]) -> None:
    ws, listener = handed_over_workspace
    r = sandbox.run(["python3", "-c", CONNECT, "/workspace/app.sock"], workspace=str(ws), commit=True,
                    policy_kw={"landlock": "require"}, timeout=60)
    assert r.exit_code == 3 and r.out.startswith("refused"), (r.out, r.err, r.message)
    assert listener.accepted == 0
    assert any("workspace: masked 1 unix socket" in n and "/workspace/app.sock" in n for n in r.notes), r.notes
    # Control: a socket the sandbox makes itself in the same workspace still works.
    r = sandbox.run(["python3", "-c", SELF_SERVE], workspace=str(ws), commit=True, timeout=60)
    assert r.exit_code == 0 and r.out == "connected own\n", (r.out, r.err, r.message)


@pytest.mark.skipif(os.geteuid() != 0, reason="stubs the masks in-process")
def test_control_the_handed_over_socket_is_reachable_without_the_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control (root, in-process: the masks stubbed out): the attack above is real."""
    monkeypatch.setenv("LOWLEVEL_NO_OVERLAY", "1")
    import lowlevel.sandbox.bind_sockets
    monkeypatch.setattr(lowlevel.sandbox.bind_sockets, "workspace_masks", lambda workspace, snap: [])
    ws = Path(tempfile.mkdtemp(prefix="ws-control-", dir="/tmp"))
    os.chmod(ws, 0o755)
    listener = unix_at(ws / "app.sock")
    try:
        r = lowlevel.run(["python3", "-c", CONNECT, "/workspace/app.sock"], workspace=str(ws), commit=True,
                         timeout=60)
    finally:
        listener.close()
        shutil.rmtree(ws, ignore_errors=True)
    assert r.exit_code == 0 and r.stdout == b"connected hello\n", r
    assert listener.accepted == 1


def test_through_the_overlay_a_workspace_socket_is_unreachable(sandbox: Any, app_dir: tuple[Path, AnsweringServer]) -> None:
    """The default (copy-on-write) workspace needs no mask: connect through overlayfs finds the
    overlay's inode, which no socket is bound to."""
    _d, _listener = app_dir
    ws = sandbox.workspace()
    listener = unix_at(ws / "app.sock")
    try:
        r = sandbox.run(["python3", "-c", CONNECT, "/workspace/app.sock"], workspace=str(ws), commit=False,
                        timeout=60)
    finally:
        listener.close()
        shutil.rmtree(ws, ignore_errors=True)
    if any("handed over" in n for n in r.notes):
        pytest.skip("no copy-on-write overlay here")
    assert r.exit_code == 3 and r.out.startswith("refused 111"), (r.out, r.err, r.message)
    assert listener.accepted == 0


def test_a_socket_inside_a_read_only_rootfs_tree_is_masked() -> None:
    """Red-team pass: a read-only ``Policy(rootfs=DIR)`` is bound by path, so a live service's
    socket in the tree (a chroot's D-Bus) was reachable. Now masked like a bind's: inside, the
    path is the /dev/null mask (a character device), not the socket, and the note lists it.
    Control: raw bwrap binding the same tree shows the live socket."""
    import imagekit
    imagekit.need_tools()
    base = imagekit.public_tmpdir("socktree-")
    tree = imagekit.busybox_tree(base / "root")
    (tree / "run2").mkdir()
    listener = unix_at(tree / "run2" / "host.sock")
    try:
        r = lowlevel.run(["/bin/sh", "-c", "test -S /run2/host.sock && echo SOCKET; test -c /run2/host.sock && echo MASK"],
                         policy=lowlevel.Policy(rootfs=str(tree)), keep_workspace=False)
        assert r.stdout == b"MASK\n", r
        assert any("rootfs: masked 1 unix socket" in n and "/run2/host.sock" in n for n in r.notes), r.notes
        ctl = subprocess.run(["bwrap", "--ro-bind", str(tree / "bin"), "/bin", "--ro-bind", str(tree / "run2"), "/run2",
                              "--", "/bin/sh", "-c", "test -S /run2/host.sock && echo SOCKET"], capture_output=True,
                             timeout=30)
        assert ctl.stdout == b"SOCKET\n", ctl
    finally:
        listener.close()
        shutil.rmtree(base, ignore_errors=True)
