/* lowlevel_init: the in-sandbox init of a lowlevel Session.
 *
 * bwrap execs this as the sandbox's program (PID 2 under bwrap's own PID-1 reaper), with the
 * host's end of a SOCK_SEQPACKET socketpair on an inherited fd. It then runs commands for the
 * host, several at once, each under its own "shepherd":
 *
 *   init (PID 2, child subreaper, not dumpable, catches every catchable signal with a no-op)
 *    +-- shepherd (one per command, forked ahead as the "spare"; child subreaper, not dumpable)
 *         +-- command (own process group, own stdio from the host, per-command rlimits)
 *              +-- ... whatever the command forks; orphans reparent to the shepherd
 *
 * The shepherd enforces the command's wall-clock timeout, kills the command's whole tree (its
 * process group, then every process reparented to the shepherd, until none is left) when the
 * command exits, times out or the host asks, and reports the exit status and the tree's
 * rusage straight to the host over the shared socket (SEQPACKET sends are atomic, so several
 * shepherds never interleave). The init only dispatches: it hands each SPAWN, as received, to
 * the spare (a shepherd forked before it was needed, waiting on its control socket: the fork is
 * off the command's path; one that dies before it reads its command is replaced: retake) and
 * forks the next spare, forwards signal requests, reaps shepherds
 * and SIGKILLs any process that ends up as its own child without being a shepherd (the orphans
 * of a shepherd that was killed).
 *
 * Protocol: one message per SEQPACKET record, native byte order (both ends are on one host),
 * every message starting with a u32 type. See lowlevel/session.py for the host side; the two
 * struct layouts below are mirrored there with the struct module.
 *
 * Usage: lowlevel_init SOCK_FD IDLE_MS TOTAL_MS [CLOSE_FD [--ll...]]   (IDLE_MS/TOTAL_MS 0: none)
 *
 * Landlock (the --ll options, lowlevel_landlock.h): the init restricts itself once, before
 * HELLO, with the TCP rules and the scopes (a domain the shepherds and every command share:
 * commands can still signal each other); each command then restricts itself, between vfork
 * and exec, with the filesystem rules in a nested domain. That ruleset is built once and
 * rebuilt when a writable mount point changes (a Session's reset stacks a fresh overlay on
 * /workspace, and Landlock ignores rules on a covered mount point). HELLO's last field carries
 * the ABI applied (0: none).
 *
 * Static and self-contained: no Python, no allocation on the hot path beyond the message
 * buffer, only syscalls the default seccomp profile allows (fork, vfork, execve, signalfd,
 * prctl(PR_SET_CHILD_SUBREAPER/PR_SET_DUMPABLE), close_range with a fallback).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "lowlevel_landlock.h"

#define PROTO_VERSION 1

/* host -> init */
#define MSG_SPAWN 1
#define MSG_SIGNAL 2
/* init/shepherd -> host */
#define MSG_HELLO 100
#define MSG_STARTED 101
#define MSG_EXIT 102
#define MSG_BYE 103

/* MSG_SPAWN flags */
#define SPAWN_STDIN_PIPE 1u  /* fds[0] is stdin; else /dev/null */
#define SPAWN_BODY_MEMFD 2u  /* the body is in the last fd passed, not inline */
#define SPAWN_STARTED 4u     /* report STARTED (the command's pid); else the first report is EXIT */

/* MSG_SIGNAL flags */
#define SIGNAL_TREE 1u       /* SIGKILL the whole tree (the host cancelled the command) */

/* MSG_EXIT kinds */
#define EXIT_WAIT_STATUS 0   /* status: the command's wait status */
#define EXIT_SETUP_FAILED 1  /* status: errno; stage says where */
#define EXIT_SPAWN_FAILED 2  /* status: errno of fork/pipe in the init */
#define EXIT_SHEPHERD_DIED 3 /* status: the shepherd's wait status */

/* MSG_EXIT flags */
#define EXITF_TIMED_OUT 1u
#define EXITF_CANCELLED 2u

/* setup stages */
#define STAGE_CHDIR 1
#define STAGE_RLIMIT 2
#define STAGE_EXEC 3
#define STAGE_STDIO 4
#define STAGE_LANDLOCK 5
#define STAGE_CWD 6 /* the cwd resolved outside the sandbox's root (ll_chdir_inside: CVE-2024-21626 class) */

/* MSG_BYE reasons */
#define BYE_IDLE 1
#define BYE_TOTAL 2

#define MAX_MSG (256 * 1024)
#define MAX_FDS 8

struct spawn_hdr {        /* 32 bytes, then nrlimits * struct rlim_rec, then strings */
    uint32_t type, id, flags, nrlimits;
    int64_t timeout_ms;   /* < 0: none */
    uint32_t argc, envc;  /* strings: cwd, argv[argc], env[envc], each NUL-terminated */
};
struct rlim_rec { uint32_t resource, pad; uint64_t soft, hard; };
struct signal_msg { uint32_t type, id, signo, flags; };
struct hello_msg { uint32_t type, version, pid, landlock_abi; };
struct started_msg { uint32_t type, id, pid, pad; };
struct exit_msg {         /* 56 bytes */
    uint32_t type, id, kind, status, flags, stage;
    int64_t utime_us, stime_us, maxrss_kib, wall_ns;
};
struct bye_msg { uint32_t type, reason, pad0, pad1; };

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void send_msg(int sock, const void *msg, size_t len) {
    /* Blocking send; the host always drains. EPIPE: the host is gone, we die with the sandbox. */
    while (send(sock, msg, len, MSG_NOSIGNAL) < 0 && errno == EINTR) {}
}

static void close_from(int lowfd) {
    if (syscall(SYS_close_range, (unsigned)lowfd, ~0u, 0u) == 0) return;
    struct rlimit rl;
    int max = (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) ? (int)rl.rlim_cur : 65536;
    for (int fd = lowfd; fd < max; fd++) close(fd);
}

/* Signals the init and the shepherds shrug off (a command's `kill -TERM -1`). SIGKILL and SIGSTOP
 * cannot be. They are caught by a handler that does nothing, not set to SIG_IGN: execve(2) resets
 * a caught signal to SIG_DFL but keeps SIG_IGN, so with SIG_IGN every command had to reset all 64
 * dispositions itself between vfork and exec (64 rt_sigaction calls, each through the sandbox's
 * seccomp filter: ~70 us per command here); a caught one needs nothing. SA_RESTART, and every
 * call that can still fail with EINTR (poll, the shepherd's recv) is retried. signal(7),
 * execve(2) ("dispositions of caught signals are reset to the default"). SIGCONT stays SIG_DFL:
 * its default action only resumes (a signal the kernel then drops, sig_kernel_ignore), so the
 * init's SIGCONT to the waiting spare before each hand-over (hand_over) resumes a stopped spare
 * and clears a pending stop without waking it to run a handler and restart its recvmsg. */
