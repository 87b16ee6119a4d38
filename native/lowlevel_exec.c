/* lowlevel_exec: the anchor between the caller and bwrap. Every sandbox runs below one.
 *
 *     _lowlevel_exec --parent=PID [OPTIONS] -- /abs/path/bwrap ARGS...
 *
 * What it guarantees (issue: "a program never runs without its supervisor"):
 *
 *   1. It dies with the caller at any instant: PR_SET_PDEATHSIG(SIGKILL), then it checks that
 *      its parent is still PID (the caller may have died before the prctl). The parent-death
 *      signal is re-armed after every credential change, which clears it (prctl(2)).
 *   2. Everything of the sandbox dies with it: bwrap runs as PID 1 of a PID namespace the
 *      anchor creates; bwrap has its own PR_SET_PDEATHSIG (armed by the anchor's child before
 *      exec, and checked then: the "go" byte outlives a dead anchor in its pipe, see
 *      anchor_alive(); and --die-with-parent), and when the PID 1 of a namespace dies the kernel kills
 *      every process in it and in the namespaces below (pid_namespaces(7)). So no instant
 *      exists at which the caller's death leaves a process of the sandbox alive, including
 *      bwrap's child blocked in its setup (which --die-with-parent alone does not cover).
 *   3. Limits are in force before any process of the sandbox exists: the anchor joins the
 *      run's cgroup v1 hierarchies (writes "0" to each fd it is given: the "tasks" file), bwrap
 *      is born in the run's cgroup v2 (clone3(CLONE_INTO_CGROUP)), and the anchor's child sets
 *      the rlimits before exec'ing bwrap. No --block-fd handshake: nothing can let the program
 *      start early (bwrap reads EOF on --block-fd as "go").
 *      Why "tasks" and CLONE_INTO_CGROUP, never a write to cgroup.procs: moving a whole process
 *      takes cgroup_threadgroup_rwsem for writing, whose rcu_sync_enter() waits for a full RCU
 *      grace period (measured 8.7 ms p50 here, bench/README.md); a thread moving itself (v1
 *      "tasks", pid 0) skips that lock, and a process born in its cgroup is never moved
 *      (kernel/cgroup/cgroup.c cgroup_procs_write_start, cgroup_css_set_fork; clone(2)).
 *   4. The caller gets, over a SOCK_SEQPACKET socket (--report-fd), a READY message carrying
 *      (SCM_RIGHTS) a pidfd of bwrap (PID 1 of the namespace: readable only once every process
 *      of the sandbox is gone) and, with an overlay, an fd on the run's upper directory. bwrap
 *      is exec'd only after READY is sent.
 *
 * Copy-on-write workspace (--mnt): in a private mount namespace (propagation to the host cut
 * with MS_REC|MS_PRIVATE), a sized tmpfs is mounted on --mnt (an existing empty directory;
 * the mount exists only in this namespace) holding:
 *      upper/  work/   the overlay's upper and work directories (the run's writes: bounded)
 *      lower/  (root callers) an idmapped clone of the workspace: open_tree(OPEN_TREE_CLONE)
 *              of --lower-fd, mount_setattr(MOUNT_ATTR_IDMAP | RDONLY | NOSUID | NODEV) with
 *              a user namespace mapping the workspace's owner to the sandbox's uid/gid
 *              (--idmap), move_mount here. The user's files never change owner or mode.
 *              With --empty-lower (a fresh, empty workspace): an empty directory instead.
 *      ws/     the overlay: lowerdir=lower (or /proc/self/fd/N for unprivileged callers, in
 *              their own user namespace, with "userxattr"), redirect_dir=off, metacopy=off,
 *              index=off, xino=off, nosuid, nodev. bwrap binds MNT/ws at /workspace.
 * ws/ is made MS_SHARED so that a reset (a new overlay stacked on it, RESET below) propagates
 * into bwrap's copy at /workspace.
 * Sources: overlayfs.rst (upper/lower/whiteout, userxattr since 5.11, idmapped layers since
 * 5.19), mount_setattr(2), open_tree(2), move_mount(2), shared-subtree.rst, tmpfs(5).
 *
 * Options:
 *   --parent=PID          required: the caller's PID (the anchor checks getppid() == PID)
 *   --cgroup-fd=N         an O_WRONLY cgroup v1 "tasks" (or cgroup.procs) fd: the anchor joins
 *                         it (writes "0": itself, single-threaded); repeatable
 *   --cgroup-dir-fd=N     an O_DIRECTORY fd of the run's cgroup v2 directory: bwrap is created
 *                         in it with clone3(CLONE_INTO_CGROUP) (Linux 5.7); where clone3 lacks
 *                         it, the child writes "0" to its cgroup.procs before anything else
 *   --rlimit=NAME=S:H     setrlimit(2) in the child before bwrap (S, H decimal or "unlimited")
 *   --uid=U --gid=G       (root callers) bwrap runs as U/G: setgroups(0), setresgid,
 *                         setresuid, verified; the anchor itself stays root, in its own
 *                         namespaces, reachable only through --report-fd
 *   --userns              (unprivileged callers) first unshare a user namespace mapping the
 *                         caller's uid/gid to themselves (needed for the PID and mount ones)
 *   --report-fd=N         the SOCK_SEQPACKET socket to the caller (READY, RESET, RESET_OK)
 *   --keep-fd=N           an fd the anchor holds for its life and never passes on (a lease)
 *   --pass-fds=A,B,...    the fds bwrap gets (besides 0-2); every other inherited fd is closed
 *                         first thing (close_range(2)): a leaked directory fd is a way out of
 *                         any mount namespace, and posix_spawn cannot close fds above the
 *                         caller's RLIMIT_NOFILE
 *   --mnt=PATH --lower-fd=N --upper-bytes=B --upper-inodes=I [--idmap=OUID:OGID]
 *   [--root-lower-fd=N [--root-lower-path=PATH]]  Policy.rootfs_writable: a second overlay at
 *                         <mnt>/root over that tree (idmapped for root callers; re-opened by
 *                         path and checked with --userns), its upper on the same tmpfs
 *   [--lower-path=PATH]   the copy-on-write workspace above; with --userns, --lower-path is
 *                         opened again in the new mount namespace and must be the same
 *                         directory (st_dev, st_ino) as --lower-fd
 *   --deadline-ns=T       the run's wall-clock deadline (plus the caller's grace), absolute
 *                         CLOCK_MONOTONIC nanoseconds (the caller's clock: one clock per boot,
 *                         no time namespace here). At T the anchor SIGKILLs bwrap, the PID 1 of
 *                         the sandbox's PID namespace (the kernel then kills every process in
 *                         it: pid_namespaces(7)), whether or not the caller is running: a
 *                         stopped (SIGSTOP), stuck or overloaded caller cannot extend a run.
 *                         A timerfd (timerfd_create(2), TFD_TIMER_ABSTIME) in the wait loop.
 *   [--upper-dev-fd=N]    (root callers, with --mnt) an O_RDWR fd of a loop block device holding
 *                         a fresh ext4: mounted on --mnt instead of the tmpfs (a disk upper,
 *                         bounded by the device's size; --upper-bytes/--upper-inodes unused)
 *   [--empty-lower]       the workspace is fresh and empty (a one-shot run): the lower layer
 *                         is an empty directory of the tmpfs, no idmapped clone (--lower-fd is
 *                         still the workspace: the merged root takes its owner and mode, and
 *                         the caller commits into it); RESET is refused
 *
 * Messages on --report-fd (text, one per record):
 *   anchor -> caller  "READY <flags>" + SCM_RIGHTS [bwrap pidfd, upper fd (overlay only)]
 *   caller -> anchor  "RESET"   stack a fresh overlay (new upper) on ws/; previous stacked
 *                               one unmounted first (propagates into the sandbox) and its
 *                               directories removed (the caller emptied its upper before
 *                               sending RESET), the first one's cached entries dropped
 *   anchor -> caller  "RESET_OK" + SCM_RIGHTS [new upper fd], or "RESET_ERR <message>"
 *   anchor -> caller  "EXIT <wait status> <maxrss> <end ns> <flags>" once bwrap is reaped (the
 *                     sandbox is gone), before the anchor's own exit: bwrap's wait(2) status,
 *                     the largest ru_maxrss (KiB) of bwrap and what it waited for, the
 *                     CLOCK_MONOTONIC time (ns) bwrap was reaped at (the run's end, measured
 *                     here: a stopped caller's own clock reading would include its stop), and
 *                     flags: 1 = the anchor killed the sandbox at --deadline-ns
 *
 * Fails closed: any failing call before bwrap's exec prints one line naming the call to stderr
 * and exits 125 (the child: 125 too, or 127 when execv fails); nothing of the sandbox starts.
 * Afterwards the anchor waits for bwrap and exits with its status (128+N for signal N).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <time.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lowlevel_errtext.h"

#define EXIT_SETUP 125
#define EXIT_EXEC 127
#define MAX_RLIMITS 16
#define MAX_FDS 16

#ifndef MOUNT_ATTR_IDMAP
#define MOUNT_ATTR_IDMAP 0x00100000
#endif
#ifndef MOUNT_ATTR_RDONLY /* linux/mount.h; musl's sys/mount.h has none of the MOUNT_ATTR_ flags */
#define MOUNT_ATTR_RDONLY 0x00000001
#define MOUNT_ATTR_NOSUID 0x00000002
#define MOUNT_ATTR_NODEV 0x00000004
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef FSPICK_CLOEXEC
#define FSPICK_CLOEXEC 0x00000001
#endif
#ifndef FSCONFIG_CMD_RECONFIGURE
#define FSCONFIG_CMD_RECONFIGURE 7
#endif
#ifndef SYS_fspick
#define SYS_fspick 433
#endif
#ifndef SYS_fsconfig
#define SYS_fsconfig 431
#endif
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef SYS_clone3
#define SYS_clone3 435
#endif

