"""A copy-on-write upper layer on disk (``Limits.upper="disk"``): a loop device per run.

The default upper of a run's overlay is a tmpfs sized to ``Limits.workspace_bytes``: bounded,
but every byte a run writes stays in RAM (charged to the run's memory cgroup where there is
one; to no limit at all for an unprivileged caller without one). A disk upper moves those bytes
to disk with the same hard bound:

1. an unnamed file (``open(2)`` ``O_TMPFILE``) in :func:`upper_dir`, truncated to the bound
   (sparse: it costs the host disk only what the run writes, never more than the bound);
2. a fresh ext4 in it: a copy, extent by extent (``SEEK_DATA``/``SEEK_HOLE`` +
   ``copy_file_range(2)``), of a template ``mke2fs`` made once per (size, inodes) in this
   process (:func:`_template`; ~20 ms of mke2fs against ~1 ms of copy per run);
3. a loop device bound to it: ``LOOP_CTL_GET_FREE`` then ``LOOP_CONFIGURE`` (Linux 5.8) with
   ``LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO``, in one call; the file's own fd is closed at
   once, so the loop device holds the only reference to it;
4. the anchor (``native/lowlevel_exec.c``, ``--upper-dev-fd``) mounts that ext4 on the run's
   mount directory in its private mount namespace, where the tmpfs goes otherwise.

Nothing can stay behind, whatever instant the caller dies at (SIGKILL included): the file never
has a name, so its blocks are freed when its last reference goes; the loop device clears itself
(``AUTOCLEAR``) when its last opener closes it: the caller's fd and the anchor's (closed by the
kernel at their deaths) and the mount, which lives only in the anchor's mount namespace (and in
the upper-dir fd the caller holds for the commit). So ``lowlevel cleanup`` has nothing to find
and no run record names a device. ``LOOP_SET_FD`` + ``LOOP_SET_STATUS64`` (before 5.8) would
leave a window in which a bound device has no AUTOCLEAR: refused instead (UnsupportedError).

Who gets it: root callers (a loop device needs ``CAP_SYS_ADMIN``; ext4 cannot be mounted in a
user namespace: no ``FS_USERNS_MOUNT``). An unprivileged caller gets
:class:`lowlevel.errors.UnsupportedError`: no filesystem it can mount gives a hard bound on the
host disk (a directory upper is bounded by nothing; fuse2fs is not installed and would run the
filesystem in the caller's own process), and project quotas need root too.

The template cache cannot leak between runs: the template is written once by mke2fs and only
read afterwards (never mounted, never given to a sandbox); each run gets its own copy.

Sources: loop(4) (LOOP_CTL_GET_FREE, LOOP_CONFIGURE, LO_FLAGS_AUTOCLEAR), open(2) O_TMPFILE,
lseek(2) SEEK_DATA, copy_file_range(2), mke2fs(8) / ext4(5) (lazy_itable_init, noinit_itable),
overlayfs.rst (trusted.overlay.* xattrs: ext4 has them).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import select
import shutil
import stat
import subprocess
import threading
from dataclasses import dataclass

from lowlevel.errors import LaunchError, UnsupportedError, WorkspaceError
from lowlevel.host import later as _later
from lowlevel.spec.limits import MIN_DISK_UPPER_BYTES

#: Environment variable naming the directory the disk uppers' unnamed files go in.
UPPER_DIR_ENV = "LOWLEVEL_UPPER_DIR"
#: Its default: FHS's temporary files kept on disk.
DEFAULT_UPPER_DIR = "/var/tmp"
#: Bytes of the bound per inode (mke2fs -N): 1/32 of the bound goes to 256-byte inode tables,
#: which mke2fs does not write (lazy_itable_init) and the mount does not zero (noinit_itable).
BYTES_PER_INODE = 8192

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4
_LO_FLAGS_DIRECT_IO = 16
_FS_MEMORY = {"tmpfs", "ramfs", "devtmpfs"}  # devtmpfs: a tmpfs (/dev)


class _LoopInfo64(ctypes.Structure):
    _fields_ = [("lo_device", ctypes.c_uint64), ("lo_inode", ctypes.c_uint64), ("lo_rdevice", ctypes.c_uint64),
                ("lo_offset", ctypes.c_uint64), ("lo_sizelimit", ctypes.c_uint64), ("lo_number", ctypes.c_uint32),
                ("lo_encrypt_type", ctypes.c_uint32), ("lo_encrypt_key_size", ctypes.c_uint32),
                ("lo_flags", ctypes.c_uint32), ("lo_file_name", ctypes.c_uint8 * 64),
                ("lo_crypt_name", ctypes.c_uint8 * 64), ("lo_encrypt_key", ctypes.c_uint8 * 32),
                ("lo_init", ctypes.c_uint64 * 2)]


class _LoopConfig(ctypes.Structure):
    """``struct loop_config`` (linux/loop.h)."""
    _fields_ = [("fd", ctypes.c_uint32), ("block_size", ctypes.c_uint32), ("info", _LoopInfo64),
                ("reserved", ctypes.c_uint64 * 8)]


@dataclass(frozen=True)
class DiskUpper:
    """A run's disk upper: a bound loop device holding a fresh ext4.

    Attributes:
        fd: O_RDWR|O_CLOEXEC fd of the loop device (``/dev/loopN``); the caller closes it once
            the anchor has its own copy (the device clears itself at its last close or unmount).
        device: ``/dev/loopN`` (for notes and tests).
        size: the bound, bytes (the image's size: the most host disk the run can use).
        directory: where the unnamed backing file lives.
    """

    fd: int
    device: str
    size: int
    directory: str


def inodes_for(size: int) -> int:
    """Inode count of a disk upper of ``size`` bytes (the bound on files and dirs)."""
    return max(1024, size // BYTES_PER_INODE)


def upper_dir() -> str:
    """The directory disk uppers' unnamed files go in: ``$LOWLEVEL_UPPER_DIR`` or /var/tmp.

    Raises:
        WorkspaceError: it is missing, not a directory, on a tmpfs/ramfs/devtmpfs (which would
            put the "disk" upper back in RAM) or on FUSE (a daemon would serve the image root
            mounts): set LOWLEVEL_UPPER_DIR to a directory on disk.
    """
    path = os.environ.get(UPPER_DIR_ENV) or DEFAULT_UPPER_DIR
    try:
        st = os.stat(path)
    except OSError as err:
        raise WorkspaceError(err.errno, f"the disk upper's directory {path} is unusable: {err.strerror}; "
                             f"set {UPPER_DIR_ENV} to a directory on disk") from err
    if not stat.S_ISDIR(st.st_mode):
        raise WorkspaceError(errno.ENOTDIR, f"the disk upper's directory {path} is not a directory: "
                             f"set {UPPER_DIR_ENV} to a directory on disk")
    fstype = _fstype(st.st_dev)
    if fstype in _FS_MEMORY:
        raise WorkspaceError(errno.EINVAL, f"the disk upper's directory {path} is on a {fstype} (RAM): "
                             f"set {UPPER_DIR_ENV} to a directory on disk")
    if fstype is not None and (fstype == "fuse" or fstype.startswith(("fuse.", "fuseblk"))):
        # Its bytes come from a user-space daemon, maybe another user's (allow_other): the ext4
        # we mount would be an image someone else writes, even while mounted (the loop device's
        # direct I/O reads it again each time). Mounting untrusted ext4 images is not safe.
        raise WorkspaceError(errno.EINVAL, f"the disk upper's directory {path} is on a {fstype} (FUSE: its "
                             f"daemon serves the ext4 image's blocks): set {UPPER_DIR_ENV} to a directory on "
                             "a local disk filesystem")
    return path


def _fstype(dev: int) -> str | None:
    """The filesystem type of device ``dev`` from /proc/self/mountinfo (proc(5)), or None."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        return None
    return None


def check_caller(caller_is_root: bool) -> None:
    """Refuse a disk upper to an unprivileged caller (see the module docstring for why).

    Raises:
        UnsupportedError: feature ``"disk-upper"``.
    """
    if not caller_is_root:
        raise UnsupportedError(
            "disk-upper", "Limits.upper='disk' needs a root caller: a loop device (loop(4), CAP_SYS_ADMIN) and an "
            "ext4 mount (not mountable in a user namespace) are the only hard bound on host disk here, and an "
            "unprivileged caller can have neither; nothing was run",
            "leave upper='tmpfs' (the default; bound it in RAM with memory_bytes under a cgroup), or run as root")


_templates: dict[tuple[int, int, int], int] = {}
_template_lock = threading.Lock()


def _template(size: int, inodes: int, directory: str, dev: int) -> int:
    """An O_TMPFILE fd (read-only use) holding a fresh ext4 of ``size`` bytes, ``inodes`` inodes,
    made by mke2fs in ``directory`` once per key in this process. Keyed by ``dev``, the
    filesystem the run's file is on, not by the path: copy_file_range(2) copies within one
    filesystem only, and a path (a symlink, a mount point) can name another one later (that was
    "cannot prepare the sandbox: Invalid cross-device link")."""
    key = (size, inodes, dev)
    with _template_lock:
        fd = _templates.get(key)
        if fd is not None:
            return fd
        mkfs = shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin:/bin")
        if mkfs is None:
            raise UnsupportedError("disk-upper", "Limits.upper='disk' needs mkfs.ext4, which is not installed",
                                   "install e2fsprogs, or leave upper='tmpfs'")
        fd = _open_unnamed(directory)
        try:
            os.ftruncate(fd, size)
            # No journal (the upper is discarded with the run; a crash loses nothing of value),
            # no resize inode (it never grows; its reserved GDT blocks were 512 of the 584 KiB
            # each run copied and the loop device's direct I/O flushed to disk at 1 GiB: 72 now),
            # 4 KiB blocks (the loop device's direct I/O block size), no reserved blocks, no
            # zeroing now or later (lazy_*_init here, noinit_itable at mount). inline_data: an
            # empty directory takes no block, so a Session's RESET (mkdir upper.N, work.N and
            # overlayfs's work/) succeeds on an upper the run filled, as on a tmpfs (whose
            # directories take no pages); without it every commit after a full write failed
            # with ENOSPC. Reserved blocks cannot stand in: overlayfs writes with its mounter's
            # credentials (root), which may use them.
            done = subprocess.run(
                [mkfs, "-q", "-F", "-b", "4096", "-m", "0", "-N", str(inodes),
                 "-O", "^has_journal,^resize_inode,inline_data",
                 "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", f"/proc/self/fd/{fd}"],
                pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                check=False)
            if done.returncode != 0:
                raise WorkspaceError(errno.EIO, f"mkfs.ext4 of the disk upper failed: "
                                     f"{done.stderr.decode(errors='replace').strip()[:200]}")
        except BaseException:
            os.close(fd)
            raise
        _templates[key] = fd
        return fd


def _open_unnamed(directory: str) -> int:
    """An unnamed O_TMPFILE in ``directory`` (O_RDWR, O_CLOEXEC, 0600).

    Raises:
        WorkspaceError: the directory cannot hold one (a read-only filesystem, one without
            O_TMPFILE such as vfat or NFSv3, no write permission): set LOWLEVEL_UPPER_DIR.
    """
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise WorkspaceError(err.errno, f"the disk upper's directory {directory} cannot hold its unnamed file "
                             f"(open O_TMPFILE: {err.strerror}): set {UPPER_DIR_ENV} to a writable directory "
                             "on a disk filesystem (ext4, xfs, btrfs)") from err


def _copy_sparse(src: int, dst: int) -> None:
    """Copy ``src``'s data extents into ``dst`` at the same offsets (holes stay holes)."""
    off = 0
    while True:
        try:
            data = os.lseek(src, off, os.SEEK_DATA)
        except OSError as err:
            if err.errno == errno.ENXIO:  # no data past off
                return
            raise
        hole = os.lseek(src, data, os.SEEK_HOLE)
        pos = data
        while pos < hole:
            n = os.copy_file_range(src, dst, hole - pos, pos, pos)
            if n <= 0:
                raise OSError(errno.EIO, "copy_file_range copied nothing")
            pos += n
        off = hole


def _bind_loop(file_fd: int) -> tuple[int, str]:
    """Bind a free loop device to ``file_fd`` with AUTOCLEAR in one LOOP_CONFIGURE."""
    cfg = _LoopConfig()
    cfg.fd = file_fd
    cfg.block_size = 4096
    cfg.info.lo_flags = _LO_FLAGS_AUTOCLEAR | _LO_FLAGS_DIRECT_IO
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as err:
        raise UnsupportedError("disk-upper", f"Limits.upper='disk' needs /dev/loop-control: {err.strerror}",
                               "load the loop module (modprobe loop), or leave upper='tmpfs'") from err
    try:
        for _attempt in range(64):
            number = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
            device = f"/dev/loop{number}"
            try:
                dev = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError as err:
                raise UnsupportedError("disk-upper", f"Limits.upper='disk': the kernel made loop device {number} but "
                                       f"{device} does not exist (/dev is not a devtmpfs?)",
                                       "mount devtmpfs on /dev, or leave upper='tmpfs'") from err
            try:
                fcntl.ioctl(dev, _LOOP_CONFIGURE, bytes(cfg))
            except OSError as err:
                os.close(dev)
                if err.errno == errno.EBUSY:  # another process took it between the two calls
                    continue
                if err.errno in (errno.ENOTTY, errno.EINVAL):
                    raise UnsupportedError("disk-upper", "Limits.upper='disk' needs LOOP_CONFIGURE (Linux 5.8): "
                                           "without it a bound loop device would exist for a moment with no "
                                           "AUTOCLEAR", "leave upper='tmpfs'") from err
                raise
            return dev, device
        raise LaunchError("no free loop device after 64 tries (others keep taking them): run again",
                          errno=errno.EBUSY)
    finally:
        os.close(ctl)


def open_disk_upper(size: int) -> DiskUpper:
    """Make a run's disk upper of ``size`` bytes (the bound): see the module docstring.

    Args:
        size: the bound, bytes (``Limits.workspace_bytes``), at least
            :data:`MIN_DISK_UPPER_BYTES`.

    Returns:
        a :class:`DiskUpper` whose ``fd`` the caller owns (O_CLOEXEC).

    Raises:
        WorkspaceError: the directory is unusable or has less than ``size`` bytes free; mkfs failed.
        UnsupportedError: no loop-control, no LOOP_CONFIGURE, no mkfs.ext4.
        LaunchError: no free loop device.
        OSError: another system call failed (the launcher turns it into LaunchError).
    """
    directory = upper_dir()
    vfs = os.statvfs(directory)
    if vfs.f_bavail * vfs.f_frsize < size:
        # Sparse: the check is at start only (concurrent runs share the free space); a full
        # host disk later shows as EIO inside, never as a write past the bound.
        raise WorkspaceError(errno.ENOSPC, f"{directory} has {vfs.f_bavail * vfs.f_frsize} bytes free, less than "
                             f"the disk upper's bound ({size} bytes): lower workspace_bytes or set {UPPER_DIR_ENV}")
    fd = _open_unnamed(directory)
    try:
        template = _template(size, inodes_for(size), directory, os.fstat(fd).st_dev)
        os.ftruncate(fd, size)
        _copy_sparse(template, fd)
        dev, device = _bind_loop(fd)
    finally:
        os.close(fd)  # the loop device holds the file now (or nothing does: it is freed)
    return DiskUpper(fd=dev, device=device, size=size, directory=directory)


#: Longest wait for the anchor's exit before the close goes ahead anyway, seconds.
_ANCHOR_EXIT_WAIT_S = 30.0


def _close_after(fd: int, pidfd: int | None) -> None:
    try:
        if pidfd is not None:
            select.select([pidfd], [], [], _ANCHOR_EXIT_WAIT_S)  # readable: the anchor exited
            os.close(pidfd)
        os.close(fd)
    except OSError:
        pass


def close_later(fd: int, anchor_pid: int | None) -> None:
    """Close ``fd``, the caller's reference to a disk upper's mount, on a worker thread, once the
    anchor ``anchor_pid`` (our child, not yet reaped; None: gone already) has exited.

    The last reference's drop unmounts the ext4 (its superblock written through the loop device)
    and clears the loop device (a queue freeze: an RCU grace period): 10-40 ms of mostly waiting
    on this shared VM (bench/README.md "Disk-backed upper"). Held until the anchor has exited, our
    fd is that last reference, so neither the anchor's exit (which the caller reaps, waiting)
    nor the caller pays it; the worker does. Nothing of the run is reachable through the fd any
    more (the commit is done), and if the process dies first the kernel closes it the same way.
    The workers are :mod:`lowlevel.host.later`'s (the one-shot teardown's too: its ``drain``
    waits for these closes; done before exit); where it cannot take the close (no thread, the
    interpreter exiting) ``fd`` is closed here at once and the anchor's exit pays the unmount.
    """
    pidfd: int | None = None
    if anchor_pid is not None:
        try:
            pidfd = os.pidfd_open(anchor_pid)
        except OSError:
            pidfd = None  # reaped already (or no pidfd_open): nothing to wait for
    if not _later.defer(functools.partial(_close_after, fd, pidfd), slow=True):
        _close_after(fd, None)
        if pidfd is not None:
            os.close(pidfd)


def check_writeback(upper_fd: int) -> None:
    """Before a commit: flush the disk upper (``syncfs(2)`` on ``upper_fd``, a directory fd of the
    ext4 opened before the program ran) and refuse it when a write back to the loop device failed.

    The backing file is sparse: the free-space check is at start only, so a host disk that fills
    during the run fails the loop device's writes (EIO, the ext4's "lost async page write") while
    the program's buffered ``write(2)`` calls had succeeded; the lost pages then read back as
    zeros or stale data, and a commit would put corrupted files in the workspace with no error
    (found by a run writing 40 MB while its upper directory's filesystem filled: exit 0, the
    committed file's hash differed). ``syncfs`` returns the superblock's writeback error recorded
    since ``upper_fd`` was opened (Linux 5.8, errseq: the program's own fsync/syncfs cannot hide
    it from this fd). Sources: syncfs(2) "ERRORS", Documentation/filesystems/vfs.rst (errseq).

    Raises:
        WorkspaceError: EIO (or syncfs's errno): nothing was committed.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syncfs(upper_fd) != 0:
        code = ctypes.get_errno()
        where = os.environ.get(UPPER_DIR_ENV) or DEFAULT_UPPER_DIR
        raise WorkspaceError(code, f"the disk upper lost writes ({os.strerror(code)}): its unnamed file in "
                             f"{where} could not grow (that filesystem is full?); the run's changes are not "
                             f"committed (they may be corrupt): free space there, lower workspace_bytes or set "
                             f"{UPPER_DIR_ENV}")


def doctor_check() -> tuple[bool, str, str]:
    """``lowlevel doctor``'s "disk upper" line: ``(works, detail, fix)``, from a real 8 MiB disk
    upper made and dropped (a loop device bound and cleared; its mke2fs template is cached)."""
    if os.geteuid() != 0:
        return (False, "Limits.upper='disk' needs a root caller (a loop device and an ext4 mount): "
                "runs here use the tmpfs upper", "run as root for large outputs on disk")
    try:
        upper = open_disk_upper(MIN_DISK_UPPER_BYTES)
    except (UnsupportedError, WorkspaceError, LaunchError, OSError) as err:
        return (False, f"Limits.upper='disk' is unavailable: {err}", getattr(err, "fix", "") or
                f"set {UPPER_DIR_ENV} to a directory on disk, or leave upper='tmpfs'")
    os.close(upper.fd)
    return (True, f"Limits.upper='disk' works: ext4 on a loop device per run, its unnamed sparse file in "
            f"{upper.directory}", "")


def backing_files() -> dict[str, str]:
    """Bound loop devices and their backing files (``/sys/block/loop*/loop/backing_file``):
    what a test or ``lowlevel doctor`` checks is empty of ours. ``{"loop3": "/var/tmp/#123 (deleted)"}``."""
    found: dict[str, str] = {}
    try:
        names = os.listdir("/sys/block")
    except OSError:
        return found
    for name in names:
        if name.startswith("loop"):
            try:
                with open(f"/sys/block/{name}/loop/backing_file") as f:
                    found[name] = f.read().strip()
            except OSError:
                continue
    return found


__all__ = ["DEFAULT_UPPER_DIR", "MIN_DISK_UPPER_BYTES", "UPPER_DIR_ENV", "DiskUpper", "backing_files",
           "check_caller", "check_writeback", "close_later", "doctor_check", "inodes_for", "open_disk_upper",
           "upper_dir"]