static void shrug(int signo) { (void)signo; }

static const int ignored_signals[] = {
    SIGHUP, SIGINT, SIGQUIT, SIGPIPE, SIGALRM, SIGTERM, SIGUSR1, SIGUSR2, SIGTSTP, SIGTTIN,
    SIGTTOU, SIGXCPU, SIGXFSZ, SIGVTALRM, SIGPROF, SIGIO, SIGPWR, SIGURG, SIGWINCH,
};

static void ignore_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = shrug;
    sa.sa_flags = SA_RESTART;
    sigfillset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof ignored_signals / sizeof ignored_signals[0]; i++)
        sigaction(ignored_signals[i], &sa, NULL);
    for (int s = SIGRTMIN; s <= SIGRTMAX; s++) sigaction(s, &sa, NULL);
}

static int sigchld_fd(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);
    return signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
}

static void drain_fd(int fd) {
    char buf[512];
    while (read(fd, buf, sizeof buf) > 0) {}
}

/* Return the PPid of /proc/PID/stat, or -1. */
static int proc_ppid(int pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return -1;
    char state;
    int ppid;
    if (sscanf(p + 1, " %c %d", &state, &ppid) != 2) return -1;
    return ppid;
}

/* SIGKILL every child of ours for which keep(pid) is false; return how many were found. */
static int kill_children(int (*keep)(pid_t)) {
    pid_t self = getpid();
    int found = 0;
    DIR *d = opendir("/proc");
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 0 || pid == self) continue;
        if (proc_ppid((int)pid) != self) continue;
        if (keep && keep((pid_t)pid)) continue;
        kill((pid_t)pid, SIGKILL);
        found++;
    }
    closedir(d);
    return found;
}

/* ------------------------------------------------------------------------------------------ */
/* shepherd                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* The init's /proc/self/oom_score_adj, opened before it became non-dumpable; -1: none. */
static int oom_adj_fd = -1;

/* The init's own oom_score_adj between forks. Above 0, so that where the OOM killer chooses among
 * many sessions and their caller (the caller's memory cgroup, which the run cgroups nest in, or
 * the whole host without one), it kills an idle session's init (the session ends with a
 * SessionError naming memory) before the caller, whose death would end every session (the OOM
 * badness adds adj * limit / 1000 to a process's pages: a caller is chosen first only when it
 * holds 90% of the limit). Below a command's 1000 by a tenth of the limit, so inside a session a
 * command is still the victim. bench/density.py measured the caller killed at 80 MiB without. */
#define IDLE_OOM_ADJ "900"

static void set_oom_adj(const char *value) {
    if (oom_adj_fd >= 0) (void)!write(oom_adj_fd, value, strlen(value));
}

/* Shared with the vfork child (same memory until it execs or exits). */
static volatile int child_errno, child_stage;

/* Landlock: the spec from the command line, the filesystem ruleset commands restrict themselves
 * with (the init's fd; fd 5 in a shepherd), and an O_PATH fd on each writable rule path as it
 * was when that ruleset was built. The fd pins that mount, so a mount stacked on the path later
 * cannot reuse its device number: a different (st_dev, st_ino) at the path means "rebuild". */
static struct ll_spec ll;
static int ll_fs_fd = -1, cmd_ll_fd = -1, ll_fs_built, ll_pins_set;
static int ll_pins[LL_MAX_RULES];

static int ll_same(int fd, const char *path) {
    struct stat a, b;
    return fd >= 0 && fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/* (Re)build the filesystem ruleset when it does not exist yet or a writable rule path is now
 * another directory (a mount stacked on it). 0, or -1 with errno. */
static int ll_fs_refresh(void) {
    if (ll.mode == LL_OFF) return 0;
    int changed = !ll_fs_built;
    for (unsigned i = 0; i < ll.nrules && !changed; i++)
        if (ll.rules[i].cls == LL_CLS_RW && !ll_same(ll_pins[i], ll.rules[i].path)) changed = 1;
    if (!changed) return 0;
    for (unsigned i = 0; i < ll.nrules; i++) {
        if (ll_pins_set && ll_pins[i] >= 0) close(ll_pins[i]);
        ll_pins[i] = ll.rules[i].cls == LL_CLS_RW ? open(ll.rules[i].path, O_PATH | O_CLOEXEC) : -1;
    }
    ll_pins_set = 1;
    int abi, fd = ll_build(&ll, LL_PART_FS, &abi);
    if (fd < 0 && abi < 0) { ll_fs_built = 0; return -1; }
    if (ll_fs_fd >= 0) close(ll_fs_fd);
    ll_fs_fd = fd;
    ll_fs_built = 1;
    return 0;
}

static void exec_search(const char *file, char *const argv[], char *const envp[]) {
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        return;
    }
    const char *path = "/usr/local/bin:/usr/bin:/bin";
    for (char *const *e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) { path = *e + 5; break; }
    size_t flen = strlen(file);
    char buf[4096];
    int saw_eacces = 0;
    for (const char *p = path;; ) {
        const char *colon = strchrnul(p, ':');
        size_t dlen = (size_t)(colon - p);
        if (dlen + flen + 2 <= sizeof buf) {
            if (dlen) { memcpy(buf, p, dlen); buf[dlen] = '/'; dlen++; }
            memcpy(buf + dlen, file, flen + 1);
            execve(buf, argv, envp);
            if (errno == EACCES) saw_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR && errno != ENAMETOOLONG) return;
        }
        if (!*colon) break;
        p = colon + 1;
    }
    errno = saw_eacces ? EACCES : ENOENT;
}

struct cmd {
    uint32_t id, flags;
    int64_t timeout_ms;
    const struct rlim_rec *rl;
    uint32_t nrl;
    const char *cwd;
    char **argv, **envp;
};

static void shepherd_report_exit(int sock, uint32_t id, uint32_t kind, uint32_t status, uint32_t flags,
                                 uint32_t stage, int64_t t0) {
    struct exit_msg m;
    memset(&m, 0, sizeof m);
    m.type = MSG_EXIT; m.id = id; m.kind = kind; m.status = status; m.flags = flags; m.stage = stage;
    struct rusage ru;
    if (getrusage(RUSAGE_CHILDREN, &ru) == 0) {
        m.utime_us = (int64_t)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec;
        m.stime_us = (int64_t)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec;
        m.maxrss_kib = ru.ru_maxrss;
    }
    m.wall_ns = now_ns() - t0;
    send_msg(sock, &m, sizeof m);
}