/* struct clone_args up to .cgroup (CLONE_ARGS_SIZE_VER2, Linux 5.7). */
struct ll_clone_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size, cgroup;
};

/* fork(), into the cgroup v2 directory cg_dir when it is >= 0. The child of a raw clone3 runs
 * only async-signal-safe code before its exec (as after fork). Returns -1 with errno; sets
 * *joined when the kernel placed the child in cg_dir (else the child must join itself). */
static pid_t fork_into(int cg_dir, int *joined) {
    *joined = 0;
    if (cg_dir >= 0) {
        struct ll_clone_args args;
        memset(&args, 0, sizeof args);
        args.flags = CLONE_INTO_CGROUP;
        args.exit_signal = SIGCHLD;
        args.cgroup = (uint64_t)cg_dir;
        long pid = syscall(SYS_clone3, &args, sizeof args);
        if (pid >= 0) {
            *joined = 1;
            return (pid_t)pid;
        }
        /* Older kernels: no clone3 (ENOSYS), or a struct it does not know (E2BIG/EINVAL). */
        if (errno != ENOSYS && errno != E2BIG && errno != EINVAL)
            return -1;
    }
    return fork();
}

struct ll_mount_attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

static const struct {
    const char *name;
    int resource;
} RLIMITS[] = {
    {"RLIMIT_CPU", RLIMIT_CPU},     {"RLIMIT_AS", RLIMIT_AS},         {"RLIMIT_DATA", RLIMIT_DATA},
    {"RLIMIT_NPROC", RLIMIT_NPROC}, {"RLIMIT_FSIZE", RLIMIT_FSIZE},   {"RLIMIT_NOFILE", RLIMIT_NOFILE},
    {"RLIMIT_CORE", RLIMIT_CORE},
};

static void die(const char *what, const char *arg) {
    int err = errno;
    fprintf(stderr, "lowlevel_exec: %s%s%s%s%s\n", what, arg ? " " : "", arg ? arg : "", err ? ": " : "",
            err ? ll_strerror(err) : "");
    _exit(EXIT_SETUP);
}

static void dief(const char *fmt, const char *a, const char *b) {
    char buf[PATH_MAX + 256];
    int err = errno;
    snprintf(buf, sizeof buf, fmt, a ? a : "", b ? b : "");
    errno = err;
    die(buf, NULL);
}

/* Decimal digits only (no sign, no spaces), or "unlimited". */
static int parse_limit(const char *s, rlim_t *out) {
    if (strcmp(s, "unlimited") == 0) {
        *out = RLIM_INFINITY;
        return 0;
    }
    if (*s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v == (unsigned long long)RLIM_INFINITY)
        return -1;
    *out = (rlim_t)v;
    return 0;
}

