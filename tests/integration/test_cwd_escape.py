"""Issue 22 item 1: a working directory that leads out of the sandbox (CVE-2024-21626 class).

bwrap 0.8.0 holds an ``O_PATH`` fd of the host's ``/proc`` (fd 3) while it runs ``--chdir``, so
``--chdir /proc/self/fd/3`` starts the program in the host's ``/proc`` (``..`` is the host's
``/``): runc's "leaky vessels" (``process.cwd=/proc/self/fd/N``). Two walls, each with its
attack and a control:

1. the request edge (:func:`lowlevel.spec.validate.sandbox_cwd`): no cwd under ``/proc``, ``/sys``
   or ``/dev`` (``/dev/shm`` excepted), no ``..``, through every source of a cwd (``run``,
   ``arun``, ``Session``, the CLI, MCP, a record, ``Policy.workdir``, an image's ``WorkingDir``);
2. the guard and the session init: bwrap only ever gets ``--chdir /``; the directory change
   happens inside, after bwrap closed its fds, and ``getcwd(2)`` must be inside the sandbox's
   root, which stops a cwd that passes the edge but resolves elsewhere (a symlink in the
   workspace pointing at an fd of a host directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lowlevel
from lowlevel.spec import validate

pytestmark = pytest.mark.bwrap

ESCAPES = ["/proc/self/fd/3", "/dev/fd/3", "/proc/1/cwd", "/proc/self/root/../..", "/sys/kernel",
           "/workspace/../proc/self/fd/3", "//proc/self/fd/3", "/./proc/self/fd/3", "/dev", "/proc"]
MINIMAL_BWRAP = ["--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                 "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--unshare-all",
                 "--die-with-parent"]


@pytest.fixture
def marker(tmp_path: Path) -> str:
    """A directory on the host's /tmp whose name the sandbox cannot know but by escaping."""
    d = Path("/tmp") / f"lowlevel-escape-marker-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d.name
    shutil.rmtree(d, ignore_errors=True)


# --- the control: bwrap itself follows a cwd through its own fd of the host's /proc ---------------

