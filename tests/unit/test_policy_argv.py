"""Policy validation and the pure argv builder (no processes)."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

import lowlevel
from lowlevel.sandbox.argv import AnchorOverlay, Fds, HostFacts, anchor_argv, build_argv, static_args
from lowlevel.cli.args import parse_size
from lowlevel.spec.policy import Bind, Policy, sensitive_reason
from lowlevel.host.probe import BwrapInfo, HostLayout

INFO = BwrapInfo(path="/usr/bin/bwrap", version=(0, 8, 0), setuid=False,
                 options=frozenset({"--disable-userns", "--size", "--json-status-fd", "--block-fd", "--args"}))
MERGED = HostLayout(symlinks=(("usr/bin", "/bin"), ("usr/lib", "/lib"), ("usr/lib64", "/lib64"),
                              ("usr/sbin", "/sbin")), ro_dirs=(), etc_files=("/etc/ld.so.cache",))
FACTS = HostFacts(bwrap=INFO, layout=MERGED, caller_is_root=False,
                  network_etc=(("/run/systemd/resolve/stub-resolv.conf", "/etc/resolv.conf"),))


def test_golden_default_argv():
    argv = build_argv(Policy(limits=lowlevel.Limits(tmp_size_bytes=1024 * 1024)), FACTS, workspace="/srv/ws",
                      fds=Fds())
    assert argv == [
        "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--cap-drop", "ALL", "--clearenv",
        "--setenv", "HOME", "/workspace", "--setenv", "LANG", "C.UTF-8",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--setenv", "TMPDIR", "/tmp", "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
        "--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache",
        "--proc", "/proc", "--dev", "/dev", "--size", "1048576", "--tmpfs", "/tmp",
        "--size", "1048576", "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
        "--bind", "/srv/ws", "/workspace", "--ro-bind-data", "7", "/etc/passwd", "--ro-bind-data", "8", "/etc/group",
        "--remount-ro", "/", "--chdir", "/", "--json-status-fd", "4", "--seccomp", "6",
    ]


def test_passwd_and_group_are_files_of_the_read_only_root_where_bwrap_can():
    """bwrap >= 0.5 (--perms, --file): the synthesized files are written into the root tmpfs,
    which the final --remount-ro / makes read-only (no bind mount each: ~0.3 ms per sandbox)."""
    facts = HostFacts(bwrap=BwrapInfo("/usr/bin/bwrap", (0, 8, 0), False, INFO.options | {"--perms", "--file"}),
                      layout=MERGED, caller_is_root=False)
    argv = build_argv(Policy(), facts, workspace="/srv/ws", fds=Fds())
    i = argv.index("/srv/ws") + 1
    assert argv[i + 1:i + 11] == ["--perms", "0644", "--file", "7", "/etc/passwd",
                                  "--perms", "0644", "--file", "8", "/etc/group"]
    assert argv[i + 11:i + 13] == ["--remount-ro", "/"]
    assert "--ro-bind-data" not in argv


def test_exactly_one_writable_bind_by_default():
    argv = build_argv(Policy(), FACTS, workspace="/srv/ws", fds=Fds())
    writable = [argv[i + 1:i + 3] for i, a in enumerate(argv) if a == "--bind"]
    assert writable == [["/srv/ws", "/workspace"]]
    assert "--share-net" not in argv and "/etc/resolv.conf" not in argv


def test_network_opt_in_adds_share_net_and_resolv():
    argv = build_argv(Policy(network=True), FACTS, workspace="/w", fds=Fds())
    assert argv[:2] == ["--unshare-all", "--share-net"]
    i = argv.index("/etc/resolv.conf")
    assert argv[i - 2:i + 1] == ["--ro-bind", "/run/systemd/resolve/stub-resolv.conf", "/etc/resolv.conf"]


def test_non_merged_host_binds_dirs_and_setuid_bwrap_skips_disable_userns():
    facts = HostFacts(bwrap=BwrapInfo("/usr/bin/bwrap", (0, 8, 0), True, INFO.options),
                      layout=HostLayout(symlinks=(), ro_dirs=("/bin", "/lib"), etc_files=()), caller_is_root=False)
    argv = static_args(Policy(), facts)
    assert "--disable-userns" not in argv
    assert ("--ro-bind", "/bin", "/bin") == argv[argv.index("/bin") - 1:argv.index("/bin") + 2]
    assert "--symlink" not in argv


def test_old_bwrap_without_size():
    facts = HostFacts(bwrap=BwrapInfo("/usr/bin/bwrap", (0, 4, 0), False, frozenset()), layout=MERGED,
                      caller_is_root=False)
    argv = static_args(Policy(), facts)
    assert "--size" not in argv and "--disable-userns" not in argv


def test_env_user_values_on_top_and_validated():
    argv = build_argv(Policy(env={"PATH": "/opt/bin", "X": "1"}), FACTS, workspace="/w", fds=Fds(),
                      extra_env={"Y": "2"})
    assert ["--setenv", "PATH", "/opt/bin"] == argv[argv.index("PATH") - 1:argv.index("PATH") + 2]
    assert "Y" in argv
    for bad in ({"A=B": "1"}, {"": "x"}, {"X": "a\0b"}, {"1X": "y"}):
        with pytest.raises(lowlevel.PolicyError):
            Policy(env=bad)


def test_every_caller_goes_through_the_anchor():
    facts = HostFacts(bwrap=INFO, layout=MERGED, caller_is_root=True)
    helper = "/site/lowlevel/_lowlevel_exec"
    common = dict(parent=42, report_fd=12, cgroup_fds=(), rlimits=(), overlay=None, keep_fds=(), pass_fds=(3, 4),
                  args_fd=3, command=["true"])
    argv = anchor_argv(facts, helper, ids=(70000, 70001), **common)
    assert argv == [helper, "--parent=42", "--report-fd=12", "--uid=70000", "--gid=70001", "--pass-fds=3,4", "--",
                    "/usr/bin/bwrap", "--args", "3", "--", "true"]
    argv = anchor_argv(facts, helper, ids=(70000, 70000), **{
        **common, "rlimits": [("RLIMIT_CPU", 5, 6), ("RLIMIT_AS", -1, -1), ("RLIMIT_CORE", 0, 0)],
        "cgroup_fds": (13, 14), "cgroup_dir_fd": 16, "keep_fds": (15,)})
    assert argv == [helper, "--parent=42", "--report-fd=12", "--cgroup-fd=13", "--cgroup-fd=14", "--cgroup-dir-fd=16",
                    "--rlimit=RLIMIT_CPU=5:6", "--rlimit=RLIMIT_AS=unlimited:unlimited", "--rlimit=RLIMIT_CORE=0:0",
                    "--uid=70000", "--gid=70000", "--keep-fd=15", "--pass-fds=3,4", "--",
                    "/usr/bin/bwrap", "--args", "3", "--", "true"]
    # Not root: a user namespace of the caller's own ids, no uid change.
    assert anchor_argv(FACTS, helper, ids=None, **common) == \
        [helper, "--parent=42", "--report-fd=12", "--userns", "--pass-fds=3,4", "--",
         "/usr/bin/bwrap", "--args", "3", "--", "true"]


def test_anchor_gets_the_deadline():
    """The run's deadline (CLOCK_MONOTONIC ns) goes to the anchor, which kills the sandbox at it
    whether or not the caller runs (issue 23 item 4); no option without a timeout."""
    helper = "/site/lowlevel/_lowlevel_exec"
    common = dict(parent=42, report_fd=12, cgroup_fds=(), rlimits=(), overlay=None, keep_fds=(15,), pass_fds=(3,),
                  args_fd=3, command=["true"], ids=None)
    argv = anchor_argv(FACTS, helper, deadline_ns=123456789012, **common)
    assert argv[argv.index("--keep-fd=15") + 1:argv.index("--")] == ["--deadline-ns=123456789012", "--pass-fds=3"]
    assert not any(a.startswith("--deadline-ns") for a in anchor_argv(FACTS, helper, **common))


def test_anchor_overlay_options():
    helper = "/site/lowlevel/_lowlevel_exec"
    root = HostFacts(bwrap=INFO, layout=MERGED, caller_is_root=True)
    ov = AnchorOverlay(mnt="/run/lowlevel/mnt", lower_fd=16, upper_bytes=1 << 30, upper_inodes=1 << 20,
                       idmap=(0, 0))
    argv = anchor_argv(root, helper, parent=1, report_fd=12, cgroup_fds=(), rlimits=(), ids=(7, 7), overlay=ov,
                       keep_fds=(), pass_fds=(), args_fd=None, command=["/bin/true"])
    assert argv == [helper, "--parent=1", "--report-fd=12", "--uid=7", "--gid=7", "--mnt=/run/lowlevel/mnt",
                    "--lower-fd=16", f"--upper-bytes={1 << 30}", f"--upper-inodes={1 << 20}", "--idmap=0:0",
                    "--pass-fds=", "--", "/bin/true"]
    ov = AnchorOverlay(mnt="/tmp/lowlevel-1000/.mnt", lower_fd=16, upper_bytes=4096, upper_inodes=1024,
                       lower_path="/home/u/proj")
    argv = anchor_argv(FACTS, helper, parent=1, report_fd=None, cgroup_fds=(), rlimits=(), ids=None, overlay=ov,
                       keep_fds=(), pass_fds=(), args_fd=3, command=["ls"])
    assert "--userns" in argv and "--lower-path=/home/u/proj" in argv and not any("idmap" in a for a in argv)
    ov = AnchorOverlay(mnt="/run/lowlevel/mnt", lower_fd=16, upper_bytes=1 << 30, upper_inodes=1 << 20,
                       idmap=(0, 0), upper_dev_fd=17)
    argv = anchor_argv(root, helper, parent=1, report_fd=12, cgroup_fds=(), rlimits=(), ids=(7, 7), overlay=ov,
                       keep_fds=(), pass_fds=(), args_fd=None, command=["/bin/true"])
    assert argv[argv.index("--idmap=0:0") + 1] == "--upper-dev-fd=17"


def test_policy_is_hashable_and_static_args_cached():
    p = Policy()
    assert hash(p) == hash(Policy())
    assert static_args(p, FACTS) is static_args(p, FACTS)


@pytest.mark.parametrize("kwargs", [
    {"host_uid": 0}, {"host_gid": 0}, {"hostname": "bad host"}, {"stdout_limit_bytes": -1},
    {"seccomp": None}, {"binds": ("not-a-bind",)},
])
def test_policy_rejects_bad_values(kwargs):
    with pytest.raises(lowlevel.PolicyError):
        Policy(**kwargs)


def test_seccomp_none_needs_unsafe_flag():
    assert Policy(seccomp=None, unsafe_no_seccomp=True).seccomp is None


@pytest.mark.parametrize("path", ["~", "~/.ssh", "~/.aws", "~/.config/gcloud", "~/.kube", "/run", "/var/run",
                                  "/", "/proc", "/etc/shadow"])
def test_sensitive_binds_refused(path):
    p = os.path.expanduser(path)
    if not os.path.exists(p):
        os.makedirs(p, exist_ok=True)
        created = True
    else:
        created = False
    try:
        with pytest.raises(lowlevel.PolicyError, match="allow_sensitive"):
            Bind(p, "/mnt/x")
        assert Bind(p, "/mnt/x", allow_sensitive=True).source == os.path.realpath(p)
    finally:
        if created:
            os.rmdir(p)


def test_symlink_to_sensitive_dir_refused(tmp_path):
    link = tmp_path / "innocent"
    link.symlink_to("/run")
    with pytest.raises(lowlevel.PolicyError, match="/run"):
        Bind(str(link))


def test_socket_bind_refused():
    d = tempfile.mkdtemp(dir="/tmp")
    path = os.path.join(d, "bus.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    try:
        assert "socket" in (sensitive_reason(path) or "")
        with pytest.raises(lowlevel.PolicyError, match="socket"):
            Bind(path, "/mnt/bus")
    finally:
        s.close()
        os.unlink(path)
        os.rmdir(d)


def test_bind_dest_validation(tmp_path):
    for dest in ("relative", "/usr", "/proc/x", "/workspace", "/workspace/lib", "/a/../etc"):
        with pytest.raises(lowlevel.PolicyError):
            Bind(str(tmp_path), dest)
    with pytest.raises(lowlevel.PolicyError, match="does not exist"):
        Bind(str(tmp_path / "missing"))
    with pytest.raises(lowlevel.PolicyError, match="share a destination"):
        Policy(binds=(Bind(str(tmp_path), "/opt/a"), Bind(str(tmp_path), "/opt/a")))
    assert Bind(str(tmp_path), "/opt/tool/").dest == "/opt/tool"


@pytest.mark.parametrize("text,value", [("512", 512), ("64K", 65536), ("256M", 256 << 20), ("2G", 2 << 30),
                                        ("1.5K", 1536), ("10MiB", 10 << 20)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "12Q", "-1", "M", "1 2", "1.5"])
def test_parse_size_rejects(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_result_decoding():
    from lowlevel.sandbox.result import Result, decode_exit
    assert decode_exit(137) == 9 and decode_exit(1) is None and decode_exit(128) is None
    r = Result(exit_code=137, term_signal=9, killed_by="signal")
    assert not r.ok and r.signal_name() == "SIGKILL"
    with pytest.raises(lowlevel.RunFailedError):
        r.check()
    assert Result(exit_code=0).check().ok


def test_public_all_sorted():
    assert lowlevel.__all__ == sorted(lowlevel.__all__)
    for name in lowlevel.__all__:
        assert hasattr(lowlevel, name)


def test_errors_pickle():
    import pickle
    for err in (lowlevel.LaunchError("x", argv=["bwrap"], stderr="bwrap: no"),
                lowlevel.UnsupportedError("userns", "no userns", "sysctl"),
                lowlevel.PolicyError("bad")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
    back = pickle.loads(pickle.dumps(lowlevel.LaunchError("x", argv=["bwrap"], stderr="bwrap: no")))
    assert back.argv == ["bwrap"] and back.stderr == "bwrap: no"