/* Decimal number 0 <= v <= max. */
static int parse_num(const char *s, unsigned long long max, unsigned long long *out) {
    if (*s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        return -1;
    *out = v;
    return 0;
}

static unsigned int need_id(const char *opt, const char *s) {
    unsigned long long v;
    /* (uid_t)-1 means "unchanged" to setresuid: refused. */
    if (parse_num(s, (unsigned long long)(uid_t)-2, &v))
        die("bad option", opt);
    return (unsigned int)v;
}

static int need_fd(const char *opt, const char *s) {
    unsigned long long v;
    if (parse_num(s, INT_MAX, &v) || v < 3)
        die("bad option", opt);
    if (fcntl((int)v, F_GETFD) < 0)
        die("fd not open", opt);
    return (int)v;
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Close every fd >= 3 that is not in keep[0..n) (sorted in place). */
static void close_others(int *keep, int n) {
    qsort(keep, n, sizeof *keep, cmp_int);
    unsigned int lo = 3;
    for (int k = 0; k <= n; k++) {
        unsigned int hi = k < n ? (unsigned int)keep[k] : ~0U;
        if (k < n && keep[k] < 3)
            continue;
        if (hi > lo) {
            if (syscall(SYS_close_range, lo, hi - 1, 0) != 0) {
                /* close_range(2) is Linux 5.9+: close one by one up to a sane bound. */
                unsigned int top = hi - 1 < 65536 ? hi - 1 : 65535;
                for (unsigned int fd = lo; fd <= top; fd++)
                    close((int)fd);
            }
        }
        if (k < n)
            lo = (unsigned int)keep[k] + 1;
    }
}

static void write_file(const char *path, const char *data) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        die("open", path);
    ssize_t n = write(fd, data, strlen(data));
    if (n != (ssize_t)strlen(data))
        dief("write %s: \"%s\"", path, data);
    close(fd);
}

static void arm_pdeathsig(pid_t parent) {
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
        die("prctl", "(PR_SET_PDEATHSIG, SIGKILL)");
    if (parent > 0 && getppid() != parent) {
        errno = 0;
        die("the caller exited before the sandbox started", NULL);
    }
}

/* After the child's PR_SET_PDEATHSIG: is the anchor still alive? The "go" byte outlives its
 * writer in the pipe, so reading "g" proves nothing: an anchor killed after writing it, before
 * the child's prctl ran (a child not yet scheduled on a loaded host), sends no parent-death
 * signal, and bwrap would run orphaned (seen: bwrap, the guard and the program left running,
 * reparented to init, by tests/integration/test_caller_death.py at load ~10). getppid() cannot
 * tell (the child is PID 1 of its namespace: its parent reads as 0 either way), so the child asks
 * the pipe: a non-blocking read of the (now empty) pipe fails with EAGAIN while the anchor holds
 * the write end, and returns 0 (EOF) once it is closed. Sound because both sides order through the
 * pipe's mutex: the anchor's exit closes its fds (pipe_release, under the mutex) before
 * exit_notify() sends the parent-death signals, and our prctl precedes this read (under the same
 * mutex); so either the read sees EOF, or the anchor's exit sees our parent-death signal armed.
 * Sources: prctl(2) PR_SET_PDEATHSIG; pipe(7) ("all file descriptors referring to the write end
 * ... closed: read(2) sees end-of-file"); kernel/exit.c do_exit (exit_files, exit_task_work,
 * then exit_notify). */
static int anchor_alive(int go_fd) {
    char b;
    int fl = fcntl(go_fd, F_GETFL);
    if (fl < 0 || fcntl(go_fd, F_SETFL, fl | O_NONBLOCK) != 0)
        return 0;
    ssize_t n;
    do
        n = read(go_fd, &b, 1);
    while (n < 0 && errno == EINTR);
    return n < 0 && errno == EAGAIN;
}

/* Send a text message with up to two fds. */
static int send_msg(int sock, const char *text, const int *fds, int nfds) {
    struct iovec iov = {.iov_base = (void *)text, .iov_len = strlen(text)};
    union {
        char buf[CMSG_SPACE(sizeof(int) * 4)];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
        memset(&u, 0, sizeof u);
        msg.msg_control = u.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
    }
    ssize_t n;
    do
        n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n < 0 ? -1 : 0;
}

/* ---- copy-on-write workspace ------------------------------------------------------------ */

struct overlay {
    const char *mnt;   /* host dir the tmpfs is mounted on (in our mount namespace) */
    int lower_fd;      /* the workspace (O_PATH or O_DIRECTORY) */
    unsigned long long bytes, inodes;
    int idmap;         /* root callers: map owner -> uid/gid */
    unsigned int owner_uid, owner_gid, uid, gid;
    int userxattr;     /* unprivileged: "userxattr" overlay */
    int generation;    /* upper.N / work.N of the current overlay */
    int tree_fd;       /* root callers: a detached clone of the workspace's mount (open_tree) */
    const char *lower_path; /* unprivileged callers: the workspace's path, opened again in the
                             * new mount namespace (overlay refuses a lower of another one) */
    int stacked;       /* a reset overlay sits on top of the first one */
    int root_fd;       /* --root-lower-fd: a root filesystem tree made writable per run, or -1 */
    const char *root_path; /* unprivileged callers: its path, opened again in the new namespace */
    int root_tree;     /* root callers: a detached clone of root_fd's mount (open_tree), or -1 */
    int empty_lower;   /* --empty-lower: the lower layer is an empty directory of the tmpfs */
    int dev_fd;        /* --upper-dev-fd: a loop device holding a fresh ext4 (disk upper), or -1 */
};

static void path_in(char *out, size_t size, const struct overlay *o, const char *name) {
    if ((size_t)snprintf(out, size, "%s/%s", o->mnt, name) >= size) {
        errno = ENAMETOOLONG;
        die("path too long", o->mnt);
    }
}

/* Errors of the overlay steps: setup dies with them; a RESET reports them to the caller. */
static char ov_error[6 * PATH_MAX];

static int fail(const char *what, const char *arg) {
    int err = errno;
    snprintf(ov_error, sizeof ov_error, "%s%s%s%s%s", what, arg ? " " : "", arg ? arg : "", err ? ": " : "",
             err ? ll_strerror(err) : "");
    errno = err;
    return -1;
}

/* A user namespace whose maps are "OUID UID 1" / "OGID GID 1", for MOUNT_ATTR_IDMAP: made by a
 * child cloned straight into a new user namespace (clone(CLONE_NEWUSER)), sharing our memory
 * (CLONE_VM: no page tables to copy) and running nothing but pause() on a stack of its own. The
 * namespace exists when clone returns, so we write its maps at once (no handshake: one process
 * hand-off less, ~1 ms on a busy host), open /proc/CHILD/ns/user, then kill and reap it. Its
 * parent-death signal covers our death in between. Source: clone(2), user_namespaces(7). */
static char idmap_stack[16384] __attribute__((aligned(64)));
static pid_t idmap_parent;

static int idmap_child(void *arg) {
    (void)arg;
    /* Only raw system calls: we share the anchor's memory (and glibc's errno) while it runs. */
    syscall(SYS_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    if (syscall(SYS_getppid) != idmap_parent)
        syscall(SYS_exit, 1);
    for (;;)
        syscall(SYS_pause);
    return 0;
}

static int idmap_userns(const struct overlay *o) {
    idmap_parent = getpid();
    pid_t child = clone(idmap_child, idmap_stack + sizeof idmap_stack, CLONE_VM | CLONE_NEWUSER | SIGCHLD, NULL);
    if (child < 0)
        die("clone", "(CLONE_NEWUSER, for the idmapped workspace)");
    char path[64], map[64];
    snprintf(path, sizeof path, "/proc/%d/uid_map", (int)child);
    snprintf(map, sizeof map, "%u %u 1\n", o->owner_uid, o->uid);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/gid_map", (int)child);
    snprintf(map, sizeof map, "%u %u 1\n", o->owner_gid, o->gid);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/ns/user", (int)child);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("open", path);
    kill(child, SIGKILL);
    int st;
    while (waitpid(child, &st, 0) < 0 && errno == EINTR)
        ;
    return fd;
}

/* The overlay's mount options (ours for every layer we mount): 0, or -1 with ENAMETOOLONG. */
static int overlay_options(char *opts, size_t size, const char *lower, const char *upper, const char *work,
                           int userxattr) {
    int n = snprintf(opts, size,
                     "lowerdir=%s,upperdir=%s,workdir=%s,redirect_dir=nofollow,metacopy=off,index=off,xino=off%s",
                     lower, upper, work, userxattr ? ",userxattr" : "");
    if (n < 0 || (size_t)n >= size) {
        errno = ENAMETOOLONG;
        return -1;
    }
    return 0;
}

/* Move the detached mount ``tree`` (open_tree clone) to ``dest`` (made here), read-only,
 * nosuid, nodev and idmapped by ``map``'s "OWNER -> uid/gid" user namespace. ``what`` names
 * it in errors. Closes ``tree``. */
static void mount_idmapped(int tree, const struct overlay *map, const char *dest, const char *what) {
    if (mkdir(dest, 0755) != 0)
        die("mkdir", dest);
    int userns = idmap_userns(map);
    struct ll_mount_attr attr = {
        .attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        .userns_fd = (uint64_t)userns};
    if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH, &attr, sizeof attr) != 0)
        dief("mount_setattr (%s, MOUNT_ATTR_IDMAP): %s", what, "its filesystem may not support idmapped mounts");
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, dest, MOVE_MOUNT_F_EMPTY_PATH) != 0)
        die("move_mount", dest);
    close(tree);
    close(userns);
}