/* Kill the command's group and every process left in our subtree; reap until none is left. */
static void kill_tree(pid_t pgid, int sfd, pid_t main_pid, int *main_status, int *main_done) {
    if (pgid > 0) kill(-pgid, SIGKILL);
    for (int round = 0;; round++) {
        int st;
        pid_t r;
        while ((r = waitpid(-1, &st, WNOHANG)) > 0) {
            if (r == main_pid && !*main_done) { *main_status = st; *main_done = 1; }
        }
        if (r < 0 && errno == ECHILD) return;
        if (pgid > 0) kill(-pgid, SIGKILL);
        kill_children(NULL);
        struct pollfd p = { sfd, POLLIN, 0 };
        poll(&p, 1, round < 10 ? 1 : 10);
        drain_fd(sfd);
    }
}

/* Set one rlimit of the calling process to (soft, hard), both lowered to its current hard
 * limit (a command may not raise the session's). One prlimit64 that sets and returns the old
 * value in the common case (the values are within the hard limit: the set is what the clamp
 * would have given); only when the kernel refused (EPERM: above the hard limit without
 * CAP_SYS_RESOURCE; EINVAL: soft > hard), or the set raised the hard limit (the process holds
 * CAP_SYS_RESOURCE), is the clamped value read and set again: getrlimit(2), prlimit(2).
 * Returns 0, or -1 with errno. Async-signal-safe (the vfork child calls it). */
static int set_rlimit_clamped(int resource, uint64_t soft, uint64_t hard) {
    struct rlimit want = { .rlim_cur = soft, .rlim_max = hard }, cur;
    if (prlimit(0, resource, &want, &cur) == 0) {
        if (cur.rlim_max == RLIM_INFINITY || hard <= cur.rlim_max) return 0;
    } else if ((errno != EPERM && errno != EINVAL) || getrlimit(resource, &cur) < 0) {
        return -1;
    }
    if (cur.rlim_max != RLIM_INFINITY) {
        if (want.rlim_max > cur.rlim_max) want.rlim_max = cur.rlim_max;
        if (want.rlim_cur > cur.rlim_max) want.rlim_cur = cur.rlim_max;
    }
    return setrlimit(resource, &want);
}

/* vfork the command; the child never returns from here (exec or _exit). */
static __attribute__((noinline)) pid_t spawn_command(const struct cmd *c, int *vfork_errno) {
    child_errno = 0; child_stage = 0;
    pid_t pid = vfork();
    if (pid == 0) {
        /* The command: default dispositions (the execve resets the init's caught signals: see
         * ignore_signals; 32 and 33, glibc's own, which glibc's posix_spawn of the anchor left
         * SIG_IGN above bwrap and glibc's sigaction cannot touch, are reset by the raw syscall
         * here, as the run guard does: the shepherds keep shrugging them), empty mask, own
         * process group. A signal
         * arriving between the unblock below and the execve runs the no-op handler (on this
         * child's stack below the shepherd's frames) and is lost, as if sent a moment earlier. */
        sigset_t none;
        sigemptyset(&none);
        setpgid(0, 0);
        for (uint32_t i = 0; i < c->nrl; i++)
            if (set_rlimit_clamped((int)c->rl[i].resource, c->rl[i].soft, c->rl[i].hard) < 0) {
                child_errno = errno; child_stage = STAGE_RLIMIT; _exit(127);
            }
        char cwd_buf[PATH_MAX];
        int cwd_r = ll_chdir_inside(c->cwd, cwd_buf, sizeof cwd_buf);
        if (cwd_r) {
            child_errno = errno;
            child_stage = cwd_r == LL_CWD_CHDIR ? STAGE_CHDIR : STAGE_CWD;
            _exit(127);
        }
        if (cmd_ll_fd >= 0 && ll_restrict(cmd_ll_fd) < 0) { child_errno = errno; child_stage = STAGE_LANDLOCK; _exit(127); }
        ll_default_glibc_signals();
        sigprocmask(SIG_SETMASK, &none, NULL);
        exec_search(c->argv[0], c->argv, c->envp);
        child_errno = errno ? errno : ENOEXEC;
        child_stage = STAGE_EXEC;
        _exit(127);
    }
    *vfork_errno = errno;
    return pid;
}

/* The fds of a shepherd, set up by the spare before its command comes (spare_main): the host
 * socket, its control socket, the command's Landlock ruleset (a /dev/null placeholder until
 * then), its SIGCHLD signalfd, /dev/null for a command without stdin. Everything a command
 * brings lands above them. */
enum { SH_SOCK = 3, SH_CTL = 4, SH_LL = 5, SH_SIGCHLD = 6, SH_NULL = 7, SH_FIRST_FREE = 8 };

static void shepherd(int sock, int ctl, const struct cmd *c, int *fds, int nfds) {
    int64_t t0 = now_ns();
    /* stdio of the command on our own 0, 1, 2 (we never print); its ruleset on SH_LL. */
    int idx = 0, in_fd = SH_NULL;
    if (c->flags & SPAWN_STDIN_PIPE) in_fd = fds[idx++];
    int out_fd = idx < nfds ? fds[idx++] : -1;
    int err_fd = idx < nfds ? fds[idx++] : -1;
    if (out_fd < 0 || err_fd < 0 || dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0
        || (ll_fs_fd >= 0 && dup3(ll_fs_fd, SH_LL, O_CLOEXEC) < 0)) {
        shepherd_report_exit(sock, c->id, EXIT_SETUP_FAILED, (uint32_t)errno, 0, STAGE_STDIO, t0);
        _exit(0);
    }
    cmd_ll_fd = ll_fs_fd >= 0 ? SH_LL : -1;
    close_from(SH_NULL);
    int sfd = SH_SIGCHLD;

    int vfork_errno = 0;
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &old);
    pid_t pid = spawn_command(c, &vfork_errno);
    sigprocmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        shepherd_report_exit(sock, c->id, EXIT_SETUP_FAILED, (uint32_t)vfork_errno, 0, STAGE_EXEC, t0);
        _exit(0);
    }
    if (child_errno) {
        int st;
        waitpid(pid, &st, 0);
        shepherd_report_exit(sock, c->id, EXIT_SETUP_FAILED, (uint32_t)child_errno, 0, (uint32_t)child_stage, t0);
        _exit(0);
    }
    setpgid(pid, pid);  /* no-op: the child did it before exec; kept for clarity */
    /* stdin: closed, so the host's writes fail with EPIPE once the command closed its copy.
     * stdout and stderr stay open until we exit, after EXIT: the host takes EXIT, then reads the
     * pipes dry without waiting for EOF (the tree is dead: its output is all there), so the
     * pipes' EOF wakes it no sooner than EXIT does (one wake-up per command, not two or three). */
    close(0);
    if (c->flags & SPAWN_STARTED) {  /* a background command: the host shows its pid */
        struct started_msg sm = { MSG_STARTED, c->id, (uint32_t)pid, 0 };
        send_msg(sock, &sm, sizeof sm);
    }

    int64_t deadline = c->timeout_ms >= 0 ? t0 + c->timeout_ms * 1000000 : -1;
    int main_status = 0, main_done = 0;
    uint32_t flags = 0;
    while (!main_done) {
        struct pollfd p[2] = { { sfd, POLLIN, 0 }, { ctl, POLLIN, 0 } };
        int wait_ms = -1;
        if (deadline >= 0) {
            int64_t left = deadline - now_ns();
            if (left <= 0) {
                flags |= EXITF_TIMED_OUT;
                kill_tree(pid, sfd, pid, &main_status, &main_done);
                break;
            }
            wait_ms = (int)((left + 999999) / 1000000);
        }
        int n = poll(p, 2, wait_ms);
        if (n < 0 && errno != EINTR) break;
        if (p[0].revents) {
            drain_fd(sfd);
            int st;
            pid_t r;
            while ((r = waitpid(-1, &st, WNOHANG)) > 0)
                if (r == pid) { main_status = st; main_done = 1; }
        }
        if (p[1].revents) {
            struct signal_msg m;
            ssize_t got = recv(ctl, &m, sizeof m, 0);
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) {  /* the init is gone: the session is over; the host hears it from the socket */
                kill_tree(pid, sfd, pid, &main_status, &main_done);
                _exit(0);
            }
            if (got == sizeof m) {
                if (m.flags & SIGNAL_TREE) {
                    flags |= EXITF_CANCELLED;
                    kill_tree(pid, sfd, pid, &main_status, &main_done);
                    break;
                }
                kill(-pid, (int)m.signo);
            }
        }
    }
    /* The command is done: nothing it started may outlive it. */
    kill_tree(pid, sfd, pid, &main_status, &main_done);
    shepherd_report_exit(sock, c->id, EXIT_WAIT_STATUS, (uint32_t)main_status, flags, 0, t0);
    _exit(0);
}

