"""Unit tests of lowlevel.spec.limits (validation, rlimit tables) and of lowlevel.host.cgroup_detect and
lowlevel.host.cgroups (parsers, and the cgroup v1/v2 code paths against a fake cgroupfs: a directory
tree plus a small stand-in for the kernel's rules).

No processes are spawned and the real /sys/fs/cgroup is not touched.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil

import pytest

from helpers.cgroup_attach import attach

from lowlevel.errors import PolicyError, UnsupportedError
from lowlevel.host import cgroup_detect as D
from lowlevel.host import cgroupfs
from lowlevel.host import cgroups as C
from lowlevel.spec import limits as L
from lowlevel.spec.limits import GiB, KiB, MiB, Limits

# ---------------------------------------------------------------------------------------------
# Limits validation
# ---------------------------------------------------------------------------------------------


def test_defaults() -> None:
    lim = Limits()
    # Issue 25: the memory default is the program's 1 GiB plus the default tmpfs bounds (their
    # pages are charged to the run's cgroup), and RLIMIT_FSIZE is above the workspace bound.
    assert (lim.cpu_s, lim.memory_bytes, lim.address_space_bytes, lim.pids) == (60.0, 2 * GiB + 512 * MiB, None, 256)
    assert (lim.fsize_bytes, lim.nofile, lim.core_bytes, lim.cpu_quota) == (2 * GiB, 1024, 0, None)
    assert (lim.tmp_size_bytes, lim.require) == (256 * MiB, ())


def test_default_memory_leaves_the_program_1_gib_once_every_tmpfs_is_full() -> None:
    from lowlevel.workspace import cow
    lim = Limits()
    assert L.DEFAULT_WORKSPACE_BYTES == cow.DEFAULT_UPPER_BYTES
    assert L.tmpfs_bytes(lim) == GiB + 2 * 256 * MiB
    assert lim.memory_bytes == L.tmpfs_bytes(lim) + L.PROGRAM_MEMORY_BYTES
    assert lim.fsize_bytes is not None and lim.fsize_bytes > cow.DEFAULT_UPPER_BYTES  # ENOSPC before SIGXFSZ
    assert L.tmpfs_bytes(Limits(workspace_bytes=4 * GiB, tmp_size_bytes=MiB)) == 4 * GiB + 2 * MiB
    assert L.tmpfs_bytes(Limits(tmp_size_bytes=None)) is None


def test_memory_kill_note_gives_both_numbers() -> None:
    small = L.memory_kill_note(Limits(memory_bytes=256 * MiB))
    assert f"memory_bytes={256 * MiB}" in small and str(GiB + 512 * MiB) in small and "before ENOSPC" in small
    default = L.memory_kill_note(Limits(), "bwrap")
    assert "killed bwrap" in default and f"memory_bytes={2 * GiB + 512 * MiB}" in default
    assert "before ENOSPC" not in default


@pytest.mark.parametrize(("field", "value"), [
    ("cpu_s", 0), ("cpu_s", -1.0), ("cpu_s", float("nan")), ("cpu_s", float("inf")), ("cpu_s", "60"),
    ("cpu_s", True),
    ("memory_bytes", 1024), ("memory_bytes", 1.5 * GiB), ("memory_bytes", True), ("memory_bytes", 2**63),
    ("address_space_bytes", 0),
    ("pids", 1), ("pids", 0), ("pids", 2.0),
    ("fsize_bytes", -1),
    ("nofile", 2),
    ("core_bytes", None), ("core_bytes", -1),
    ("cpu_quota", 0), ("cpu_quota", 0.001),
    ("tmp_size_bytes", 1),
])
def test_bad_values_raise_policy_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(PolicyError, match=rf"Limits\.{field}"):
        Limits(**{field: value})  # type: ignore[arg-type]


def test_none_disables_each_optional_limit() -> None:
    lim = Limits(cpu_s=None, memory_bytes=None, pids=None, fsize_bytes=None, nofile=None,
                 tmp_size_bytes=None)
    assert L.rlimits(lim) == (("RLIMIT_CORE", 0, 0),)


def test_require_must_be_a_tuple_of_known_names() -> None:
    with pytest.raises(PolicyError, match=r"require=\('memory',\)"):
        Limits(require="memory")  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="unknown name 'disk'"):
        Limits(require=("disk",))
    with pytest.raises(PolicyError, match="memory_bytes is None"):
        Limits(memory_bytes=None, require=("memory",))
    with pytest.raises(PolicyError, match="cpu_quota is None"):
        Limits(require=("cpu",))
    assert Limits(require=["pids", "memory", "pids"]).require == ("pids", "memory")  # type: ignore[arg-type]


def test_limits_is_frozen_and_hashable() -> None:
    lim = Limits()
    with pytest.raises(AttributeError):
        lim.cpu_s = 1  # type: ignore[misc]
    assert hash(lim) == hash(Limits())


# ---------------------------------------------------------------------------------------------
# rlimit table
# ---------------------------------------------------------------------------------------------


class _Enforcing:
    """Stands in for a RunCgroup in rlimits(): only ``enforced`` is read."""

    def __init__(self, *enforced: str) -> None:
        self.enforced = enforced


def test_rlimits_without_cgroup_use_data_and_nproc_fallbacks() -> None:
    assert L.rlimits(Limits()) == (
        ("RLIMIT_CPU", 60, 61),
        ("RLIMIT_DATA", 2 * GiB + 512 * MiB, 2 * GiB + 512 * MiB),
        ("RLIMIT_NPROC", 256, 256),
        ("RLIMIT_FSIZE", 2 * GiB, 2 * GiB),
        ("RLIMIT_NOFILE", 1024, 1024),
        ("RLIMIT_CORE", 0, 0),
    )


def test_rlimits_leave_out_what_the_cgroup_enforces() -> None:
    names = [n for n, _, _ in L.rlimits(Limits(), _Enforcing("memory", "pids"))]  # type: ignore[arg-type]
    assert names == ["RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"]
    names = [n for n, _, _ in L.rlimits(Limits(), _Enforcing("memory"))]  # type: ignore[arg-type]
    assert "RLIMIT_NPROC" in names and "RLIMIT_DATA" not in names


def test_rlimit_cpu_rounds_up_and_hard_is_one_second_later() -> None:
    assert L.rlimits(Limits(cpu_s=0.2))[0] == ("RLIMIT_CPU", 1, 2)
    assert L.rlimits(Limits(cpu_s=2.5))[0] == ("RLIMIT_CPU", 3, 4)


def test_rlimit_as_only_when_set() -> None:
    assert "RLIMIT_AS" not in {n for n, _, _ in L.rlimits(Limits())}
    assert ("RLIMIT_AS", 4 * GiB, 4 * GiB) in L.rlimits(Limits(address_space_bytes=4 * GiB))


# ---------------------------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------------------------

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
50 23 0:40 /docker/abc /mnt/my\\040cg rw - cgroup cgroup rw,pids
"""