static int mount_overlay(struct overlay *o, int generation) {
    char upper[PATH_MAX], work[PATH_MAX], lower[PATH_MAX], ws[PATH_MAX], opts[4 * PATH_MAX], name[32];
    struct stat st;
    snprintf(name, sizeof name, "upper.%d", generation);
    path_in(upper, sizeof upper, o, name);
    snprintf(name, sizeof name, "work.%d", generation);
    path_in(work, sizeof work, o, name);
    path_in(ws, sizeof ws, o, "ws");
    if (o->idmap || o->empty_lower)
        path_in(lower, sizeof lower, o, "lower");
    else
        snprintf(lower, sizeof lower, "/proc/self/fd/%d", o->lower_fd);
    /* The merged root takes the upper root's owner and mode: give it the lower root's. */
    if (fstat(o->lower_fd, &st) != 0)
        return fail("fstat", "(workspace)");
    if (mkdir(upper, 0700) != 0 || mkdir(work, 0700) != 0)
        return fail("mkdir", upper);
    if (o->idmap) {
        uid_t u = st.st_uid == o->owner_uid ? o->uid : (uid_t)65534;
        gid_t g = st.st_gid == o->owner_gid ? o->gid : (gid_t)65534;
        if (chown(upper, u, g) != 0)
            return fail("chown", upper);
    }
    if (chmod(upper, st.st_mode & 01777) != 0)
        return fail("chmod", upper);
    if (overlay_options(opts, sizeof opts, lower, upper, work, o->userxattr) != 0)
        return fail("overlay options too long", NULL);
    if (mount("overlay", ws, "overlay", MS_NOSUID | MS_NODEV, opts) != 0) {
        int err = errno;
        snprintf(ov_error, sizeof ov_error, "mount overlay on %.*s (%.*s): %s", PATH_MAX, ws, PATH_MAX, opts,
                 ll_strerror(err));
        errno = err;
        return -1;
    }
    if (generation == 0 && mount(NULL, ws, NULL, MS_SHARED, NULL) != 0)
        return fail("make shared", ws);
    o->generation = generation;
    return 0;
}