/* ------------------------------------------------------------------------------------------ */
/* init                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* A command's shepherd: its command's id, pid, the init's end of its control socket (ctl) and
 * the init's copy of the shepherd's own end (peer: see spare_peer), and how many shepherds the
 * command was handed to (retake). */
struct job { uint32_t id; pid_t pid; int ctl, peer, handovers; };
static struct job *jobs;
static size_t njobs, capjobs;

/* The spare: the next command's shepherd, forked ahead (after the previous command was handed
 * over, and before HELLO), so a SPAWN costs the init a sendmsg to it instead of a fork on the
 * command's path (~0.1 ms here). It holds only the host socket and its own control socket
 * (fds 3, 4) while it waits, at oom_score_adj 1000 like every shepherd. -1: none (it was
 * handed over, or a command killed it: the next SPAWN forks one). */
static pid_t spare_pid = -1;
static int spare_ctl = -1;
/* The init keeps a copy of the spare's end of its control socket (until the shepherd is reaped):
 * a SPAWN the spare never read then outlives the spare, queued on that end with its fds, and the
 * init can tell a command a spare died holding unread (SIGKILLed after spare_usable looked, in
 * the window no /proc field shows: retake) from one its shepherd took. */
static int spare_peer = -1;
/* LOWLEVEL_INIT_FAULT_SPARE_DEATHS=N (tests only, through Policy.env, which a command cannot
 * change): the next N spares kill themselves once a command is queued to them, unread, as a
 * spare SIGKILLed after spare_usable looked does. */
static long spare_deaths;
/* Shepherds one command may be handed to: a spare that dies before it reads its command is
 * replaced this many times less one, then the command is reported EXIT_SHEPHERD_DIED. */
#define MAX_HANDOVERS 3
/* When the next spare is due (CLOCK_MONOTONIC ns; 0: none wanted). Not at once after a
 * hand-over: the spare just woken by it usually waits on the init's CPU (a unix socket's wake-up
 * is a "sync" one, which places the wakee by the waker), so a fork there at once delayed the
 * command's start by ~70 us; nor while the command runs (the fork competes with it). The init
 * forks it as soon as a shepherd is reaped (its command is over: the caller is busy with the
 * EXIT, the CPU idle), or SPARE_LATE_NS after the hand-over for a command still running. */
static int64_t spare_due;
#define SPARE_LATE_NS 5000000

/* Internal to the init -> spare hand-over (never on the host's socket, which may not set it):
 * the Landlock filesystem ruleset is the last fd passed (the init's current one: a reset may
 * have rebuilt it since the spare was forked). */
static const uint32_t SPAWN_FWD_LL_FD = 1u << 31;

static int is_shepherd(pid_t pid) {
    if (pid == spare_pid) return 1;
    for (size_t i = 0; i < njobs; i++)
        if (jobs[i].pid == pid) return 1;
    return 0;
}

static void send_exit_simple(int sock, uint32_t id, uint32_t kind, uint32_t status) {
    struct exit_msg m;
    memset(&m, 0, sizeof m);
    m.type = MSG_EXIT; m.id = id; m.kind = kind; m.status = status;
    send_msg(sock, &m, sizeof m);
}

/* The init's own EXITs (a SPAWN it could not hand over, a shepherd that died, a command cancelled
 * before it ran) never block it: one the socket has no room for waits here, in order, and goes
 * when poll says POLLOUT. A blocking send there stopped the init reading SPAWNs while a sync
 * caller started commands without reading (Session.start() in a loop, each failing at a process
 * limit): the host's sendmsg then timed out and killed the session as "unresponsive". The
 * shepherds' own reports block as before (a shepherd is one command's). */
static struct exit_msg *outbox;
static size_t nout, capout;