def test_parse_mountinfo_keeps_cgroup_mounts_and_unescapes() -> None:
    got = D.parse_mountinfo(HYBRID_MOUNTINFO)
    assert got[0] == ("/", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct")
    assert ("/", "/sys/fs/cgroup/unified", "cgroup2", "rw,nsdelegate") in got
    assert ("/docker/abc", "/mnt/my cg", "cgroup", "rw,pids") in got
    assert all(fs in ("cgroup", "cgroup2") for _, _, fs, _ in got)


def test_parse_proc_cgroup() -> None:
    text = "9:name=systemd:/\n4:memory:/process_api/x\n2:cpu,cpuacct:/a:b\n0::/user.slice\n"
    assert D.parse_proc_cgroup(text) == {"name=systemd": "/", "memory": "/process_api/x",
                                         "cpu,cpuacct": "/a:b", "": "/user.slice"}


@pytest.mark.parametrize(("root", "own", "expected"), [
    ("/", "/", "/m"),
    ("/", "/a/b", "/m/a/b"),
    ("/docker/abc", "/docker/abc/x", "/m/x"),   # bind mount of a subtree, no cgroup namespace
    ("/docker/abc", "/", "/m"),                 # cgroup namespace: paths already relative
])
def test_own_dir(root: str, own: str, expected: str) -> None:
    assert D._own_dir("/m", root, own) == expected


# ---------------------------------------------------------------------------------------------
# Fake cgroupfs: directories + the kernel rules we rely on
# ---------------------------------------------------------------------------------------------

V2_FILES = {
    None: {"cgroup.procs": "", "cgroup.subtree_control": "", "cgroup.type": "domain\n",
           "cgroup.kill": "", "cgroup.events": "populated 0\nfrozen 0\n",
           "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n"},
    "memory": {"memory.max": "max\n", "memory.swap.max": "max\n", "memory.current": "0\n",
               "memory.peak": "0\n", "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n"},
    "pids": {"pids.max": "max\n", "pids.events": "max 0\n", "pids.current": "0\n"},
    "cpu": {"cpu.max": "max 100000\n"},
}
V1_FILES = {
    "memory": {"memory.limit_in_bytes": "9223372036854771712\n", "memory.memsw.limit_in_bytes": "x\n",
               "memory.max_usage_in_bytes": "0\n", "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n"},
    "pids": {"pids.max": "max\n", "pids.events": "max 0\n", "pids.peak": "0\n"},
    "cpu": {"cpu.cfs_period_us": "100000\n", "cpu.cfs_quota_us": "-1\n"},
    "cpuacct": {"cpuacct.usage_user": "0\n", "cpuacct.usage_sys": "0\n", "cpuacct.usage": "0\n"},
    "freezer": {"freezer.state": "THAWED\n"},
}


class FakeKernel:
    """Stands in for cgroupfs: mkdir populates interface files; writes follow the kernel's rules.

    - v2 ``cgroup.subtree_control``: ``+ctrl`` must be in ``cgroup.controllers``; a non-root
      cgroup with processes refuses (EBUSY, the "no internal processes" rule).
    - ``cgroup.procs``: moving a PID removes it from every other cgroup of the same tree.
    - other files: must exist (no O_CREAT), content replaced.
    """

    def __init__(self, tmp: str, *, omit: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.omit = omit
        self.v1_mounts: dict[str, frozenset[str]] = {}
        self.writes: list[tuple[str, str]] = []
        self.killed: list[int] = []

    def v2_root(self, controllers: str = "cpu memory pids") -> str:
        root = os.path.join(self.tmp, "v2")
        os.makedirs(root)
        for name, text in {"cgroup.procs": "", "cgroup.subtree_control": "",
                           "cgroup.controllers": controllers + "\n"}.items():
            self._put(os.path.join(root, name), text)
        return root

    def v1_root(self, controller: str) -> str:
        root = os.path.join(self.tmp, "v1", controller)
        os.makedirs(root)
        self.v1_mounts[root] = frozenset(controller.split(","))
        self._put(os.path.join(root, "cgroup.procs"), "")
        return root

    def _put(self, path: str, text: str) -> None:
        with open(path, "w") as f:
            f.write(text)

    def _v1_mount(self, path: str) -> str | None:
        return next((m for m in self.v1_mounts if path == m or path.startswith(m + "/")), None)

    def mkdir(self, path: str, exist_ok: bool = False) -> None:
        try:
            os.mkdir(path)
        except FileExistsError:
            if not exist_ok:
                raise
            return
        mount = self._v1_mount(path)
        if mount is not None:
            self._put(os.path.join(path, "cgroup.procs"), "")
            for c in self.v1_mounts[mount]:
                for name, text in V1_FILES[c].items():
                    if name not in self.omit:
                        self._put(os.path.join(path, name), text)
            return
        parent = os.path.dirname(path)
        enabled = cgroupfs.read_words(os.path.join(parent, "cgroup.subtree_control"))
        self._put(os.path.join(path, "cgroup.controllers"), " ".join(sorted(enabled)) + "\n")
        for key in (None, *sorted(enabled)):
            for name, text in V2_FILES.get(key, {}).items():
                if name not in self.omit:
                    self._put(os.path.join(path, name), text)

    def rmdir(self, path: str) -> None:
        if cgroupfs.read_ints(os.path.join(path, "cgroup.procs")):
            raise OSError(errno.EBUSY, "busy", path)
        if any(os.path.isdir(os.path.join(path, e)) for e in os.listdir(path)):
            raise OSError(errno.EBUSY, "has children", path)
        shutil.rmtree(path)

    def write(self, path: str, text: str) -> None:
        self.writes.append((os.path.relpath(path, self.tmp), text))
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, "No such file", path)
        d, name = os.path.split(path)
        if name == "cgroup.subtree_control":
            available = cgroupfs.read_words(os.path.join(d, "cgroup.controllers"))
            current = cgroupfs.read_words(path)
            for word in text.split():
                ctrl = word[1:]
                if ctrl not in available:
                    raise OSError(errno.ENOENT, "not available", path)
                if os.path.exists(os.path.join(d, "cgroup.type")) and cgroupfs.read_ints(os.path.join(d, "cgroup.procs")):
                    raise OSError(errno.EBUSY, "no internal processes", path)
                current = current | {ctrl} if word[0] == "+" else current - {ctrl}
            self._put(path, " ".join(sorted(current)) + "\n")
        elif name == "cgroup.procs":
            pid = int(text)
            top = self._v1_mount(path) or os.path.join(self.tmp, "v2")
            for dirpath, _, files in os.walk(top):
                if "cgroup.procs" in files:
                    procs = os.path.join(dirpath, "cgroup.procs")
                    self._put(procs, "".join(f"{p}\n" for p in cgroupfs.read_ints(procs) if p != pid))
            self._put(path, "".join(f"{p}\n" for p in [*cgroupfs.read_ints(path), pid]))
        else:
            self._put(path, text)


@pytest.fixture
def kernel(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    k = FakeKernel(str(tmp_path))
    monkeypatch.setattr(cgroupfs, "mkdir", k.mkdir)
    monkeypatch.setattr(cgroupfs, "rmdir", k.rmdir)
    monkeypatch.setattr(cgroupfs, "write", k.write)
    monkeypatch.setattr(cgroupfs, "kill", k.killed.append)  # fake PIDs: never signal a real process
    return k


def _no_delegate(mount: str, user: bool) -> None:
    return None


def _mountinfo(*mounts: tuple[str, str, str]) -> str:
    return "".join(f"{i} 1 0:{i} / {m} rw - {fs} {fs} {opts}\n" for i, (m, fs, opts) in enumerate(mounts, 30))


# ---------------------------------------------------------------------------------------------
# v2 detection
# ---------------------------------------------------------------------------------------------


def test_v2_root_cgroup_gets_lowlevel_base_with_controllers(kernel: FakeKernel) -> None:
    root = kernel.v2_root()
    support = D._detect(_mountinfo((root, "cgroup2", "rw")), "0::/\n", euid=0, pid=1,
                        delegate=_no_delegate)
    h = support.v2
    assert h is not None and h.base == os.path.join(root, "lowlevel") and h.how == "root cgroup"
    assert h.controllers == {"cpu", "memory", "pids"}
    assert cgroupfs.read_words(os.path.join(root, "cgroup.subtree_control")) == {"cpu", "memory", "pids"}
    assert support.version == "v2" and support.hierarchy_for("memory") is h


#: The uid that owns the caller's own cgroup in the v2 cases: 1000 as root (chown works), the
#: runner's own uid otherwise (a user whose uid is not 1000 could not chown to it: a fresh-user trial).
OWNER = 1000 if os.geteuid() == 0 else os.geteuid()


def test_v2_own_cgroup_delegated_moves_us_to_a_leaf(kernel: FakeKernel) -> None:
    root = kernel.v2_root()
    kernel.write(os.path.join(root, "cgroup.subtree_control"), "+memory +pids")
    own = os.path.join(root, "user.slice", "app.scope")
    kernel.mkdir(os.path.dirname(own))
    kernel.write(os.path.join(os.path.dirname(own), "cgroup.subtree_control"), "+memory +pids")
    kernel.mkdir(own)
    kernel.write(os.path.join(own, "cgroup.procs"), "4242")
    os.chown(own, OWNER, OWNER)
    support = D._detect(_mountinfo((root, "cgroup2", "rw")), "0::/user.slice/app.scope\n",
                        euid=OWNER, pid=4242, delegate=_no_delegate)
    h = support.v2
    assert h is not None and h.base == os.path.join(own, "lowlevel"), h
    assert h.controllers == {"memory", "pids"}
    assert cgroupfs.read_ints(os.path.join(own, "supervisor", "cgroup.procs")) == [4242]
    assert cgroupfs.read_ints(os.path.join(own, "cgroup.procs")) == []


def test_v2_own_cgroup_shared_with_other_processes_gets_no_controllers(kernel: FakeKernel) -> None:
    root = kernel.v2_root()
    kernel.write(os.path.join(root, "cgroup.subtree_control"), "+memory")
    own = os.path.join(root, "session.scope")
    kernel.mkdir(own)
    kernel.write(os.path.join(own, "cgroup.procs"), "4242")
    kernel.write(os.path.join(own, "cgroup.procs"), "77")  # the caller's shell
    os.chown(own, OWNER, OWNER)
    h = D._detect(_mountinfo((root, "cgroup2", "rw")), "0::/session.scope\n", euid=OWNER, pid=4242,
                  delegate=_no_delegate).v2
    assert h is not None and h.base == os.path.join(own, "lowlevel") and h.controllers == frozenset()
    assert not os.path.exists(os.path.join(own, "supervisor"))  # the caller's shell is not moved
    assert C.enforcement_plan(Limits(), D.CgroupSupport((h,))).cgroups == ()


def test_v2_systemd_scope_is_used_and_the_holder_moved_out(kernel: FakeKernel) -> None:
    root = kernel.v2_root()
    kernel.write(os.path.join(root, "cgroup.subtree_control"), "+memory +pids +cpu")
    scope = os.path.join(root, "lowlevel-1.scope")
    calls = []

    def delegate(mount: str, user: bool) -> tuple[str, int]:
        calls.append((mount, user))
        kernel.mkdir(scope)
        kernel.write(os.path.join(scope, "cgroup.procs"), "555")
        return scope, 555

    own = os.path.join(root, "session.scope")
    kernel.mkdir(own)
    kernel.write(os.path.join(own, "cgroup.procs"), "4242")
    support = D._detect(_mountinfo((root, "cgroup2", "rw")), "0::/session.scope\n", euid=1000, pid=4242,
                        delegate=delegate)
    assert calls == [(root, True)]
    h = support.v2
    assert h is not None and h.base == scope and h.controllers == {"cpu", "memory", "pids"}
    assert cgroupfs.read_ints(os.path.join(scope, "holder", "cgroup.procs")) == [555]


def test_v2_not_writable_and_no_systemd_means_no_base(kernel: FakeKernel) -> None:
    root = kernel.v2_root()
    kernel.write(os.path.join(root, "cgroup.subtree_control"), "+memory")
    kernel.mkdir(os.path.join(root, "svc"))
    kernel.write(os.path.join(root, "svc", "cgroup.procs"), "9")
    support = D._detect(_mountinfo((root, "cgroup2", "rw")), "0::/svc\n", euid=0, pid=9,
                        delegate=_no_delegate)  # root, but no delegate xattr: not ours to split
    assert support.v2 is not None and support.v2.base is None
    assert not support.usable
    with pytest.raises(UnsupportedError) as info:
        C.enforcement_plan(Limits(require=("memory",)), support)
    assert info.value.feature == "cgroup:memory"
    assert "not writable" in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.feature, str(again)) == (info.value.feature, str(info.value))
    assert C.RunCgroup.create(Limits(), support=support) is None


def test_hybrid_prefers_v1_controllers_and_keeps_v2_core(kernel: FakeKernel) -> None:
    v2 = kernel.v2_root(controllers="hugetlb")
    mem = kernel.v1_root("memory")
    cpu = kernel.v1_root("cpu,cpuacct")
    mountinfo = _mountinfo((mem, "cgroup", "rw,memory"), (cpu, "cgroup", "rw,cpu,cpuacct"),
                           (v2, "cgroup2", "rw"))
    os.makedirs(os.path.join(mem, "process_api", "h"))
    support = D._detect(mountinfo, "4:memory:/process_api/h\n2:cpu,cpuacct:/\n0::/\n", euid=0, pid=1,
                        delegate=_no_delegate)
    assert support.version == "hybrid"
    assert support.hierarchy_for("memory").base == os.path.join(mem, "process_api", "h", "lowlevel")  # type: ignore[union-attr]
    assert support.hierarchy_for("cpu").mount == cpu  # type: ignore[union-attr]
    assert support.hierarchy_for("pids") is None
    assert support.v2 is not None and support.v2.base and support.v2.controllers == frozenset()
    plan = C.enforcement_plan(Limits(cpu_quota=1.0), support)
    assert plan.cgroups == (("memory", 1), ("cpu", 1))
    assert plan.not_enforced == (("pids", "no writable pids cgroup: RLIMIT_NPROC per uid instead "
                                          "(not enforced for root)"),)
    assert ("RLIMIT_NPROC", 256, 256) in plan.rlimits
    assert "RLIMIT_DATA" not in {n for n, _, _ in plan.rlimits}


# ---------------------------------------------------------------------------------------------
# RunCgroup on fake v2 and v1
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def v2_support(kernel: FakeKernel) -> D.CgroupSupport:
    root = kernel.v2_root()
    return D._detect(_mountinfo((root, "cgroup2", "rw")), "0::/\n", euid=0, pid=1, delegate=_no_delegate)


def _file(cg: C.RunCgroup, controller: str, name: str) -> str:
    node = cg.node(controller)
    assert node is not None
    return cgroupfs.read(os.path.join(node.path, name))


def test_v2_run_cgroup_writes_limits(kernel: FakeKernel, v2_support: D.CgroupSupport) -> None:
    cg = C.RunCgroup.create(Limits(memory_bytes=256 * MiB, pids=64, cpu_quota=0.5), "r1", support=v2_support)
    assert cg is not None and len(cg.nodes) == 1
    assert cg.enforced == ("memory", "pids", "cpu")
    assert cg.limit_files == ("memory.max", "memory.swap.max", "pids.max", "cpu.max")
    assert _file(cg, "memory", "memory.max") == str(256 * MiB)
    assert _file(cg, "memory", "memory.swap.max") == "0"
    assert _file(cg, "pids", "pids.max") == "64"
    assert _file(cg, "cpu", "cpu.max") == "50000 100000"
    assert cg.limit_files == ("memory.max", "memory.swap.max", "pids.max", "cpu.max")  # by their own names
    attach(cg, 31337)
    assert cg.pids() == [31337]
    with pytest.raises(OSError) as info:
        cg.remove(timeout_s=0.01)  # the fake PID never exits
    assert info.value.errno == errno.EBUSY
    assert ("v2/lowlevel/r1/cgroup.kill", "1") in kernel.writes
    assert set(kernel.killed) == {31337}  # cgroup.kill did not empty it: SIGKILL loop
    with open(os.path.join(cg.nodes[0].path, "cgroup.procs"), "w"):
        pass  # "it exited"
    cg.remove()
    assert not os.path.exists(cg.nodes[0].path)
    cg.remove()  # idempotent


def test_v2_stats(kernel: FakeKernel, v2_support: D.CgroupSupport) -> None:
    cg = C.RunCgroup.create(Limits(), "r2", support=v2_support)
    assert cg is not None
    d = cg.nodes[0].path
    for name, text in {"memory.peak": "123456\n", "memory.events": "max 4\noom 1\noom_kill 1\n",
                       "pids.events": "max 7\n", "cpu.stat": "usage_usec 3500000\nuser_usec 2500000\n"
                                                            "system_usec 1000000\n"}.items():
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
    assert cg.stats() == C.CgroupStats(peak_memory_bytes=123456, oom_kills=1, pids_limit_hit=True,
                                       pids_peak=None, cpu_user_s=2.5, cpu_system_s=1.0)
    cg.remove()


def test_v2_peak_by_sampling_without_memory_peak(kernel: FakeKernel, v2_support: D.CgroupSupport) -> None:
    kernel.omit = ("memory.peak",)  # Linux < 5.19
    cg = C.RunCgroup.create(Limits(), "r3", support=v2_support)
    assert cg is not None
    current = os.path.join(cg.nodes[0].path, "memory.current")
    for value in (10, 900, 20):
        with open(current, "w") as f:
            f.write(f"{value}\n")
        cg.sample()
    assert cg.stats().peak_memory_bytes == 900
    cg.remove()


def test_v2_without_swap_accounting_notes_it(kernel: FakeKernel, v2_support: D.CgroupSupport) -> None:
    kernel.omit = ("memory.swap.max",)
    cg = C.RunCgroup.create(Limits(), "r4", support=v2_support)
    assert cg is not None and cg.enforced == ("memory", "pids")
    assert cg.limit_files == ("memory.max", "pids.max")
    assert any("swap is not bounded" in n for n in cg.notes)
    cg.remove()


def test_required_limit_whose_write_fails_raises_and_leaves_nothing(kernel: FakeKernel,
                                                                    v2_support: D.CgroupSupport) -> None:
    kernel.omit = ("pids.max",)
    base = v2_support.v2.base  # type: ignore[union-attr]
    with pytest.raises(UnsupportedError) as info:
        C.RunCgroup.create(Limits(require=("pids",)), "r5", support=v2_support)
    assert info.value.feature == "cgroup:pids"
    assert "pids.max: missing" in str(info.value)
    assert not os.path.exists(os.path.join(base, "r5"))  # type: ignore[arg-type]


def test_name_collision_and_bad_names(kernel: FakeKernel, v2_support: D.CgroupSupport) -> None:
    cg = C.RunCgroup.create(Limits(), "same", support=v2_support)
    with pytest.raises(FileExistsError):
        C.RunCgroup.create(Limits(), "same", support=v2_support)
    assert cg is not None
    cg.remove()
    for bad in ("..", "a/b", "", "x" * 65):
        with pytest.raises(ValueError):
            C.RunCgroup.create(Limits(), bad, support=v2_support)


def test_v1_run_cgroup_uses_each_hierarchy(kernel: FakeKernel) -> None:
    mem, pids, cpu, frz = (kernel.v1_root(c) for c in ("memory", "pids", "cpu,cpuacct", "freezer"))
    mountinfo = _mountinfo((mem, "cgroup", "rw,memory"), (pids, "cgroup", "rw,pids"),
                           (cpu, "cgroup", "rw,cpu,cpuacct"), (frz, "cgroup", "rw,freezer"))
    support = D._detect(mountinfo, "5:memory:/\n4:pids:/\n3:cpu,cpuacct:/\n2:freezer:/\n", euid=0, pid=1,
                        delegate=_no_delegate)
    assert support.version == "v1"
    cg = C.RunCgroup.create(Limits(memory_bytes=64 * MiB, pids=10, cpu_quota=2.0), "r6", support=support)
    assert cg is not None
    assert {n.path for n in cg.nodes} == {os.path.join(m, "lowlevel", "r6") for m in (mem, pids, cpu, frz)}
    assert cg.limit_files == ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "pids.max",
                              "cpu.cfs_quota_us")
    assert _file(cg, "memory", "memory.memsw.limit_in_bytes") == str(64 * MiB)
    assert _file(cg, "cpu", "cpu.cfs_quota_us") == "200000"
    acct = cg.node("cpuacct").path  # type: ignore[union-attr]
    for name, value in (("cpuacct.usage_user", 1_600_000_000), ("cpuacct.usage_sys", 400_000_000),
                        ("cpuacct.usage", 1_000_000_000)):
        with open(os.path.join(acct, name), "w") as f:
            f.write(f"{value}\n")
    with open(os.path.join(cg.node("memory").path, "memory.oom_control"), "w") as f:  # type: ignore[union-attr]
        f.write("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    stats = cg.stats()
    # tick-sampled user/sys (2 s) scaled to the exact usage (1 s)
    assert (stats.cpu_user_s, stats.cpu_system_s, stats.oom_kills, stats.pids_limit_hit) == (0.8, 0.2, 3, False)
    cg.remove()
    assert all(not os.path.exists(n.path) for n in cg.nodes)


def test_v1_without_memsw_notes_unbounded_swap(kernel: FakeKernel) -> None:
    kernel.omit = ("memory.memsw.limit_in_bytes",)
    mem = kernel.v1_root("memory")
    support = D._detect(_mountinfo((mem, "cgroup", "rw,memory")), "5:memory:/\n", euid=0, pid=1,
                        delegate=_no_delegate)
    cg = C.RunCgroup.create(Limits(), "r7", support=support)
    assert cg is not None and cg.enforced == ("memory",)
    assert any("swapaccount=0" in n for n in cg.notes)
    cg.remove()


def test_v1_not_writable_reports_why(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(path: str, exist_ok: bool = False) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(cgroupfs, "mkdir", denied)
    support = D._detect(_mountinfo(("/nonexistent/memory", "cgroup", "rw,memory")), "5:memory:/x\n",
                        euid=1000, pid=1, delegate=_no_delegate)
    (h,) = support.hierarchies
    assert h.base is None and h.how == "mkdir /nonexistent/memory/x/lowlevel: Permission denied"
    assert not support.usable and support.version == "v1"


def test_stale_runs_of_dead_processes_are_swept(kernel: FakeKernel) -> None:
    mem = kernel.v1_root("memory")
    kernel.mkdir(os.path.join(mem, "lowlevel"))
    dead = os.path.join(mem, "lowlevel", "999999999-1-abc")
    mine = os.path.join(mem, "lowlevel", f"{os.getpid()}-1-abc")
    dead_run = os.path.join(mem, "lowlevel", "run-999999999-7f00aa")
    other = os.path.join(mem, "lowlevel", "someone-else")
    for d in (dead, dead_run, mine, other):
        kernel.mkdir(d)
    D._detect(_mountinfo((mem, "cgroup", "rw,memory")), "5:memory:/\n", euid=0, pid=1, delegate=_no_delegate)
    assert not os.path.exists(dead) and not os.path.exists(dead_run)
    assert os.path.exists(mine) and os.path.exists(other)


def test_no_cgroups_at_all() -> None:
    support = D._detect("", "", euid=0, pid=1, delegate=_no_delegate)
    assert support.version is None and not support.usable
    assert C.RunCgroup.create(Limits(), support=support) is None
    plan = C.enforcement_plan(Limits(), support)
    assert not plan.cgroup and plan.cgroups == ()
    assert {n for n, _, _ in plan.rlimits} >= {"RLIMIT_DATA", "RLIMIT_NPROC"}
    with pytest.raises(UnsupportedError, match="no cgroup mounted"):
        C.enforcement_plan(Limits(require=("cgroup",)), support)


def test_sizes_are_bytes() -> None:
    assert (KiB, MiB, GiB) == (1024, 1024**2, 1024**3)


def test_systemd_delegate_without_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert D._systemd_delegate("/sys/fs/cgroup", True) is None


def test_v2_container_namespace_root_shared_gets_a_core_only_base(kernel: FakeKernel) -> None:
    # A container's cgroup namespace: "/" here is a non-root cgroup (it has cgroup.type) holding
    # the container's init and us, so no controller can be enabled below it.
    root = kernel.v2_root()
    kernel.write(os.path.join(root, "cgroup.subtree_control"), "+memory +pids")
    ns_root = os.path.join(root, "docker-1.scope")
    kernel.mkdir(ns_root)
    kernel.write(os.path.join(ns_root, "cgroup.procs"), "1")
    kernel.write(os.path.join(ns_root, "cgroup.procs"), "4242")
    mountinfo = f"30 1 0:30 / {ns_root} rw - cgroup2 cgroup2 rw\n"
    h = D._detect(mountinfo, "0::/\n", euid=0, pid=4242, delegate=_no_delegate).v2
    assert h is not None and h.base == os.path.join(ns_root, "lowlevel") and h.controllers == frozenset()
    assert "kill and CPU time only" in h.how


def test_v2_container_namespace_root_alone_moves_us_and_enables_controllers(kernel: FakeKernel) -> None:
    root = kernel.v2_root()
    kernel.write(os.path.join(root, "cgroup.subtree_control"), "+memory +pids")
    ns_root = os.path.join(root, "docker-1.scope")
    kernel.mkdir(ns_root)
    kernel.write(os.path.join(ns_root, "cgroup.procs"), "4242")
    mountinfo = f"30 1 0:30 / {ns_root} rw - cgroup2 cgroup2 rw\n"
    h = D._detect(mountinfo, "0::/\n", euid=0, pid=4242, delegate=_no_delegate).v2
    assert h is not None and h.controllers == {"memory", "pids"}
    assert cgroupfs.read_ints(os.path.join(ns_root, "supervisor", "cgroup.procs")) == [4242]


# ---------------------------------------------------------------------------------------------
# Per-call limits of a pre-started sandbox (Pool) and a command's counters (Session)
# ---------------------------------------------------------------------------------------------


def test_v2_update_limits_rewrites_and_removes(kernel: FakeKernel, v2_support: D.CgroupSupport) -> None:
    cg = C.RunCgroup.create(Limits(memory_bytes=1024 * MiB, pids=256), "u1", support=v2_support)
    assert cg is not None and cg.enforced == ("memory", "pids")
    # v2: one directory with every controller, so a cpu limit can be added for the call
    assert cg.update_limits(Limits(memory_bytes=64 * MiB, pids=None, cpu_quota=1.0)) == ("memory", "cpu")
    assert _file(cg, "memory", "memory.max") == str(64 * MiB)
    assert _file(cg, "pids", "pids.max") == "max"
    assert _file(cg, "cpu", "cpu.max") == "100000 100000"
    assert L.rlimits(Limits(memory_bytes=64 * MiB, pids=9), cg)[1:3] == (("RLIMIT_NPROC", 9, 9),
                                                                        ("RLIMIT_FSIZE", 2 << 30, 2 << 30))
    assert cg.update_limits(Limits(memory_bytes=None)) == ("pids",)
    assert _file(cg, "memory", "memory.max") == "max"
    assert _file(cg, "cpu", "cpu.max") == "max 100000"
    cg.remove()


def test_v1_update_limits_keeps_memsw_above_the_limit(kernel: FakeKernel) -> None:
    mem = kernel.v1_root("memory")
    support = D._detect(_mountinfo((mem, "cgroup", "rw,memory")), "5:memory:/\n", euid=0, pid=1,
                        delegate=_no_delegate)
    cg = C.RunCgroup.create(Limits(memory_bytes=256 * MiB), "u2", support=support)
    assert cg is not None
    kernel.writes.clear()
    cg.update_limits(Limits(memory_bytes=64 * MiB))   # lowering: limit first, then memsw
    assert [w[0].rsplit("/", 1)[1] for w in kernel.writes] == ["memory.limit_in_bytes",
                                                                "memory.memsw.limit_in_bytes"]
    kernel.writes.clear()
    cg.update_limits(Limits(memory_bytes=512 * MiB))  # raising: memsw first
    assert [w[0].rsplit("/", 1)[1] for w in kernel.writes] == ["memory.memsw.limit_in_bytes",
                                                                "memory.limit_in_bytes"]
    assert _file(cg, "memory", "memory.limit_in_bytes") == str(512 * MiB)
    cg.remove()


def test_event_counts(kernel: FakeKernel, v2_support: D.CgroupSupport) -> None:
    cg = C.RunCgroup.create(Limits(), "u3", support=v2_support)
    assert cg is not None and cg.event_counts() == (0, 0)
    with open(os.path.join(cg.nodes[0].path, "memory.events"), "w") as f:
        f.write("max 4\noom 2\noom_kill 2\n")
    assert cg.event_counts() == (2, 0)
    cg.remove()


def test_fallback_notes_say_what_bounds_each_limit(kernel: FakeKernel, v2_support: D.CgroupSupport) -> None:
    notes = L.fallback_notes(Limits(cpu_quota=0.5), None)
    assert notes == (L.MEMORY_FALLBACK_NOTE, L.PIDS_FALLBACK_NOTE, L.CPU_QUOTA_FALLBACK_NOTE)
    for words in ("RLIMIT_DATA", "MAP_SHARED", "memfd", "/dev/shm", "require=('memory',)", "RLIMIT_AS"):
        assert words in L.MEMORY_FALLBACK_NOTE
    assert L.fallback_notes(Limits(memory_bytes=None, pids=None), None) == ()
    cg = C.RunCgroup.create(Limits(), "u4", support=v2_support)
    assert L.fallback_notes(Limits(), cg) == ()
    cg.remove()  # type: ignore[union-attr]


def test_workspace_bytes_above_what_the_anchor_takes_is_a_policy_error() -> None:
    """The anchor mounts the upper tmpfs with at most 2^50 bytes: a larger value used to pass
    Limits and fail at setup with "lowlevel_exec: bad option --upper-bytes=..."."""
    assert Limits(workspace_bytes=1 << 50).workspace_bytes == 1 << 50
    with pytest.raises(PolicyError, match="workspace_bytes must be between 65536 and 1125899906842624"):
        Limits(workspace_bytes=(1 << 50) + 1)


def test_upper_inodes_stay_within_the_anchors_ceiling() -> None:
    """5 TiB used to give nr_inodes=5242880000, which the anchor refuses (> 2^32)."""
    from lowlevel.workspace.cow import upper_inodes
    assert upper_inodes(64 * KiB) == 1024
    assert upper_inodes(5000 * GiB) == 1 << 32


# ---------------------------------------------------------------------------------------------
# the sweep and the run records (issue 23 item 5)
# ---------------------------------------------------------------------------------------------


def test_detect_without_sweep_keeps_a_dead_callers_cgroup(kernel: FakeKernel) -> None:
    """doctor and cleanup --dry-run detect with sweep=False: they only look; the default sweeps."""
    mem = kernel.v1_root("memory")
    dead = 2**22 + 12345  # above pid_max's default: no such process
    mountinfo = _mountinfo((mem, "cgroup", "rw,memory"))
    D._detect(mountinfo, "5:memory:/\n", euid=0, pid=1, delegate=_no_delegate)
    kernel.mkdir(os.path.join(mem, "lowlevel", f"run-{dead}-1"))
    D._detect(mountinfo, "5:memory:/\n", euid=0, pid=1, delegate=_no_delegate, sweep=False)
    assert os.path.isdir(os.path.join(mem, "lowlevel", f"run-{dead}-1"))
    D._detect(mountinfo, "5:memory:/\n", euid=0, pid=1, delegate=_no_delegate)  # control: the sweep
    assert not os.path.exists(os.path.join(mem, "lowlevel", f"run-{dead}-1"))


def test_run_cgroup_is_recorded_until_removed(kernel: FakeKernel, tmp_path: object,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from lowlevel.host import run_records
    records = os.path.join(str(tmp_path), "records")
    os.mkdir(records, 0o700)
    monkeypatch.setenv("LOWLEVEL_RECORD_DIR", records)
    mem = kernel.v1_root("memory")
    support = D._detect(_mountinfo((mem, "cgroup", "rw,memory")), "5:memory:/\n", euid=os.geteuid(),
                        pid=os.getpid(), delegate=_no_delegate)
    cg = C.RunCgroup.create(Limits(), "rec1", support=support, workspace="/some/ws")
    assert cg is not None and cg.record is not None
    [rec] = run_records.records()
    assert rec.cgroups == [n.path for n in cg.nodes] and rec.workspace == "/some/ws"
    assert rec.pid == os.getpid() and rec.caller_alive()
    rec.start_time += 1  # the same pid with another start time: a reused pid, so a dead caller
    assert not rec.caller_alive()
    cg.remove()
    assert run_records.records() == [] and os.listdir(records) == []