static int open_upper(const struct overlay *o) {
    char upper[PATH_MAX], name[32];
    snprintf(name, sizeof name, "upper.%d", o->generation);
    path_in(upper, sizeof upper, o, name);
    int fd = open(upper, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return fail("open", upper);
    return fd;
}

/* Open ``path`` again (in our new mount namespace: overlay refuses a lower of another one) and
 * check it is ``fd``'s directory (st_dev, st_ino), or die with ``changed``: a parent renamed
 * meanwhile must not swap in another tree. Closes ``fd``; returns the new fd. */
static int reopen_same(const char *path, int fd, const char *changed) {
    struct stat a, b;
    int nfd = open(path, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (nfd < 0)
        die("open", path);
    if (fstat(nfd, &a) != 0 || fstat(fd, &b) != 0)
        die("fstat", path);
    if (a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
        errno = 0;
        die(changed, path);
    }
    close(fd);
    return nfd;
}

/* Policy.rootfs_writable: a second overlay, <mnt>/root, whose lower layer is the root
 * filesystem tree (read-only; for root callers an idmapped clone mapping the tree's owner to
 * the sandbox's ids, so the image's root-owned system is the sandbox's to write) and whose
 * upper layer is root-upper/ on the run's tmpfs (the same size bound as the workspace's:
 * discarded with the mount namespace). bwrap binds its top-level directories. */
static void setup_root_overlay(struct overlay *o) {
    char lower[PATH_MAX], upper[PATH_MAX], work[PATH_MAX], root[PATH_MAX], opts[4 * PATH_MAX];
    path_in(upper, sizeof upper, o, "root-upper");
    path_in(work, sizeof work, o, "root-work");
    path_in(root, sizeof root, o, "root");
    if (mkdir(upper, 0755) != 0 || mkdir(work, 0700) != 0 || mkdir(root, 0755) != 0)
        die("mkdir", upper);
    if (o->root_tree >= 0) {
        struct stat st;
        if (fstat(o->root_fd, &st) != 0)
            die("fstat", "(rootfs)");
        struct overlay map = *o;
        map.owner_uid = st.st_uid;
        map.owner_gid = st.st_gid;
        path_in(lower, sizeof lower, o, "root-lower");
        mount_idmapped(o->root_tree, &map, lower, "rootfs");
        o->root_tree = -1;
    } else {
        snprintf(lower, sizeof lower, "/proc/self/fd/%d", o->root_fd);
    }
    if (overlay_options(opts, sizeof opts, lower, upper, work, o->userxattr) != 0)
        die("overlay options too long", NULL);
    if (mount("overlay", root, "overlay", MS_NOSUID | MS_NODEV, opts) != 0)
        dief("mount overlay on %s (%s)", root, opts);
}

static void setup_overlay(struct overlay *o) {
    char path[PATH_MAX], opts[128];
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
        die("mount", "(/, MS_REC|MS_PRIVATE)");
    if (o->dev_fd >= 0) {
        /* Limits.upper="disk": the caller's loop device (LO_FLAGS_AUTOCLEAR, its backing file
         * an unnamed O_TMPFILE sized to the bound) holding a fresh ext4 instead of the tmpfs
         * (lowlevel/workspace/disk_upper.py). Mounted only in this namespace: when it and the
         * caller's fds are gone the device clears itself and the file's blocks are freed.
         * noinit_itable: no background zeroing of the inode tables (mke2fs lazy_itable_init). */
        snprintf(path, sizeof path, "/proc/self/fd/%d", o->dev_fd);
        if (mount(path, o->mnt, "ext4", MS_NOSUID | MS_NODEV, "noinit_itable") != 0)
            dief("mount ext4 (the disk upper %s) on %s", path, o->mnt);
        close(o->dev_fd);
        o->dev_fd = -1;
    } else {
        snprintf(opts, sizeof opts, "size=%llu,nr_inodes=%llu,mode=0755", o->bytes, o->inodes);
        if (mount("lowlevel-upper", o->mnt, "tmpfs", MS_NOSUID | MS_NODEV, opts) != 0)
            dief("mount tmpfs on %s (%s)", o->mnt, opts);
    }
    path_in(path, sizeof path, o, "ws");
    if (mkdir(path, 0755) != 0)
        die("mkdir", path);
    if (o->empty_lower) {
        /* A fresh, empty workspace: an empty directory shows the same (nothing), without the
         * idmapped clone's user namespace and mount calls (~0.35 ms of CPU per run). */
        path_in(path, sizeof path, o, "lower");
        if (mkdir(path, 0755) != 0)
            die("mkdir", path);
    } else if (o->idmap) {
        path_in(path, sizeof path, o, "lower");
        mount_idmapped(o->tree_fd, o, path, "workspace");
        o->tree_fd = -1;
    }
    if (mount_overlay(o, 0) != 0) {
        errno = 0;
        die(ov_error, NULL);
    }
    if (o->root_fd >= 0)
        setup_root_overlay(o);
}

/* Drop the unused cached dentries (and so inodes) of the overlay on top of ``ws``: a
 * reconfiguration of its superblock (fspick(2) + fsconfig(FSCONFIG_CMD_RECONFIGURE), no option
 * changed), which the kernel begins with shrink_dcache_sb() (fs/super.c reconfigure_super).
 * Why: an overlay inode holds a reference on its upper dentry (fs/overlayfs), and overlay
 * inodes live as long as their cached dentries, which only memory pressure or the unmount
 * frees. The first overlay is never unmounted (bwrap's /workspace is a copy of it), so the
 * files of its upper that the caller clears after a RESET (unlinked in the upper, not through
 * the overlay) kept their blocks and inodes on the run's tmpfs or disk upper, charged to the
 * bound for the session's life: 11 MiB committed left 11 MiB used of a 16 MiB bound (measured,
 * tests/integration/test_session_commit_space.py). After this, nothing pins them: the clear
 * frees them. Best effort: on failure the reset stands and only that space stays charged
 * (the bound is never exceeded either way). */
static void drop_cached_entries(const char *ws) {
    int fs = (int)syscall(SYS_fspick, AT_FDCWD, ws, FSPICK_CLOEXEC);
    if (fs < 0)
        return;
    syscall(SYS_fsconfig, fs, FSCONFIG_CMD_RECONFIGURE, NULL, NULL, 0);
    close(fs);
}

/* Remove the directories of generation ``gen`` (a stacked overlay just unmounted): work.N/work
 * (overlayfs's own), work.N and upper.N, which the caller emptied before its RESET. Otherwise
 * each RESET kept 3 of the bound's inodes for the session's life (1017 free -> 956 after 20
 * resets of a 1 MiB tmpfs upper, measured). Best effort: a command left running across the
 * reset (running="leave") may have written into it again; that stays, as its writes do. */
static void remove_generation(const struct overlay *o, int gen) {
    char path[PATH_MAX], name[32];
    snprintf(name, sizeof name, "work.%d/work", gen);
    path_in(path, sizeof path, o, name);
    rmdir(path);
    snprintf(name, sizeof name, "work.%d", gen);
    path_in(path, sizeof path, o, name);
    rmdir(path);
    snprintf(name, sizeof name, "upper.%d", gen);
    path_in(path, sizeof path, o, name);
    rmdir(path);
}

/* RESET: unmount the stacked overlay (if any) and remove its directories, stack a fresh one
 * on the first. The first one stays below: bwrap's /workspace is a copy of it, so only mounts
 * on top of it propagate. Before the new one is stacked, the first one (then on top of ws/
 * again) drops its cached entries, so that the upper the caller cleared frees its space
 * (drop_cached_entries). The caller clears the old upper before sending RESET: its inodes are
 * free for the new upper.N/work.N when a run has used every one (tmpfs directories take no
 * blocks, nor do the disk upper's: inline_data; but each takes an inode). */
static void reset_overlay(struct overlay *o, int sock) {
    char ws[PATH_MAX], msg[sizeof ov_error + 16];
    path_in(ws, sizeof ws, o, "ws");
    int fd = -1;
    if (o->stacked && umount2(ws, MNT_DETACH) != 0) {
        fail("umount2", ws);
    } else {
        if (o->stacked)
            remove_generation(o, o->generation);
        o->stacked = 0;
        drop_cached_entries(ws);
        if (mount_overlay(o, o->generation + 1) == 0) {
            o->stacked = 1;
            fd = open_upper(o);
        }
    }
    if (fd >= 0) {
        send_msg(sock, "RESET_OK", &fd, 1);
        close(fd);
        return;
    }
    snprintf(msg, sizeof msg, "RESET_ERR %s", ov_error);
    send_msg(sock, msg, NULL, 0);
}

/* ---- main --------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    struct {
        int resource;
        struct rlimit value;
        const char *arg;
    } limits[MAX_RLIMITS];
    int nlimits = 0, have_uid = 0, have_gid = 0, userns = 0, report_fd = -1, i;
    int cgroup_fds[MAX_FDS], ncgroup = 0, keep_fds[MAX_FDS], nkeep = 0, pass[4 * MAX_FDS], npass = 0;
    int cgroup_dir = -1;
    unsigned long long deadline_ns = 0; /* 0: none */
    unsigned int uid = 0, gid = 0;
    pid_t parent = 0;
    struct overlay ov = {.lower_fd = -1, .tree_fd = -1, .root_fd = -1, .root_tree = -1, .dev_fd = -1};
    int have_overlay = 0;

    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        errno = 0;
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (strncmp(a, "--rlimit=", 9) == 0) {
            const char *spec = a + 9, *eq = strchr(spec, '='), *colon;
            char soft[32], hard[32];
            size_t n;
            int found = -1;
            if (!eq || nlimits == MAX_RLIMITS)
                die("bad option", a);
            for (size_t k = 0; k < sizeof RLIMITS / sizeof RLIMITS[0]; k++)
                if (strlen(RLIMITS[k].name) == (size_t)(eq - spec) && strncmp(RLIMITS[k].name, spec, eq - spec) == 0)
                    found = RLIMITS[k].resource;
            colon = strchr(eq + 1, ':');
            if (found < 0 || !colon)
                die("bad option", a);
            n = colon - (eq + 1);
            if (n >= sizeof soft || strlen(colon + 1) >= sizeof hard)
                die("bad option", a);
            memcpy(soft, eq + 1, n);
            soft[n] = 0;
            strcpy(hard, colon + 1);
            limits[nlimits].resource = found;
            limits[nlimits].arg = spec;
            if (parse_limit(soft, &limits[nlimits].value.rlim_cur) || parse_limit(hard, &limits[nlimits].value.rlim_max)
                || limits[nlimits].value.rlim_cur > limits[nlimits].value.rlim_max)
                die("bad option", a);
            nlimits++;
        } else if (strncmp(a, "--uid=", 6) == 0) {
            if (have_uid)
                die("bad option", a);
            uid = need_id(a, a + 6);
            have_uid = 1;
        } else if (strncmp(a, "--gid=", 6) == 0) {
            if (have_gid)
                die("bad option", a);
            gid = need_id(a, a + 6);
            have_gid = 1;
        } else if (strncmp(a, "--parent=", 9) == 0) {
            unsigned long long v;
            if (parse_num(a + 9, INT_MAX, &v) || v == 0)
                die("bad option", a);
            parent = (pid_t)v;
        } else if (strncmp(a, "--cgroup-fd=", 12) == 0) {
            if (ncgroup == MAX_FDS)
                die("too many options", a);
            cgroup_fds[ncgroup++] = need_fd(a, a + 12);
        } else if (strncmp(a, "--cgroup-dir-fd=", 16) == 0) {
            if (cgroup_dir >= 0)
                die("bad option (given twice)", a);
            cgroup_dir = need_fd(a, a + 16);
        } else if (strncmp(a, "--keep-fd=", 10) == 0) {
            if (nkeep == MAX_FDS)
                die("too many options", a);
            keep_fds[nkeep++] = need_fd(a, a + 10);
        } else if (strncmp(a, "--pass-fds=", 11) == 0) {
            const char *p = a + 11;
            while (*p) {
                char num[16];
                size_t n = strcspn(p, ",");
                unsigned long long v;
                if (n == 0 || n >= sizeof num || npass == 4 * MAX_FDS)
                    die("bad option", a);
                memcpy(num, p, n);
                num[n] = 0;
                if (parse_num(num, INT_MAX, &v))
                    die("bad option", a);
                pass[npass++] = (int)v;
                p += n + (p[n] == ',');
            }
        } else if (strncmp(a, "--report-fd=", 12) == 0) {
            report_fd = need_fd(a, a + 12);
        } else if (strncmp(a, "--deadline-ns=", 14) == 0) {
            if (deadline_ns || parse_num(a + 14, (unsigned long long)INT64_MAX, &deadline_ns) || deadline_ns == 0)
                die("bad option", a);
        } else if (strcmp(a, "--empty-lower") == 0) {
            ov.empty_lower = 1;
        } else if (strcmp(a, "--userns") == 0) {
            userns = 1;
        } else if (strncmp(a, "--mnt=", 6) == 0) {
            ov.mnt = a + 6;
            if (ov.mnt[0] != '/' || strlen(ov.mnt) > PATH_MAX - 64 || strchr(ov.mnt, ',') || strchr(ov.mnt, ':'))
                die("bad option (absolute path without ',' or ':')", a);
            have_overlay = 1;
        } else if (strncmp(a, "--lower-fd=", 11) == 0) {
            ov.lower_fd = need_fd(a, a + 11);
        } else if (strncmp(a, "--lower-path=", 13) == 0) {
            ov.lower_path = a + 13;
            if (ov.lower_path[0] != '/')
                die("bad option (absolute path)", a);
        } else if (strncmp(a, "--root-lower-fd=", 16) == 0) {
            ov.root_fd = need_fd(a, a + 16);
        } else if (strncmp(a, "--root-lower-path=", 18) == 0) {
            ov.root_path = a + 18;
            if (ov.root_path[0] != '/')
                die("bad option (absolute path)", a);
        } else if (strncmp(a, "--upper-dev-fd=", 15) == 0) {
            ov.dev_fd = need_fd(a, a + 15);
        } else if (strncmp(a, "--upper-bytes=", 14) == 0) {
            if (parse_num(a + 14, (unsigned long long)1 << 50, &ov.bytes) || ov.bytes < 4096)
                die("bad option", a);
        } else if (strncmp(a, "--upper-inodes=", 15) == 0) {
            if (parse_num(a + 15, (unsigned long long)1 << 32, &ov.inodes) || ov.inodes < 16)
                die("bad option", a);
        } else if (strncmp(a, "--idmap=", 8) == 0) {
            char *colon = strchr(a + 8, ':');
            if (!colon)
                die("bad option", a);
            *colon = 0;
            ov.owner_uid = need_id(a, a + 8);
            ov.owner_gid = need_id(a, colon + 1);
            ov.idmap = 1;
        } else {
            die("unknown option", a);
        }
    }
    errno = 0;
    if (have_uid != have_gid)
        die("--uid and --gid go together", NULL);
    if (parent == 0)
        die("--parent=PID is required", NULL);
    if (i >= argc || argv[i][0] != '/')
        die("usage: _lowlevel_exec --parent=PID [OPTIONS] -- /ABS/PATH ARGS...", NULL);
    if (have_overlay && (ov.lower_fd < 0 || !ov.bytes || !ov.inodes))
        die("--mnt needs --lower-fd, --upper-bytes and --upper-inodes", NULL);
    if (ov.idmap && (!have_uid || !have_overlay))
        die("--idmap needs --uid/--gid and --mnt", NULL);
    if (ov.empty_lower && !have_overlay)
        die("--empty-lower needs --mnt", NULL);
    if (ov.dev_fd >= 0 && (!have_overlay || userns))
        die("--upper-dev-fd needs --mnt and a root caller (no --userns)", NULL);
    if (have_uid && userns)
        die("--uid and --userns are exclusive (root callers need no user namespace)", NULL);
    if (ov.root_fd >= 0 && (!have_overlay || (userns ? !ov.root_path : !have_uid)))
        die("--root-lower-fd needs --mnt, and --root-lower-path (with --userns) or --uid/--gid", NULL);

    /* 1. Die with the caller. */
    arm_pdeathsig(parent);
    /* Our own fds never reach bwrap. */
    int own[3 * MAX_FDS + 3], nown = 0;
    for (int k = 0; k < ncgroup; k++)
        own[nown++] = cgroup_fds[k];
    for (int k = 0; k < nkeep; k++)
        own[nown++] = keep_fds[k];
    if (report_fd >= 0)
        own[nown++] = report_fd;
    if (ov.lower_fd >= 0)
        own[nown++] = ov.lower_fd;
    if (cgroup_dir >= 0)
        own[nown++] = cgroup_dir;
    if (ov.root_fd >= 0)
        own[nown++] = ov.root_fd;
    if (ov.dev_fd >= 0)
        own[nown++] = ov.dev_fd;
    for (int k = 0; k < nown; k++)
        if (fcntl(own[k], F_SETFD, FD_CLOEXEC) != 0)
            die("fcntl", "(F_SETFD, FD_CLOEXEC)");
    {
        int keep[6 * MAX_FDS + 4], nk = 0;
        for (int k = 0; k < nown; k++)
            keep[nk++] = own[k];
        for (int k = 0; k < npass; k++)
            keep[nk++] = pass[k];
        close_others(keep, nk);
    }

    /* 2. Join the run's cgroup v1 hierarchies (a thread moving itself: no global lock, see 3.
     * above): every process of the sandbox is born in them. The v2 one: at the fork, step 4. */
    for (int k = 0; k < ncgroup; k++) {
        if (write(cgroup_fds[k], "0", 1) != 1)
            die("join cgroup: write(\"0\") to its tasks file", NULL);
        close(cgroup_fds[k]);
    }

    /* 3. Namespaces: user (unprivileged callers), mount (overlay), then PID. */
    if (userns) {
        char map[64];
        uid_t ruid = getuid();
        gid_t rgid = getgid();
        if (unshare(CLONE_NEWUSER | (have_overlay ? CLONE_NEWNS : 0)) != 0)
            die("unshare", "(CLONE_NEWUSER): the host restricts unprivileged user namespaces");
        write_file("/proc/self/setgroups", "deny");
        snprintf(map, sizeof map, "%u %u 1\n", (unsigned)ruid, (unsigned)ruid);
        write_file("/proc/self/uid_map", map);
        snprintf(map, sizeof map, "%u %u 1\n", (unsigned)rgid, (unsigned)rgid);
        write_file("/proc/self/gid_map", map);
        arm_pdeathsig(parent);
        ov.userxattr = 1;
    } else if (have_overlay) {
        /* Clone the workspace's mount while it is still in our mount namespace (open_tree
         * refuses a mount of another namespace); it moves into the new one, idmapped. */
        if (ov.idmap && !ov.empty_lower) {
            ov.tree_fd = (int)syscall(SYS_open_tree, ov.lower_fd, "", OPEN_TREE_CLONE | AT_EMPTY_PATH | O_CLOEXEC);
            if (ov.tree_fd < 0)
                die("open_tree", "(workspace, OPEN_TREE_CLONE)");
        }
        if (ov.root_fd >= 0) {
            ov.root_tree = (int)syscall(SYS_open_tree, ov.root_fd, "", OPEN_TREE_CLONE | AT_EMPTY_PATH | O_CLOEXEC);
            if (ov.root_tree < 0)
                die("open_tree", "(rootfs, OPEN_TREE_CLONE)");
        }
        if (unshare(CLONE_NEWNS) != 0)
            die("unshare", "(CLONE_NEWNS)");
    }
    if (have_overlay && ov.lower_path)
        ov.lower_fd = reopen_same(ov.lower_path, ov.lower_fd,
                                  "the workspace changed while the sandbox was set up (a parent directory was renamed?):");
    if (ov.root_fd >= 0 && ov.root_path)
        ov.root_fd = reopen_same(ov.root_path, ov.root_fd,
                                 "the root filesystem tree changed while the sandbox was set up:");
    if (have_overlay) {
        if (have_uid) {
            ov.uid = uid;
            ov.gid = gid;
        }
        setup_overlay(&ov);
    }
    if (unshare(CLONE_NEWPID) != 0)
        die("unshare", "(CLONE_NEWPID)");

    /* The deadline's timer, armed before anything of the sandbox exists (fails closed: a run
     * with a deadline never starts without it); polled in the wait loop, step 6. CLOEXEC: the
     * child's exec of bwrap drops its copy. */
    int timer = -1, deadline_hit = 0;
    if (deadline_ns) {
        struct itimerspec when;
        memset(&when, 0, sizeof when);
        when.it_value.tv_sec = (time_t)(deadline_ns / 1000000000ULL);
        when.it_value.tv_nsec = (long)(deadline_ns % 1000000000ULL);
        timer = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
        if (timer < 0 || timerfd_settime(timer, TFD_TIMER_ABSTIME, &when, NULL) != 0)
            die("timerfd", "(--deadline-ns)");
    }

    /* 4. The child: PID 1 of the new namespace, then bwrap. It waits for "go" (EOF: the anchor
     * died, so it exits) so that bwrap starts only once the caller holds its pidfd. */
    int go[2];
    if (pipe2(go, O_CLOEXEC) != 0)
        die("pipe2", NULL);
    int in_cgroup = 0;
    pid_t child = fork_into(cgroup_dir, &in_cgroup);
    if (child < 0)
        die("clone3/fork", "(the sandbox's PID 1)");
    if (child == 0) {
        char b;
        close(go[1]);
        if (cgroup_dir >= 0 && !in_cgroup) {
            /* No CLONE_INTO_CGROUP: join the v2 cgroup before anything else (a migration). */
            int fd = openat(cgroup_dir, "cgroup.procs", O_WRONLY | O_CLOEXEC);
            if (fd < 0 || write(fd, "0", 1) != 1)
                die("join cgroup: write(\"0\") to cgroup.procs", NULL);
            close(fd);
        }
        if (report_fd >= 0)
            close(report_fd);
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
            die("prctl", "(PR_SET_PDEATHSIG, SIGKILL)");
        ssize_t n;
        do
            n = read(go[0], &b, 1);
        while (n < 0 && errno == EINTR);
        if (n != 1)
            _exit(EXIT_SETUP); /* the anchor is gone */
        for (int k = 0; k < nlimits; k++)
            if (setrlimit(limits[k].resource, &limits[k].value) != 0)
                die("setrlimit", limits[k].arg);
        if (have_uid) {
            char ids[64];
            uid_t ru, eu, su;
            gid_t rg, eg, sg;
            snprintf(ids, sizeof ids, "(%u, %u, %u)", gid, gid, gid);
            if (setgroups(0, NULL) != 0)
                die("setgroups", "(0, NULL)");
            if (setresgid(gid, gid, gid) != 0)
                die("setresgid", ids);
            snprintf(ids, sizeof ids, "(%u, %u, %u)", uid, uid, uid);
            if (setresuid(uid, uid, uid) != 0)
                die("setresuid", ids);
            errno = 0;
            if (getresuid(&ru, &eu, &su) != 0 || ru != uid || eu != uid || su != uid)
                die("getresuid: ids not dropped", ids);
            if (getresgid(&rg, &eg, &sg) != 0 || rg != gid || eg != gid || sg != gid)
                die("getresgid: ids not dropped", NULL);
            if (getgroups(0, NULL) != 0)
                die("getgroups: supplementary groups left", NULL);
            if (uid != 0 && setuid(0) != -1) {
                errno = 0;
                die("setuid(0) succeeded after the drop", NULL);
            }
            /* The uid change cleared the parent-death signal: arm it again (checked below). */
            if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
                die("prctl", "(PR_SET_PDEATHSIG, SIGKILL)");
        }
        if (!anchor_alive(go[0]))
            _exit(EXIT_SETUP); /* "g" was written, then the anchor died before our prctl */
        close(go[0]);
        execv(argv[i], &argv[i]);
        fprintf(stderr, "lowlevel_exec: execv %s: %s\n", argv[i], ll_strerror(errno));
        _exit(EXIT_EXEC);
    }
    close(go[0]);
    if (cgroup_dir >= 0)
        close(cgroup_dir);

    /* 5. READY: the caller gets bwrap's pidfd (and the upper dir) before bwrap starts. */
    int pidfd = (int)syscall(SYS_pidfd_open, child, 0);
    if (pidfd < 0) {
        kill(child, SIGKILL);
        die("pidfd_open", "(bwrap)");
    }
    if (report_fd >= 0) {
        int fds[2] = {pidfd, -1}, nfds = 1;
        if (have_overlay) {
            fds[1] = open_upper(&ov);
            nfds = 2;
        }
        if (send_msg(report_fd, have_overlay ? "READY overlay" : "READY", fds, nfds) != 0) {
            kill(child, SIGKILL);
            die("sendmsg", "(READY)");
        }
        if (nfds == 2)
            close(fds[1]);
    }
    if (write(go[1], "g", 1) != 1) {
        kill(child, SIGKILL);
        die("write", "(go)");
    }
    /* bwrap has its own copies now: drop ours, so the caller's pipes reach EOF as soon as the
     * sandbox is gone, not when we are (our exit tears down the mount namespace: the overlay
     * and the tmpfs, two expedited RCU grace periods). stdio goes to /dev/null. */
    for (int k = 0; k < npass; k++)
        if (pass[k] > 2)
            close(pass[k]);
    {
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (null >= 0) {
            dup2(null, 0);
            dup2(null, 1);
            dup2(null, 2);
            close(null);
        }
    }

    /* 6. Wait for bwrap; serve RESET requests meanwhile; kill the sandbox at the deadline. */
    for (;;) {
        struct pollfd p[3] = {{.fd = pidfd, .events = POLLIN}, {.fd = timer, .events = POLLIN},
                              {.fd = (report_fd >= 0 && have_overlay) ? report_fd : -1, .events = POLLIN}};
        /* poll(2) ignores entries with a negative fd. */
        if (poll(p, 3, -1) < 0) {
            if (errno == EINTR)
                continue;
            die("poll", NULL);
        }
        if (p[0].revents)
            break;
        if (timer >= 0 && p[1].revents) {
            /* The deadline: bwrap is PID 1 of the sandbox's PID namespace, so its death takes
             * every process of the sandbox with it; the pidfd then reports it as usual. */
            kill(child, SIGKILL);
            deadline_hit = 1;
            close(timer);
            timer = -1;
        }
        if (p[2].fd >= 0 && p[2].revents) {
            char buf[64];
            ssize_t n = recv(report_fd, buf, sizeof buf - 1, MSG_DONTWAIT);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
                close(report_fd); /* the caller closed its end: nothing more to serve */
                report_fd = -1;
                continue;
            }
            if (n > 0) {
                buf[n] = 0;
                if (strcmp(buf, "RESET") == 0 && ov.empty_lower)
                    /* The empty lower stands for the workspace as it was at the start only. */
                    send_msg(report_fd, "RESET_ERR not with --empty-lower (a one-shot run)", NULL, 0);
                else if (strcmp(buf, "RESET") == 0)
                    reset_overlay(&ov, report_fd);
                else
                    send_msg(report_fd, "RESET_ERR unknown request", NULL, 0);
            }
        }
    }
    int status;
    struct rusage ru;
    while (wait4(child, &status, 0, &ru) < 0)
        if (errno != EINTR)
            die("wait4", NULL);
    /* EXIT: bwrap's wait status and the largest RSS of the sandbox's processes (KiB: bwrap's
     * rusage covers every descendant it waited for), before our own teardown, which the caller
     * need not wait for to build its Result. */
    if (report_fd >= 0) {
        char msg[128];
        struct timespec end;
        clock_gettime(CLOCK_MONOTONIC, &end);
        snprintf(msg, sizeof msg, "EXIT %d %ld %lld %d", status, (long)ru.ru_maxrss,
                 (long long)end.tv_sec * 1000000000LL + end.tv_nsec, deadline_hit);
        send_msg(report_fd, msg, NULL, 0);
    }
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}