/* Send what waits in the outbox while the socket takes it (EPIPE: the host is gone; dropped). */
static void flush_outbox(int sock) {
    size_t i = 0;
    while (i < nout) {
        ssize_t r = send(sock, &outbox[i], sizeof outbox[i], MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        i++;
    }
    memmove(outbox, outbox + i, (nout - i) * sizeof *outbox);
    nout -= i;
}

static void init_report(int sock, const struct exit_msg *m) {
    if (nout == 0) {
        ssize_t r;
        do r = send(sock, m, sizeof *m, MSG_NOSIGNAL | MSG_DONTWAIT); while (r < 0 && errno == EINTR);
        if (r >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return;
    }
    if (nout == capout) {
        size_t ncap = capout ? capout * 2 : 64;
        struct exit_msg *no = realloc(outbox, ncap * sizeof *no);
        if (!no) { send_msg(sock, m, sizeof *m); return; }  /* no memory: block, as before */
        outbox = no; capout = ncap;
    }
    outbox[nout++] = *m;
}

/* The init's own EXIT for command ``id`` (one it could not start, whose shepherd died, or that was
 * cancelled before it ran: ``flags`` EXITF_CANCELLED), through the outbox. */
static void init_exit(int sock, uint32_t id, uint32_t kind, uint32_t status, uint32_t flags) {
    struct exit_msg m;
    memset(&m, 0, sizeof m);
    m.type = MSG_EXIT; m.id = id; m.kind = kind; m.status = status; m.flags = flags;
    init_report(sock, &m);
}

static char msgbuf[MAX_MSG + 1];

/* In a shepherd: parse one MSG_SPAWN (the host's message as the init forwarded it) and be its
 * command's shepherd; a malformed one is reported (EXIT_SPAWN_FAILED) and we exit. fds are ours. */
static __attribute__((noreturn)) void run_spawn(int sock, int ctl, char *buf, size_t len, int *fds, int nfds) {
    const struct spawn_hdr *h = (const void *)buf;
    char *body = NULL;
    size_t blen = 0;
    char *owned = NULL;
    uint32_t id = h->id;
    int err = EINVAL;
    if (h->flags & SPAWN_BODY_MEMFD) {
        if (nfds < 1) goto bad;
        int bfd = fds[--nfds];
        struct stat st;
        if (fstat(bfd, &st) < 0 || st.st_size > 64 * 1024 * 1024) { close(bfd); goto bad; }
        owned = malloc((size_t)st.st_size + 1);
        if (!owned) { close(bfd); err = ENOMEM; goto fail; }
        size_t got = 0;
        while (got < (size_t)st.st_size) {
            ssize_t n = pread(bfd, owned + got, (size_t)st.st_size - got, (off_t)got);
            if (n <= 0) break;
            got += (size_t)n;
        }
        close(bfd);
        body = owned; blen = got;
    } else {
        body = buf + sizeof *h; blen = len - sizeof *h;
    }
    size_t rlbytes = (size_t)h->nrlimits * sizeof(struct rlim_rec);
    if (h->nrlimits > 64 || rlbytes > blen || h->argc == 0 || h->argc > 1000000 || h->envc > 1000000) goto bad;
    int need = 2 + ((h->flags & SPAWN_STDIN_PIPE) ? 1 : 0);
    if (nfds != need) goto bad;
    /* Strings: cwd, argv, env, each NUL-terminated, all inside the body. */
    char *str = body + rlbytes, *end = body + blen;
    size_t nstr = 1 + (size_t)h->argc + h->envc;
    char **vec = malloc((nstr + 2) * sizeof(char *));
    if (!vec) { err = ENOMEM; goto fail; }
    for (size_t i = 0; i < nstr; i++) {
        char *z = memchr(str, 0, (size_t)(end - str));
        if (!z) { free(vec); goto bad; }
        vec[i] = str;
        str = z + 1;
    }
    struct cmd c;
    c.id = id; c.flags = h->flags; c.timeout_ms = h->timeout_ms;
    c.rl = (const struct rlim_rec *)(void *)body; c.nrl = h->nrlimits;
    c.cwd = vec[0];
    /* argv = vec[1..argc], NULL; envp = vec[argc+2..], NULL: shift env up by one slot. */
    memmove(vec + h->argc + 2, vec + h->argc + 1, h->envc * sizeof(char *));
    vec[h->argc + 1] = NULL;
    vec[nstr + 1] = NULL;
    c.argv = vec + 1;
    c.envp = vec + h->argc + 2;
    shepherd(sock, ctl, &c, fds, nfds);
    _exit(0);
bad:
    err = EINVAL;
fail:
    for (int i = 0; i < nfds; i++) close(fds[i]);
    send_exit_simple(sock, id, EXIT_SPAWN_FAILED, (uint32_t)err);
    _exit(0);
}

/* Receive one message (and its fds) on sock into buf; its length, 0 at EOF, -1 with errno. */
static ssize_t recv_with_fds(int sock, char *buf, size_t size, int flags, int *fds, int *nfds, int *truncated) {
    char cbuf[CMSG_SPACE((MAX_FDS + 1) * sizeof(int))];
    struct iovec iov = { buf, size };
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov; mh.msg_iovlen = 1;
    mh.msg_control = cbuf; mh.msg_controllen = sizeof cbuf;
    ssize_t len = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | flags);
    *nfds = 0;
    if (len < 0) return -1;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *src = (int *)(void *)CMSG_DATA(cm);
            for (int i = 0; i < k; i++) {
                if (*nfds < MAX_FDS + 1) fds[(*nfds)++] = src[i];
                else close(src[i]);
            }
        }
    }
    *truncated = (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
    return len;
}

/* The spare, from its fork: keep only what its shepherd needs (SH_*: the host socket, its
 * control socket, a SIGCHLD signalfd, /dev/null), become a subreaper, all before its command
 * comes; then wait for the SPAWN the init hands over and run it. EOF (the init is gone): exit. */
static __attribute__((noreturn)) void spare_main(int sock, int ctl) {
    int s3 = fcntl(sock, F_DUPFD_CLOEXEC, 10), c3 = fcntl(ctl, F_DUPFD_CLOEXEC, 10);
    int nul = open("/dev/null", O_RDONLY | O_CLOEXEC);
    int n3 = nul >= 0 ? fcntl(nul, F_DUPFD_CLOEXEC, 10) : -1;
    /* A failure before the command is read exits 1: the init then finds it queued (retake). */
    if (s3 < 0 || c3 < 0 || n3 < 0 || dup3(s3, SH_SOCK, O_CLOEXEC) < 0 || dup3(c3, SH_CTL, O_CLOEXEC) < 0
        || dup3(n3, SH_LL, O_CLOEXEC) < 0 || dup3(n3, SH_NULL, O_CLOEXEC) < 0) _exit(1);
    close(SH_SIGCHLD);
    close_from(SH_FIRST_FREE);  /* the init's other fds: other shepherds' control sockets, its ruleset, oom_adj */
    int sfd = sigchld_fd();  /* SIGCHLD is already blocked (inherited from the init) */
    if (sfd < 0 || (sfd != SH_SIGCHLD && (dup3(sfd, SH_SIGCHLD, O_CLOEXEC) < 0 || close(sfd) < 0))) _exit(1);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    sock = SH_SOCK; ctl = SH_CTL;
    ll_fs_fd = -1;
    int fds[MAX_FDS + 1], nfds, truncated;
    ssize_t len;
    do len = recv_with_fds(ctl, msgbuf, MAX_MSG, 0, fds, &nfds, &truncated); while (len < 0 && errno == EINTR);
    if (len == 0) _exit(0);  /* EOF: the init dropped us, or is gone */
    if (len < (ssize_t)sizeof(struct spawn_hdr)) _exit(1);
    struct spawn_hdr *h = (void *)msgbuf;
    if (truncated || ((h->flags & SPAWN_FWD_LL_FD) && nfds < 1)) {
        /* Read, so the init cannot hand it over again: fds lost (MSG_CTRUNC: our RLIMIT_NOFILE,
         * lowered by a command through prlimit(2) where the policy's seccomp profile allows it). */
        for (int i = 0; i < nfds; i++) close(fds[i]);
        send_exit_simple(sock, h->id, EXIT_SPAWN_FAILED, (uint32_t)EMFILE);
        _exit(0);
    }
    if (h->flags & SPAWN_FWD_LL_FD) {
        ll_fs_fd = fds[--nfds];
        h->flags &= ~SPAWN_FWD_LL_FD;
    }
    run_spawn(sock, ctl, msgbuf, (size_t)len, fds, nfds);
}