@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_control_raw_bwrap_chdir_through_its_proc_fd_reaches_the_host(marker: str, as_user: bool,
                                                                         test_user: object) -> None:
    """Without lowlevel: ``bwrap --chdir /proc/self/fd/3`` lists the host's /tmp (the attack works)."""
    cmd = ["bwrap", *MINIMAL_BWRAP, "--chdir", "/proc/self/fd/3", "--", "/usr/bin/sh", "-c", "ls ../tmp"]
    if as_user:
        cmd = ["runuser", "-u", "lowlevel-test", "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, timeout=30)
    assert marker.encode() in out.stdout, out


def test_bwrap_is_only_ever_given_chdir_slash() -> None:
    """The second wall's premise: the run's cwd never reaches bwrap's ``--chdir``."""
    r = lowlevel.run(["true"], cwd="/tmp", keep_workspace=False)
    argv = list(r.argv)
    chdirs = [argv[i + 1] for i, a in enumerate(argv) if a == "--chdir"]
    assert chdirs == ["/"], chdirs
    assert "--cwd=/tmp" in argv


# --- wall 1: the request edge, every source of a cwd ----------------------------------------------

@pytest.mark.parametrize("cwd", ESCAPES)
def test_validate_refuses_cwds_under_kernel_trees(cwd: str) -> None:
    with pytest.raises(lowlevel.PolicyError) as err:
        validate.sandbox_cwd(cwd)
    assert "CVE-2024-21626" in str(err.value) or "'..'" in str(err.value)


@pytest.mark.parametrize("cwd,norm", [("/workspace", "/workspace"), ("/workspace/./src//", "/workspace/src"),
                                      ("/dev/shm", "/dev/shm"), ("/dev/shm/x", "/dev/shm/x"), ("/tmp", "/tmp"),
                                      ("/", "/"), ("/procfs", "/procfs"), ("/devices", "/devices")])
def test_validate_keeps_sandbox_directories(cwd: str, norm: str) -> None:
    assert validate.sandbox_cwd(cwd) == norm


def test_every_entry_point_refuses_an_escaping_cwd(marker: str) -> None:
    """run, arun, Session.run, Policy.workdir, a record, MCP: each a PolicyError/RecordError."""
    from lowlevel import record
    from lowlevel.mcp_server import inputs as mcp_inputs
    from lowlevel.record import validation
    for cwd in ("/proc/self/fd/3", "/dev/fd/3", "/workspace/../proc/self/fd/3"):
        with pytest.raises(lowlevel.PolicyError):
            lowlevel.run(["ls", ".."], cwd=cwd, keep_workspace=False)
        with pytest.raises(lowlevel.PolicyError):
            asyncio.run(lowlevel.arun(["ls", ".."], cwd=cwd, keep_workspace=False))
        with pytest.raises(lowlevel.PolicyError):
            lowlevel.Policy(workdir=cwd)
        with pytest.raises(lowlevel.PolicyError):
            mcp_inputs.sandbox_cwd(cwd)
    with lowlevel.Session(lowlevel.Policy()) as s:
        with pytest.raises(lowlevel.PolicyError):
            s.run(["ls", ".."], cwd="/proc/self/fd/3")
        assert s.run(["pwd"], cwd="/tmp").stdout == b"/tmp\n"
    doc = {"cwd": "/proc/self/fd/3"}
    with pytest.raises(record.RecordError) as err:
        validation._checked(validate.sandbox_cwd, "cwd", doc["cwd"], "cwd")
    assert "cwd" in str(err.value)


def test_cli_refuses_an_escaping_cwd(marker: str, tmp_path: Path) -> None:
    """``lowlevel run --cwd /proc/self/fd/3``: exit 125, one line, and the host's /tmp never listed."""
    out = subprocess.run([sys.executable, "-m", "lowlevel", "run", "--rm", "--landlock", "off", "--cwd",
                          "/proc/self/fd/3", "--", "sh", "-c", "ls ../tmp"], capture_output=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 125
    assert marker.encode() not in out.stdout
    assert b"Traceback" not in out.stderr and b"CVE-2024-21626" in out.stderr, out.stderr


# --- wall 2: the guard and the init check where the cwd resolved -------------------------------

def _evil_workspace(sandbox: object, target: str) -> str:
    ws = sandbox.workspace()  # type: ignore[attr-defined]
    link = os.path.join(ws, "evil")
    os.symlink(target, link)
    if sandbox.user is not None:  # type: ignore[attr-defined]
        os.lchown(link, sandbox.user.pw_uid, sandbox.user.pw_gid)  # type: ignore[attr-defined]
    return str(ws)


@pytest.fixture
def host_secret_dir(tmp_path: Path) -> str:
    d = Path("/tmp") / f"lowlevel-escape-secret-{os.getpid()}-{tmp_path.name}"
    d.mkdir(mode=0o755)
    (d / "secret").write_text("host secret\n")
    os.chmod(d / "secret", 0o644)
    yield str(d)
    shutil.rmtree(d, ignore_errors=True)


def test_control_an_fd_of_a_host_directory_is_a_way_out(sandbox: object, host_secret_dir: str) -> None:
    """Control: a host directory's fd reaching the sandbox (a harness leak) can be entered by
    ``cd /proc/self/fd/N`` without Landlock: what the guard's getcwd check must stop as a cwd."""
    ws = sandbox.workspace()  # type: ignore[attr-defined]
    out = sandbox.run(["sh", "-c", "cd /proc/self/fd/20 && cat secret"], workspace=str(ws),  # type: ignore[attr-defined]
                      extra_dirs={20: host_secret_dir}, policy_kw={"landlock": False}, commit=False)
    assert out.exit_code == 0 and out.stdout == b"host secret\n", out


@pytest.mark.parametrize("landlock", [False, True], ids=["landlock-off", "landlock-on"])
def test_a_cwd_symlink_to_a_host_fd_is_refused_by_the_guard(sandbox: object, host_secret_dir: str,
                                                             landlock: bool) -> None:
    """Attack: ``cwd=/workspace/evil`` (passes the edge), ``evil -> /proc/self/fd/20``, fd 20 a
    host directory: the guard's getcwd check refuses before the program runs."""
    ws = _evil_workspace(sandbox, "/proc/self/fd/20")
    out = sandbox.run(["sh", "-c", "cat secret; echo RAN"], workspace=ws, cwd="/workspace/evil",  # type: ignore[attr-defined]
                      extra_dirs={20: host_secret_dir}, policy_kw={"landlock": landlock}, commit=False)
    assert out.error == "LaunchError", out
    assert "outside the sandbox" in out.message and "CVE-2024-21626" in out.message
    assert b"host secret" not in out.stdout and b"RAN" not in out.stdout


def test_a_cwd_symlink_to_proc_fd_3_is_refused(sandbox: object, marker: str) -> None:
    """Attack: ``evil -> /proc/self/fd/3`` in the workspace (what bwrap held): never the host's /proc."""
    ws = _evil_workspace(sandbox, "/proc/self/fd/3")
    out = sandbox.run(["sh", "-c", "ls ../tmp; echo RAN"], workspace=ws, cwd="/workspace/evil",  # type: ignore[attr-defined]
                      policy_kw={"landlock": False}, commit=False)
    assert out.error == "LaunchError", out
    assert marker.encode() not in out.stdout


def test_the_program_gets_its_cwd_and_pwd(sandbox: object) -> None:
    """The guard's chdir and PWD match what bwrap's --chdir used to give."""
    ws = sandbox.workspace()  # type: ignore[attr-defined]
    os.makedirs(os.path.join(ws, "sub"))
    if sandbox.user is not None:  # type: ignore[attr-defined]
        os.chown(os.path.join(ws, "sub"), sandbox.user.pw_uid, sandbox.user.pw_gid)  # type: ignore[attr-defined]
    for cwd in ("/workspace", "/workspace/sub", "/tmp", "/dev/shm", "/"):
        out = sandbox.run(["sh", "-c", 'pwd; echo "$PWD"'], workspace=str(ws), cwd=cwd)  # type: ignore[attr-defined]
        assert out.exit_code == 0 and out.out == f"{cwd}\n{cwd}\n", (cwd, out)
    out = sandbox.run(["true"], workspace=str(ws), cwd="/workspace/missing")  # type: ignore[attr-defined]
    assert out.error == "LaunchError" and "cannot change to the working directory" in out.message


def test_session_init_checks_its_commands_cwd(tmp_path: Path) -> None:
    """The session init changes directory per command with the same getcwd check."""
    ws = tmp_path / "ws"
    ws.mkdir()
    os.chmod(ws, 0o755)
    with lowlevel.Session(lowlevel.Policy(), workspace=str(ws)) as s:
        s.run(["ln", "-s", "/proc/self/fd/0", "/workspace/fd0"])
        with pytest.raises(lowlevel.LaunchError):
            s.run(["pwd"], cwd="/workspace/fd0")
        assert s.run(["sh", "-c", "pwd"], cwd="/workspace").stdout == b"/workspace\n"
    assert json.dumps(validate.CWD_FORBIDDEN)


# --- other paths bwrap resolves while it holds the host's fds: a tree's symlinks ----------------

@pytest.fixture
def tree_and_pit() -> object:
    """A busybox root tree and an empty world-writable host directory ("the pit") that a symlink
    of the tree names through bwrap's ``/oldroot`` (the host's ``/`` while bwrap sets up)."""
    import imagekit
    imagekit.need_tools()
    base = imagekit.public_tmpdir("treepit-")
    tree = imagekit.busybox_tree(base / "root")
    pit = base / "pit"
    pit.mkdir()
    pit.chmod(0o777)
    try:
        yield tree, pit
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_control_raw_bwrap_creates_mount_points_on_the_host_through_a_tree_symlink(tree_and_pit: object) -> None:
    """Control: bwrap's setup follows ``/data -> /oldroot<pit>`` and creates ``x`` on the host."""
    tree, pit = tree_and_pit  # type: ignore[misc]
    src = pit.parent / "src"
    src.mkdir()
    out = subprocess.run(["bwrap", "--ro-bind", str(tree / "bin"), "/bin", "--proc", "/proc", "--dev", "/dev",
                          "--unshare-all", "--symlink", f"/oldroot{pit}", "/data", "--ro-bind", str(src), "/data/x",
                          "--", "/bin/true"], capture_output=True, timeout=30)
    assert out.returncode == 0, out
    assert (pit / "x").is_dir()


def test_a_bind_through_a_tree_symlink_is_refused(tree_and_pit: object) -> None:
    """Attack: the tree's ``/data`` is a symlink to the host; ``Bind(dest="/data/x")`` is refused
    when the run is planned (the Policy itself reads no tree), and the host's directory stays empty."""
    tree, pit = tree_and_pit  # type: ignore[misc]
    os.symlink(f"/oldroot{pit}", tree / "data")
    src = pit.parent / "src"
    src.mkdir()
    from lowlevel.rootfs.resolve import resolve
    refused = lowlevel.Policy(rootfs=str(tree), binds=(lowlevel.Bind(str(src), "/data/x"),))
    with pytest.raises(lowlevel.PolicyError, match="symlink /data of Policy.rootfs"):
        lowlevel.run(["/bin/true"], policy=refused, keep_workspace=False)
    ok = lowlevel.Policy(rootfs=str(tree), binds=(lowlevel.Bind(str(src), "/app/x"),))  # a real directory
    assert ok.binds[0].dest == "/app/x"
    assert resolve(ok).binds == ok.binds  # planned without a refusal
    assert list(pit.iterdir()) == []


def test_lowlevels_own_setup_paths_through_a_tree_symlink_are_refused(tree_and_pit: object) -> None:
    """Attack: the tree's ``/run`` is a symlink to the host, and egress mode mounts the proxy's
    socket at /run/lowlevel/egress.sock: the run is refused before bwrap starts, the host's
    directory stays empty. (The tree's /etc a symlink: /etc/passwd, likewise.)"""
    tree, pit = tree_and_pit  # type: ignore[misc]
    os.symlink(f"/oldroot{pit}", tree / "run")
    policy = lowlevel.Policy(rootfs=str(tree), network=lowlevel.Egress(allow=("example.org",)))
    with pytest.raises(lowlevel.PolicyError, match=r"/run/lowlevel.*through the symlink /run"):
        lowlevel.run(["/bin/true"], policy=policy, keep_workspace=False)
    assert list(pit.iterdir()) == []
    os.unlink(tree / "run")
    assert lowlevel.run(["/bin/true"], policy=policy, keep_workspace=False).exit_code == 0  # control


@pytest.mark.parametrize("dest", ["//usr", "//etc", "//tmp", "//proc/x", "//dev/shm", "///usr", "//workspace/x",
                                  "//", "/"])
def test_reserved_bind_dests_refused_however_spelled(tmp_path: Path, dest: str) -> None:
    """'//usr' is '/usr' to Linux and bwrap (POSIX leaves two leading slashes to the
    implementation; os.path.normpath keeps them): the reserved dests are refused in every spelling."""
    with pytest.raises(lowlevel.PolicyError, match="reserved by the base layout|inside /workspace"):
        lowlevel.Bind(str(tmp_path), dest)


def test_double_slash_bind_dest_cannot_write_the_host(tmp_path: Path) -> None:
    """The attack end to end through the CLI: an outer bind whose directory holds a symlink to a
    host directory, and an inner bind spelled '//opt/a/sub/...' under it. Refused before bwrap
    runs; nothing appears on the host. (The raw-bwrap control is test_nested_bind_dests_are_refused.)"""
    base = Path("/tmp") / f"lowlevel-dslash-{os.getpid()}-{tmp_path.name}"
    outer, victim = base / "outer", base / "victim"
    for d in (outer, victim):
        d.mkdir(parents=True)
    victim.chmod(0o777)
    afile = base / "afile"
    afile.write_text("x")
    (outer / "sub").symlink_to(f"/oldroot{victim}")
    try:
        cli = [sys.executable, "-m", "lowlevel", "run", "--rm", "--ro", f"{outer}:/opt/a",
               "--ro", f"{afile}://opt/a/sub/made-by-bwrap", "--", "true"]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert out.returncode == 125 and "inside another bind's dest" in out.stderr, out
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert list(victim.iterdir()) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_nested_bind_dests_are_refused(tmp_path: Path) -> None:
    """A bind's dest inside another bind's dest is set up through the outer bind's host
    directory, where a symlink (left there by an earlier sandbox, if it was writable) reaches
    the host's tree while bwrap sets up. Control: raw bwrap creates ``x`` on the host that way;
    the Policy refuses the pair."""
    base = Path("/tmp") / f"lowlevel-nested-{os.getpid()}-{tmp_path.name}"
    outer, inner, pit = base / "outer", base / "inner", base / "pit"
    for d in (outer, inner, pit):
        d.mkdir(parents=True)
    pit.chmod(0o777)
    (outer / "sub").symlink_to(f"/oldroot{pit}")
    try:
        out = subprocess.run(["bwrap", *MINIMAL_BWRAP, "--bind", str(outer), "/opt/a", "--ro-bind", str(inner),
                              "/opt/a/sub/x", "--", "/usr/bin/true"], capture_output=True, timeout=30)
        assert out.returncode == 0 and (pit / "x").is_dir(), out  # control: the host got a directory
        (pit / "x").rmdir()
        out = subprocess.run(["bwrap", *MINIMAL_BWRAP, "--bind", str(outer), "/opt/a", "--ro-bind", str(inner),
                              "//opt/a/sub/y", "--", "/usr/bin/true"], capture_output=True, timeout=30)
        assert out.returncode == 0 and (pit / "y").is_dir(), out  # control: bwrap reads '//opt' as '/opt'
        (pit / "y").rmdir()
        with pytest.raises(lowlevel.PolicyError, match="inside another bind's dest"):
            lowlevel.Policy(binds=(lowlevel.Bind(str(outer), "/opt/a", writable=True),
                                   lowlevel.Bind(str(inner), "/opt/a/sub/x")))
        # The same pair spelled with a leading '//' (POSIX keeps two leading slashes through
        # os.path.normpath; Linux and bwrap read '//opt' as '/opt'): it passed every dest check
        # until validate.normalize_abs, and bwrap made the directory on the host.
        for outer_dest, inner_dest in (("/opt/a", "//opt/a/sub/x"), ("//opt/a", "/opt/a/sub/x"),
                                       ("//opt/a", "//opt//a/./sub/x")):
            with pytest.raises(lowlevel.PolicyError, match="inside another bind's dest"):
                lowlevel.Policy(binds=(lowlevel.Bind(str(outer), outer_dest, writable=True),
                                       lowlevel.Bind(str(inner), inner_dest)))
        with pytest.raises(lowlevel.PolicyError, match="inside another bind's dest"):  # the CLI's spelling
            lowlevel.Policy(binds=(lowlevel.Bind(str(outer), "/opt/a"), lowlevel.Bind(str(inner), "//opt/a/sub/x")))
        ok = lowlevel.Policy(binds=(lowlevel.Bind(str(outer), "/opt/a"), lowlevel.Bind(str(inner), "/opt/ab")))
        assert [b.dest for b in ok.binds] == ["/opt/a", "/opt/ab"]
        assert list(pit.iterdir()) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)
