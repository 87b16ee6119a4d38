"""Host /etc files reach the sandbox as copies in its read-only root tmpfs, not as bind mounts.

lowlevel.sandbox.argv.etc_plan: small regular files (``/etc/ld.so.cache``, ``nsswitch.conf``...) are
written by bwrap into the sandbox's root tmpfs (``--file``) from an fd the launcher opens per
run, ``/etc/localtime`` (a symlink into /usr) is the same symlink, directories stay read-only
binds. What must hold: the same bytes as the host's, not writable (the root is remounted
read-only), and no host mount for them in the sandbox's mount table.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

import lowlevel
from lowlevel.sandbox import argv as _argv
from lowlevel.errors import LaunchError, PolicyError
from lowlevel.sandbox.facts import host_facts
from lowlevel.sandbox.launcher import Run
from lowlevel.sandbox.plan import open_etc_copy as _open_etc_copy
from lowlevel.sandbox.request import RunRequest

pytestmark = pytest.mark.bwrap


def _copied() -> tuple[str, ...]:
    return _argv.etc_copies(lowlevel.Policy(), host_facts())


def test_copied_etc_files_match_the_host_are_read_only_and_not_mounts(sandbox) -> None:
    copied = _copied()
    if not copied:
        pytest.skip("this bwrap has no --perms/--file, or the host has none of the /etc files")
    script = "; ".join(
        [f"sha256sum {p}" for p in copied]
        + ["cat /proc/self/mountinfo > /workspace/mountinfo"]
        # The attack: rewrite the dynamic loader's cache (what every later exec would read).
        + [f"(echo evil > {copied[0]}) 2>/workspace/write_err; echo write_status=$?"]
        # The control: the same shell redirection works where the sandbox may write.
        + ["(echo fine > /workspace/probe) && echo control_ok"])
    out = sandbox.run(["/bin/sh", "-c", script])
    assert out.exit_code == 0, out.stderr
    text = out.stdout.decode()
    for path in copied:
        with open(path, "rb") as f:
            want = hashlib.sha256(f.read()).hexdigest()
        assert f"{want}  {path}" in text, (path, text)
    assert "write_status=0" not in text and "write_status=" in text, text
    assert "control_ok" in text, text
    ws = out.workspace
    with open(os.path.join(ws, "write_err"), encoding="utf-8") as f:
        assert "Read-only file system" in f.read()
    with open(os.path.join(ws, "mountinfo"), encoding="utf-8") as f:
        mount_points = {line.split()[4] for line in f}
    assert not mount_points & set(copied), mount_points & set(copied)
    # Directories are still binds (/etc/alternatives, when the host has it).
    binds = [p for kind, p, _a in _argv.etc_plan(host_facts().layout.etc_files) if kind == "bind"]
    assert set(binds) <= mount_points


def test_localtime_is_the_same_zone_inside() -> None:
    if not os.path.lexists("/etc/localtime"):
        pytest.skip("no /etc/localtime on this host")
    with open("/etc/localtime", "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    r = lowlevel.run(["sha256sum", "/etc/localtime"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split()[0] == want


def test_etc_plan_kinds(tmp_path) -> None:
    small = tmp_path / "small.conf"
    small.write_bytes(b"x" * 100)
    big = tmp_path / "big.cache"
    big.write_bytes(b"\0" * (_argv.ETC_COPY_MAX_BYTES + 1))
    into_usr = tmp_path / "localtime"
    into_usr.symlink_to("/usr/bin/env")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.symlink_to(str(small))
    directory = tmp_path / "conf.d"
    directory.mkdir()
    missing = tmp_path / "missing"
    paths = tuple(str(p) for p in (small, big, into_usr, elsewhere, directory, missing))
    plan = _argv.etc_plan(paths)
    assert [kind for kind, _p, _a in plan] == ["file", "bind", "symlink", "bind", "bind", "bind"]
    assert plan[2] == ("symlink", str(into_usr), "/usr/bin/env")


def test_a_copied_file_replaced_by_a_symlink_is_refused_not_followed(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("not for the sandbox")
    link = tmp_path / "ld.so.cache"
    link.symlink_to(str(secret))
    with pytest.raises(LaunchError, match="cannot open the host's .*ld.so.cache"):
        _open_etc_copy(str(link))
    # Control: the regular file itself opens.
    os.close(_open_etc_copy(str(secret)))


def test_extra_fds_cannot_take_the_etc_copies_numbers() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(PolicyError, match="reserved"):
            Run(RunRequest(["/usr/bin/true"]), policy=lowlevel.Policy(), extra_fds={_argv.ETC_COPY_FD: r})
        Run(RunRequest(["/usr/bin/true"]), policy=lowlevel.Policy(), extra_fds={_argv.ETC_COPY_FD - 1: r}).close()  # control: a free number
    finally:
        os.close(r)
        os.close(w)


# What the caller's bwrap would not show the sandbox through a bind, a copy must not show either.
# The etc entries below are temp files under /var/tmp (inside the sandbox /tmp is a tmpfs mounted
# over them); this host's /etc is never touched: the child process replaces its own host facts.
_LAYOUT_CHILD = r"""
import dataclasses, json, sys
import lowlevel
from lowlevel.sandbox import facts as sandbox_facts
from lowlevel.sandbox import launcher
extra = tuple(sys.argv[1:])
facts = sandbox_facts.host_facts()
fake = dataclasses.replace(facts, layout=dataclasses.replace(facts.layout,
                                                             etc_files=facts.layout.etc_files + extra))