/* Fork the spare: 0, or -1 with errno. */
static int make_spare(int sock) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) < 0) return -1;
    set_oom_adj("1000");
    pid_t pid = fork();
    if (pid == 0) {
        close(sp[0]);
        if (spare_deaths > 0) {  /* the test fault: die with the command queued, unread */
            struct pollfd p = { sp[1], POLLIN, 0 };
            while (poll(&p, 1, -1) < 0 && errno == EINTR) {}
            raise(SIGKILL);
        }
        spare_main(sock, sp[1]);
    }
    int err = errno;
    set_oom_adj(IDLE_OOM_ADJ);
    if (pid < 0) { close(sp[0]); close(sp[1]); errno = err; return -1; }
    if (spare_deaths > 0) spare_deaths--;
    spare_pid = pid; spare_ctl = sp[0]; spare_peer = sp[1];
    return 0;
}

static void drop_spare(void) {
    if (spare_ctl >= 0) close(spare_ctl);
    if (spare_peer >= 0) close(spare_peer);
    spare_ctl = -1; spare_peer = -1; spare_pid = -1;
}

/* 1 if the spare can take a command: alive, not exiting, and no SIGKILL pending. A command (same
 * uid) may have killed it, and SIGKILL is acted on only when the spare next runs: a dying spare
 * would take the command and die with it (EXIT_SHEPHERD_DIED). /proc/PID/stat, proc(5): field 3
 * (state: Z, X once dead), field 9 (the kernel's task flags: PF_EXITING, set by do_exit's
 * exit_signals, from just after the spare dequeued the SIGKILL until it is a zombie: the
 * exit itself, 0.1 ms to ms on a loaded host, in which state is still R or D and field 31 no
 * longer shows the signal; a loaded .ci/run handed a command to such a spare) and field 31 (the
 * pending signals: kill(2) of SIGKILL adds it there at once, complete_signal; a fatal signal the
 * spare does not catch, SEGV say, is turned into a SIGKILL there too). ~25 us here (status
 * costs ~40 and has no flags), against ~100 us for the fork it saves. One window no field
 * shows: get_signal has dequeued the SIGKILL (field 31 clear) and do_exit has not yet set
 * PF_EXITING; a command handed over then is still queued, unread, when the spare is reaped,
 * and retake hands it to a fresh spare (a loaded .ci/run hit it once). */
#define LL_PF_EXITING 0x00000004u /* include/linux/sched.h PF_EXITING */
static int spare_usable(void) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)spare_pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ' || p[2] == 'Z' || p[2] == 'X' || p[2] == 'x') return 0;
    p += 2;  /* field 3; each later field follows one space */
    for (int field = 3; field < 31; field++) {
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
        if (field + 1 == 9 && (strtoull(p, NULL, 10) & LL_PF_EXITING)) return 0;
    }
    return !((strtoull(p, NULL, 10) >> (SIGKILL - 1)) & 1);
}

/* Hand the SPAWN in buf (and fds, and llfd, the Landlock ruleset, -1: none) to the spare: 0,
 * or -1 with errno. */
static int hand_over(char *buf, size_t len, const int *fds, int nfds, int llfd) {
    int all[MAX_FDS + 1], n = 0;
    for (int i = 0; i < nfds; i++) all[n++] = fds[i];
    struct spawn_hdr *h = (void *)buf;
    if (llfd >= 0) { all[n++] = llfd; h->flags |= SPAWN_FWD_LL_FD; }
    char cbuf[CMSG_SPACE((MAX_FDS + 1) * sizeof(int))];
    struct iovec iov = { buf, len };
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    memset(cbuf, 0, sizeof cbuf);
    mh.msg_iov = &iov; mh.msg_iovlen = 1;
    if (n) {
        mh.msg_control = cbuf; mh.msg_controllen = CMSG_SPACE((size_t)n * sizeof(int));
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET; cm->cmsg_type = SCM_RIGHTS; cm->cmsg_len = CMSG_LEN((size_t)n * sizeof(int));
        memcpy(CMSG_DATA(cm), all, (size_t)n * sizeof(int));
    }
    /* A command may have stopped the spare (same uid): it would never take its command. */
    kill(spare_pid, SIGCONT);
    ssize_t r;
    do r = sendmsg(spare_ctl, &mh, MSG_NOSIGNAL | MSG_DONTWAIT); while (r < 0 && errno == EINTR);
    h->flags &= ~SPAWN_FWD_LL_FD;
    if (r == (ssize_t)len) return 0;
    if (r >= 0) errno = EMSGSIZE;
    return -1;
}

/* Close the init's copy of each started shepherd's control socket (see spare_peer) once its
 * SPAWN is read (nothing queued): a job then costs the init one fd, not two. One ioctl per job
 * still holding it, at each SPAWN: usually the previous command's alone. FIONREAD (SIOCINQ) on a
 * unix datagram socket: the size of the next queued message, 0 when none (unix(7)). */
static void settle_peers(void) {
    for (size_t i = 0; i < njobs; i++) {
        int queued = 1;
        if (jobs[i].peer >= 0 && ioctl(jobs[i].peer, FIONREAD, &queued) == 0 && queued == 0) {
            close(jobs[i].peer);
            jobs[i].peer = -1;
        }
    }
}

/* Hand the SPAWN in buf (fds, llfd as hand_over's) to the spare, forking one first if there is
 * none or it is unusable, and make it the job in slot (id, pid, control sockets); the next spare
 * is due. 0 (fds closed), or -1 with errno (fds still ours). */
static int give_to_spare(int sock, char *buf, size_t len, const int *fds, int nfds, int llfd, struct job *slot) {
    for (int attempt = 0; attempt < 2; attempt++) {
        if (spare_pid >= 0 && attempt == 0 && !spare_usable()) drop_spare();  /* reaped as an orphan */
        if (spare_pid < 0 && make_spare(sock) < 0) return -1;
        if (hand_over(buf, len, fds, nfds, llfd) == 0) {
            slot->id = ((const struct spawn_hdr *)(const void *)buf)->id;
            slot->pid = spare_pid; slot->ctl = spare_ctl; slot->peer = spare_peer;
            spare_pid = -1; spare_ctl = -1; spare_peer = -1;
            for (int i = 0; i < nfds; i++) close(fds[i]);
            spare_due = now_ns() + SPARE_LATE_NS;  /* the next one: see spare_due */
            return 0;
        }
        int err = errno;
        drop_spare();  /* dead (EPIPE) or unusable: reaped as an orphan; fork a fresh one */
        errno = err;
    }
    return -1;
}

/* One MSG_SPAWN from the host: hand it to the spare (give_to_spare). fds are ours to close. The
 * spare parses it (run_spawn). */
static void do_spawn(int sock, char *buf, size_t len, int *fds, int nfds) {
    const struct spawn_hdr *h = (const void *)buf;
    uint32_t id = h->id;
    int err = EINVAL;
    if (h->flags & SPAWN_FWD_LL_FD || nfds > MAX_FDS) goto fail;
    settle_peers();
    if (ll_fs_refresh() < 0) { err = errno; goto fail; }
    if (njobs == capjobs) {
        size_t ncap = capjobs ? capjobs * 2 : 16;
        struct job *nj = realloc(jobs, ncap * sizeof *nj);
        if (!nj) { err = ENOMEM; goto fail; }
        jobs = nj; capjobs = ncap;
    }
    if (give_to_spare(sock, buf, len, fds, nfds, ll_fs_fd, &jobs[njobs]) == 0) {
        jobs[njobs++].handovers = 1;
        return;
    }
    err = errno;
fail:
    for (int i = 0; i < nfds; i++) close(fds[i]);
    init_exit(sock, id, EXIT_SPAWN_FAILED, (uint32_t)err, 0);
}

#define MAX_QUEUED_SIGNALS 64

/* A shepherd died abnormally: if its command is still queued on its control socket, unread (the
 * spare died before it took it), hand it, and the signal requests queued after it, to a fresh
 * spare in the same slot: 1. A command the host cancelled meanwhile is not run: its EXIT is
 * sent here (-1). Else (it took its command, or MAX_HANDOVERS were tried: 0) the caller reports
 * EXIT_SHEPHERD_DIED; a fresh spare that could not be made is reported here (EXIT_SPAWN_FAILED,
 * its errno: -1). The old control sockets are closed in every case. */