launcher.host_facts = lambda bwrap=None: fake  # the name Run looks up
# Landlock off: the wall under test is the file's mode (Landlock would refuse /var/tmp anyway).
try:
    r = lowlevel.run(["/bin/sh", "-c", "for f in \"$@\"; do cat \"$f\" || echo unreadable; done", "sh", *extra],
                     policy=lowlevel.Policy(landlock=False))
    print(json.dumps({"exit": r.exit_code, "out": r.stdout.decode(), "err": r.stderr.decode()}))
except lowlevel.LowlevelError as err:
    print(json.dumps({"error": f"{type(err).__name__}: {err}"}))
"""


def _identities() -> list[str]:
    return ["root", "user"] if os.geteuid() == 0 else ["self"]


@pytest.mark.parametrize("identity", _identities())
def test_a_host_file_others_cannot_read_stays_unreadable_inside(request: pytest.FixtureRequest, identity: str) -> None:
    argv = [sys.executable, "-c", _LAYOUT_CHILD]
    if identity == "user":
        user = request.getfixturevalue("test_user")
        argv = [shutil.which("runuser") or "/usr/sbin/runuser", "-u", user.pw_name, "--", *argv]
    d = tempfile.mkdtemp(prefix="lowlevel-etc-mode-", dir="/var/tmp")
    try:
        os.chmod(d, 0o755)
        secret, public = os.path.join(d, "secret.conf"), os.path.join(d, "public.conf")
        for path, text, mode in ((secret, "not for the sandbox\n", 0o600), (public, "for everyone\n", 0o644)):
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(path, mode)
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.path.dirname(os.path.dirname(lowlevel.__file__))}
        proc = subprocess.run([*argv, secret, public], capture_output=True, text=True, timeout=120, env=env, cwd="/")
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout.splitlines()[-1])
        # The run happens (an unprivileged caller cannot open the file: no copy to fail on) ...
        assert "error" not in got, got
        assert got["exit"] == 0, got
        # ... the attack (reading the 0600 host file) fails, the control (the 0644 one) works.
        assert "not for the sandbox" not in got["out"], got
        assert got["out"] == "unreadable\nfor everyone\n", got
        # How: what others cannot read stays a bind (a copy would be 0644 inside).
        plan = {p: kind for kind, p, _a in _argv.etc_plan((secret, public))}
        assert plan == {secret: "bind", public: "file"}, plan
    finally:
        shutil.rmtree(d)


def test_open_etc_copy_refuses_what_the_plan_would_not_copy(tmp_path: pathlib.Path) -> None:
    fifo = tmp_path / "fifo.conf"
    os.mkfifo(fifo)
    directory = tmp_path / "dir.conf"
    directory.mkdir()
    big = tmp_path / "big.conf"
    big.write_bytes(b"\0" * (_argv.ETC_COPY_MAX_BYTES + 1))
    private = tmp_path / "private.conf"
    private.write_text("root only")
    private.chmod(0o600)
    # The attacks: files a cached plan saw as small, readable, regular, that are no more.
    for path, why in ((fifo, "not a regular file"), (directory, "not a regular file"),
                      (big, "larger than"), (private, "not readable by every user")):
        with pytest.raises(LaunchError, match=f"refusing to copy .*{path.name}.*{why}"):
            _open_etc_copy(str(path))
    # Control: a small file every user may read opens.
    ok = tmp_path / "ok.conf"
    ok.write_text("fine")
    ok.chmod(0o644)
    os.close(_open_etc_copy(str(ok)))


def test_a_symlink_through_a_host_path_stays_a_bind(tmp_path: pathlib.Path) -> None:
    # /etc/localtime -> zoneinfo/UTC with a host /etc/zoneinfo -> /usr/share/zoneinfo: resolves into
    # /usr on the host, but inside the sandbox there is no zoneinfo next to it: the same symlink
    # would dangle. Here with /usr/bin/env in place of the zone file.
    (tmp_path / "bin").symlink_to("/usr/bin")
    through = tmp_path / "through"
    through.symlink_to("bin/env")
    # Controls: absolute, and relative climbing out of the link's directory (systemd's form).
    absolute = tmp_path / "absolute"
    absolute.symlink_to("/usr/bin/env")
    climbing = tmp_path / "climbing"
    climbing.symlink_to("../" * len(tmp_path.parts) + "usr/bin/env")
    late_dots = tmp_path / "late_dots"
    late_dots.symlink_to("/usr/bin/../bin/env")
    plan = _argv.etc_plan(tuple(str(p) for p in (through, absolute, climbing, late_dots)))
    assert [kind for kind, _p, _a in plan] == ["bind", "symlink", "symlink", "bind"], plan
    assert plan[2][2] == os.readlink(climbing)  # the link's own text (a zone name stays readable)