static int retake(int sock, struct job *j) {
    int fds[MAX_FDS + 1], nfds = 0, truncated = 0, done = 0;
    ssize_t len = -1;
    if (j->peer >= 0) len = recv_with_fds(j->peer, msgbuf, MAX_MSG, MSG_DONTWAIT, fds, &nfds, &truncated);
    struct spawn_hdr *h = (void *)msgbuf;
    struct job old = *j;
    if (len >= (ssize_t)sizeof *h && !truncated && h->type == MSG_SPAWN && h->id == j->id && j->handovers < MAX_HANDOVERS) {
        struct signal_msg queued[MAX_QUEUED_SIGNALS];  /* the host's signal requests since, in order */
        int nq = 0, cancelled = 0;
        while (nq < MAX_QUEUED_SIGNALS && recv(old.peer, &queued[nq], sizeof queued[nq], MSG_DONTWAIT) == (ssize_t)sizeof queued[nq])
            if (queued[nq++].flags & SIGNAL_TREE) cancelled = 1;
        int llfd = -1;
        if (h->flags & SPAWN_FWD_LL_FD && nfds > 0) llfd = fds[--nfds];
        h->flags &= ~SPAWN_FWD_LL_FD;
        if (cancelled) {
            /* Never ran, cancelled by the host (a SIGNAL_TREE queued behind its SPAWN): the EXIT
             * the shepherd's kill_tree would have sent (SIGKILL's wait status, EXITF_CANCELLED). */
            init_exit(sock, old.id, EXIT_WAIT_STATUS, SIGKILL, EXITF_CANCELLED);
            done = -1;
        } else if (give_to_spare(sock, msgbuf, (size_t)len, fds, nfds, llfd, j) == 0) {
            nfds = 0;
            j->handovers = old.handovers + 1;
            for (int i = 0; i < nq; i++) send(j->ctl, &queued[i], sizeof queued[i], MSG_NOSIGNAL | MSG_DONTWAIT);
            done = 1;
        } else {
            init_exit(sock, old.id, EXIT_SPAWN_FAILED, (uint32_t)errno, 0);
            done = -1;
        }
        if (llfd >= 0) close(llfd);
    }
    for (int i = 0; i < nfds; i++) close(fds[i]);
    close(old.ctl);
    if (old.peer >= 0) close(old.peer);
    return done;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: lowlevel_init SOCK_FD IDLE_MS TOTAL_MS [CLOSE_FD [--ll...]]\n");
        return 2;
    }
    for (int i = 5; i < argc; i++) {
        if (ll_parse_opt(&ll, argv[i]) != 1) {
            fprintf(stderr, "lowlevel-init: bad option %s\n", argv[i]);
            return 2;
        }
    }
    int sock = atoi(argv[1]);
    int64_t idle_ns = atoll(argv[2]) * 1000000LL, total_ns = atoll(argv[3]) * 1000000LL;
    if (argc > 4) close(atoi(argv[4]));  /* the fd our binary was exec'd through */
    prctl(PR_SET_NAME, "lowlevel-init");
    /* Opened while still dumpable (PR_SET_DUMPABLE(0) makes /proc/self root-owned): the init
     * raises its oom_score_adj to 1000 around each shepherd's fork and lowers it back, so every
     * shepherd and command is born at 1000 and the memory cgroup's OOM killer picks a command,
     * never the init (whose death ends the session), and to IDLE_OOM_ADJ otherwise (see there).
     * Lowering back to it needs no privilege (it is above the floor, oom_score_adj_min, 0).
     * proc(5), /proc/pid/oom_score_adj. */
    const char *keep_adj = getenv("LOWLEVEL_NO_OOM_SCORE_ADJ");  /* "1": the old victim choice (tests) */
    if (!keep_adj || strcmp(keep_adj, "1") != 0) oom_adj_fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    set_oom_adj(IDLE_OOM_ADJ);
    /* Not dumpable: no ptrace, no /proc/PID/{mem,fd,environ} for the commands (same uid). */
    prctl(PR_SET_DUMPABLE, 0);
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    ignore_signals();
    int sfd = sigchld_fd();
    if (sfd < 0 || fcntl(sock, F_SETFD, FD_CLOEXEC) < 0) {
        fprintf(stderr, "lowlevel-init: setup failed: %s\n", strerror(errno));
        return 2;
    }
    int ll_abi = 0, ll_fd = ll_build(&ll, LL_PART_NET | LL_PART_SCOPE, &ll_abi);
    if (ll_fd >= 0 && ll_restrict(ll_fd) < 0) ll_abi = -1;
    if (ll_fd >= 0) close(ll_fd);
    if (ll_abi >= 0 && ll_fs_refresh() < 0) ll_abi = -1;
    if (ll_abi < 0) {
        fprintf(stderr, "lowlevel-init: landlock: %s\n", strerror(errno));
        return 5;
    }
    const char *deaths = getenv("LOWLEVEL_INIT_FAULT_SPARE_DEATHS");
    if (deaths) spare_deaths = atol(deaths);
    if (getenv("LOWLEVEL_INIT_NO_WARMUP") == NULL) {
        /* Warm-up: the first fork (and vfork) of a fresh sandbox costs ~1-3 ms more than the
         * next ones; pay it here, before HELLO, so the first command does not. */
        pid_t w = fork();
        if (w == 0) {
            pid_t v = vfork();
            if (v == 0) _exit(0);
            if (v > 0) waitpid(v, NULL, 0);
            _exit(0);
        }
        if (w > 0) waitpid(w, NULL, 0);
        drain_fd(sfd);
    }
    make_spare(sock);  /* the first command's shepherd; a failure is retried at its SPAWN */
    struct hello_msg hm = { MSG_HELLO, PROTO_VERSION, (uint32_t)getpid(), (uint32_t)ll_abi };
    send_msg(sock, &hm, sizeof hm);

    int64_t start = now_ns(), last_activity = start;
    for (;;) {
        int wait_ms = -1;
        int64_t now = now_ns();
        int64_t next = -1;
        if (total_ns > 0) next = start + total_ns;
        if (idle_ns > 0 && njobs == 0 && (next < 0 || last_activity + idle_ns < next)) next = last_activity + idle_ns;
        if (next >= 0) {
            if (next <= now) {
                uint32_t reason = (total_ns > 0 && now >= start + total_ns) ? BYE_TOTAL : BYE_IDLE;
                struct bye_msg b = { MSG_BYE, reason, 0, 0 };
                for (size_t i = 0; i < nout; i++) send_msg(sock, &outbox[i], sizeof outbox[i]);
                send_msg(sock, &b, sizeof b);
                return 0;  /* bwrap's PID 1 follows us; the kernel kills the namespace */
            }
            wait_ms = (int)((next - now + 999999) / 1000000);
        }
        if (spare_due && spare_pid < 0 && now >= spare_due) {
            spare_due = 0;
            make_spare(sock);  /* if it fails, the next SPAWN forks one itself */
            now = now_ns();
        }
        if (spare_due && spare_pid < 0) {
            int left_ms = (int)((spare_due - now + 999999) / 1000000);
            if (wait_ms < 0 || left_ms < wait_ms) wait_ms = left_ms;
        }
        struct pollfd p[2] = { { sock, (short)(POLLIN | (nout ? POLLOUT : 0)), 0 }, { sfd, POLLIN, 0 } };
        int n = poll(p, 2, wait_ms);
        if (n < 0) {
            if (errno == EINTR) continue;
            return 3;
        }
        if (p[0].revents & POLLOUT) flush_outbox(sock);
        if (p[1].revents) {
            drain_fd(sfd);
            int st;
            pid_t r;
            int orphans = 0;
            while ((r = waitpid(-1, &st, WNOHANG | WUNTRACED)) > 0) {
                if (WIFSTOPPED(st)) {
                    /* A command stopped a shepherd (same uid): resume it, or its command would
                     * never be reported (one without a timeout: the host waits for its EXIT). */
                    if (is_shepherd(r)) kill(r, SIGCONT);
                    continue;
                }
                if (r == spare_pid) { drop_spare(); continue; }  /* killed while waiting: fork anew */
                size_t i;
                for (i = 0; i < njobs && jobs[i].pid != r; i++) {}
                if (i == njobs) { orphans = 1; continue; }
                if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
                    orphans = 1;
                    int taken = retake(sock, &jobs[i]);
                    if (taken > 0) continue;  /* its command went to a fresh spare */
                    if (taken == 0) init_exit(sock, jobs[i].id, EXIT_SHEPHERD_DIED, (uint32_t)st, 0);
                } else {
                    close(jobs[i].ctl);
                    if (jobs[i].peer >= 0) close(jobs[i].peer);
                }
                jobs[i] = jobs[--njobs];
                last_activity = now_ns();
                if (spare_due) spare_due = last_activity;  /* its command is over: fork the spare now */
            }
            /* Anything reparented to us that is not a shepherd belonged to a shepherd that died. */
            if (orphans) kill_children(is_shepherd);
        }
        if (p[0].revents & ~POLLOUT) {
            char cbuf[CMSG_SPACE(MAX_FDS * sizeof(int))];
            struct iovec iov = { msgbuf, MAX_MSG };
            struct msghdr mh;
            memset(&mh, 0, sizeof mh);
            mh.msg_iov = &iov; mh.msg_iovlen = 1;
            mh.msg_control = cbuf; mh.msg_controllen = sizeof cbuf;
            ssize_t len = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
            if (len < 0) {
                if (errno == EAGAIN || errno == EINTR) continue;
                return 3;
            }
            if (len == 0) return 0;  /* the host closed its end: end the session */
            int fds[MAX_FDS], nfds = 0;
            for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
                if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
                    int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                    int *src = (int *)(void *)CMSG_DATA(cm);
                    for (int i = 0; i < k; i++) {
                        if (nfds < MAX_FDS) fds[nfds++] = src[i];
                        else close(src[i]);
                    }
                }
            }
            last_activity = now_ns();
            uint32_t type = len >= 4 ? *(uint32_t *)(void *)msgbuf : 0;
            if ((mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || type == 0) {
                for (int i = 0; i < nfds; i++) close(fds[i]);
                fprintf(stderr, "lowlevel-init: protocol error (truncated or empty message)\n");
                return 4;
            }
            if (type == MSG_SPAWN && (size_t)len >= sizeof(struct spawn_hdr)) {
                do_spawn(sock, msgbuf, (size_t)len, fds, nfds);
            } else if (type == MSG_SIGNAL && (size_t)len == sizeof(struct signal_msg)) {
                struct signal_msg *m = (void *)msgbuf;
                for (size_t i = 0; i < njobs; i++)
                    if (jobs[i].id == m->id) { send(jobs[i].ctl, m, sizeof *m, MSG_NOSIGNAL | MSG_DONTWAIT); break; }
                for (int i = 0; i < nfds; i++) close(fds[i]);
            } else {
                for (int i = 0; i < nfds; i++) close(fds[i]);
                fprintf(stderr, "lowlevel-init: protocol error (message type %u, %zd bytes)\n", type, len);
                return 4;
            }
        }
    }
}
