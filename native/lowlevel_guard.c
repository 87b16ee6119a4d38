/* lowlevel_guard: the first program of a fresh sandbox (lowlevel.run, arun, the CLI, MCP).
 *
 * bwrap execs this (through an fd the host passes in, /proc/self/fd/N: no bind mount) in
 * place of the user's program. It
 *
 *   1. builds the Landlock ruleset the host derived from the Policy (lowlevel_landlock.h),
 *   2. reports START (the Landlock ABI the program will run under) to the host over a pipe,
 *      before the fork (the program could otherwise end the guard before it says so),
 *   3. starts a child (clone(CLONE_VM) on a stack of its own: no page tables copied, and the
 *      guard does not sleep until the exec as after vfork); the child restores the signal mask
 *      bwrap gave and keeps bwrap's dispositions but for signals 32 and 33, which it resets to
 *      SIG_DFL (ll_default_glibc_signals in lowlevel_sys.h: glibc's posix_spawn ignores them
 *      above bwrap), starts a new session (as bwrap --new-session did for the program), restricts itself with the
 *      ruleset and execs the program with execvp(3)'s rules (PATH search, EACCES remembered, ENOEXEC run
 *      by /bin/sh: the same as bwrap's own execvp); when that fails it reports FAIL (errno
 *      and stage) and exits 127 (not found) or 126,
 *   4. waits for the program, reports EXIT with its exact wait status, and exits with its
 *      code (128+N after death by signal N, as bwrap encodes it).
 *
 * In a plain run the guard is the PID 1 of the sandbox's PID namespace (bwrap --as-pid-1, in
 * place of bwrap's reaper): it reaps orphans, and the kernel delivers no signal from inside the
 * namespace to it (it installs no handler). Behind the egress relay it is not PID 1; then it
 * stays outside the program's Landlock domain, so with ABI >= 6 (the signal scope) the program
 * cannot signal it, and it blocks every catchable signal (one rt_sigprocmask: a `kill -TERM -1`
 * cleanup does not end it). Either way it is not dumpable (no /proc/PID/fd, so the report pipe is out of reach). Its
 * wait status is the fact bwrap's exit code cannot carry: "exit 152" and "killed by SIGXCPU"
 * are the same 152 to bwrap.
 *
 * The working directory: bwrap is given ``--chdir /`` and the guard changes to ``--cwd`` itself,
 * after bwrap closed its fds (bwrap 0.8.0 runs ``--chdir`` while it holds an O_PATH fd of the
 * host's /proc: a cwd of /proc/self/fd/N was the host's /proc, CVE-2024-21626 class), checks
 * with getcwd(2) that it is inside the sandbox's root (ll_chdir_inside), and sets PWD to it in
 * place of bwrap's "PWD=/". Either failure is reported (STAGE_CHDIR, STAGE_CWD) before any
 * program runs.
 *
 * Usage: lowlevel_guard [--fd=EXE_FD] [--status=FD] [--cwd=DIR] [--ll...] -- PROGRAM [ARG...]
 * Exit: the program's code; 127/126 when its exec failed; 125 when the guard could not set
 * up (bad usage, Landlock failed).
 *
 * Built freestanding on x86_64 and aarch64 (LOWLEVEL_NOLIBC, lowlevel_sys.h: no libc start-up,
 * ~0.3 ms less per sandbox), with libc elsewhere. No allocation; only syscalls the default
 * seccomp profile allows (clone, execve, wait4, prctl, setsid, rt_sigprocmask, rt_sigaction,
 * landlock_*). Every syscall also runs the sandbox's seccomp filter, so the guard makes few: ~47 in all.
 */
#define _GNU_SOURCE
#include "lowlevel_landlock.h"

#ifndef LOWLEVEL_NOLIBC
#include <signal.h>
#endif

/* Records on the status fd (16 bytes, native byte order), mirrored in lowlevel/landlock.py. */
#define REC_START 1 /* a: Landlock ABI applied (0: none) */
#define REC_EXIT 2  /* a: wait status */
#define REC_FAIL 3  /* a: errno, b: stage */
#define STAGE_LANDLOCK 1
#define STAGE_EXEC 2
#define STAGE_FORK 3
#define STAGE_CHDIR 4 /* chdir(--cwd) failed */
#define STAGE_CWD 5   /* --cwd resolved outside the sandbox's root (ll_chdir_inside) */

#define G_SIGCHLD 17
#define G_SIG_SETMASK 2
#define G_EINTR 4

struct rec { uint32_t type, a, b, c; };

static int status_fd = -1;

static void put(int fd, const char *s) { lsys3(__NR_write, fd, s, ll_strlen(s)); }

/* Used by the guard and its child while they share memory: leaves errno alone. */
static void report(uint32_t type, uint32_t a, uint32_t b) {
    struct rec r = { type, a, b, 0 };
    if (status_fd >= 0)
        while (lsys6_ret(__NR_write, status_fd, (long)&r, sizeof r, 0, 0, 0) == -G_EINTR) {}
}

static __attribute__((noreturn)) void leave(int code) {
    for (;;) lsys1(__NR_exit_group, code);
}

/* The signal mask bwrap gave us: the guard blocks everything else (SIGKILL and SIGSTOP cannot
 * be) and the child restores this before exec. Written before the child exists, then read only. */
static unsigned long bwrap_mask;

/* execvp(3): glibc's rules (posix/execvpe.c), which bwrap's own exec followed. Returns errno. */
static int exec_search(char **argv, char **envp) {
    const char *file = argv[0];
    if (!*file) return ENOENT;
    int argc = 0;
    while (argv[argc]) argc++;
    char *sh_argv[argc + 2];
    int has_slash = 0;
    for (const char *p = file; *p; p++) if (*p == '/') has_slash = 1;
    if (has_slash) {
        lsys3(__NR_execve, file, argv, envp);
        if (errno == ENOEXEC) {
            sh_argv[0] = "/bin/sh"; sh_argv[1] = (char *)file;
            for (int k = 1; k <= argc; k++) sh_argv[k + 1] = argv[k];
            lsys3(__NR_execve, "/bin/sh", sh_argv, envp);
            errno = ENOEXEC;
        }
        return errno;
    }
    const char *path = "/bin:/usr/bin";  /* confstr(_CS_PATH), glibc's default */
    for (char **e = envp; *e; e++)
        if (ll_strncmp(*e, "PATH=", 5) == 0) { path = *e + 5; break; }
    size_t flen = ll_strlen(file);
    if (flen > 255) return ENAMETOOLONG;
    char buf[4096 + 256 + 2];
    int saw_eacces = 0;
    for (const char *p = path;;) {
        const char *end = p;
        while (*end && *end != ':') end++;
        size_t dlen = (size_t)(end - p);
        if (dlen <= 4096) {
            memcpy(buf, p, dlen);
            if (dlen) buf[dlen++] = '/';
            memcpy(buf + dlen, file, flen + 1);
            lsys3(__NR_execve, buf, argv, envp);
            int e = errno;
            if (e == ENOEXEC) {
                sh_argv[0] = "/bin/sh"; sh_argv[1] = buf;
                for (int k = 1; k <= argc; k++) sh_argv[k + 1] = argv[k];
                lsys3(__NR_execve, "/bin/sh", sh_argv, envp);
                return ENOEXEC;
            }
            if (e == EACCES) saw_eacces = 1;
            else if (e != ENOENT && e != ENOTDIR && e != ESTALE && e != ENODEV && e != ETIMEDOUT) return e;
        }
        if (!*end) break;
        p = end + 1;
    }
    return saw_eacces ? EACCES : ENOENT;
}

static __attribute__((noreturn)) void child(char **argv, char **envp, int ruleset) {
    ll_default_glibc_signals();  /* this child's own dispositions: clone without CLONE_SIGHAND */
    lsys4(__NR_rt_sigprocmask, G_SIG_SETMASK, &bwrap_mask, 0, 8);
    lsys0(__NR_setsid);
    if (ruleset >= 0 && ll_restrict(ruleset) < 0) {
        report(REC_FAIL, (uint32_t)errno, STAGE_LANDLOCK);
        leave(125);
    }
    int e = exec_search(argv, envp);
    report(REC_FAIL, (uint32_t)e, STAGE_EXEC);
    leave(e == ENOENT ? 127 : 126);
}

struct child_args { char **argv, **envp; int ruleset; };

static __attribute__((noreturn, used)) void child_entry(struct child_args *a) {
    child(a->argv, a->envp, a->ruleset);
}

/* Start child_entry(a) in a new process sharing the guard's memory until it execs (CLONE_VM:
 * no page tables copied; without CLONE_VFORK the guard goes straight on to wait4 instead of
 * sleeping until the exec and being woken: one scheduler hand-off less per sandbox), on a
 * stack of its own, so nothing the child does touches the guard's frames. The guard reads no
 * shared state the child writes (errno included: see lsys6_ret) once the child exists.
 * Returns the pid, or -1 with errno. */
static long spawn_child(struct child_args *a) {
#ifdef LOWLEVEL_NOLIBC
    static char stack[64 * 1024] __attribute__((aligned(16)));
    long flags = 0x00000100 /* CLONE_VM */ | G_SIGCHLD;
    char *top = stack + sizeof stack;
#if defined(__x86_64__)
    register long r10 __asm__("r10") = 0;
    register long r8 __asm__("r8") = 0;
    long ret;
    __asm__ volatile("syscall\n\t"
                     "test %%rax, %%rax\n\t"
                     "jnz 1f\n\t"
                     "mov %[arg], %%rdi\n\t"
                     "call *%[fn]\n\t"
                     "hlt\n"
                     "1:"
                     : "=a"(ret)
                     : "a"((long)__NR_clone), "D"(flags), "S"(top), "d"(0L), "r"(r10), "r"(r8),
                       [fn] "r"(child_entry), [arg] "r"(a)
                     : "rcx", "r11", "memory");
#else
    register long x8 __asm__("x8") = __NR_clone;
    register long x0 __asm__("x0") = flags;
    register long x1 __asm__("x1") = (long)top;
    register long x2 __asm__("x2") = 0;
    register long x3 __asm__("x3") = 0;
    register long x4 __asm__("x4") = 0;
    register long x9 __asm__("x9") = (long)child_entry;
    register long x10 __asm__("x10") = (long)a;
    __asm__ volatile("svc 0\n\t"
                     "cbnz x0, 1f\n\t"
                     "mov x0, x10\n\t"
                     "blr x9\n\t"
                     "brk #0\n"
                     "1:"
                     : "+r"(x0)
                     : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x9), "r"(x10)
                     : "memory", "cc", "x30");
    long ret = x0;
#endif
    if (ret < 0 && ret > -4096) { errno = (int)-ret; return -1; }
    return ret;
#else
    long pid = lsys5(__NR_clone, G_SIGCHLD, 0, 0, 0, 0);  /* fork(2) */
    if (pid == 0) child_entry(a);
    return pid;
#endif
}

static int guard_main(int argc, char **argv, char **envp) {
    struct ll_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.mode = LL_OFF;
    int exe_fd = -1, i;
    const char *cwd = 0;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (ll_strcmp(a, "--") == 0) { i++; break; }
        if (ll_strncmp(a, "--fd=", 5) == 0) exe_fd = ll_atoi(a + 5);
        else if (ll_strncmp(a, "--cwd=", 6) == 0) cwd = a + 6;
        else if (ll_strncmp(a, "--status=", 9) == 0) status_fd = ll_atoi(a + 9);
        else if (ll_parse_opt(&spec, a) != 1) {
            put(2, "lowlevel-guard: bad option ");
            put(2, a);
            put(2, "\n");
            return 125;
        }
    }
    if (i >= argc) {
        put(2, "usage: lowlevel_guard [--fd=EXE_FD] [--status=FD] [--cwd=DIR] [--ll...] -- PROGRAM [ARG...]\n");
        return 125;
    }
    if (exe_fd >= 0) lsys1(__NR_close, exe_fd);  /* the fd our binary was exec'd through */
    if (status_fd >= 0 && lsys3(__NR_fcntl, status_fd, F_SETFD, FD_CLOEXEC) < 0) status_fd = -1;
    lsys5(__NR_prctl, PR_SET_NAME, "lowlevel-guard", 0, 0, 0);
    /* The program is the memory cgroup's OOM victim, not us: oom_score_adj 1000, inherited by
     * the child (its own copy: the guard stays at 1000 too, but with a few pages of RSS against
     * any program's, so the OOM killer's points, RSS + totalpages for both, pick the program).
     * Written before PR_SET_DUMPABLE(0), which makes /proc/self root-owned; raising needs no
     * privilege (proc(5), /proc/pid/oom_score_adj). Best effort: no /proc, no change. */
    int keep_adj = 0;  /* LOWLEVEL_NO_OOM_SCORE_ADJ=1 in the environment: the old victim choice (tests) */
    for (char **e = envp; *e; e++)
        if (ll_strcmp(*e, "LOWLEVEL_NO_OOM_SCORE_ADJ=1") == 0) keep_adj = 1;
    long adj = keep_adj ? -1 : lsys4(__NR_openat, AT_FDCWD, "/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC, 0);
    if (adj >= 0) {
        lsys3(__NR_write, adj, "1000", 4);
        lsys1(__NR_close, adj);
    }
    lsys5(__NR_prctl, PR_SET_DUMPABLE, 0, 0, 0, 0);
    unsigned long all = ~0UL;
    lsys4(__NR_rt_sigprocmask, G_SIG_SETMASK, &all, &bwrap_mask, 8);

    if (cwd) {
        /* "PWD=" + the directory, replacing bwrap's entry in place (the order of environ stays). */
        static char pwd[4 + 4096 + 1];
        int r = ll_chdir_inside(cwd, pwd + 4, sizeof pwd - 4);
        if (r) {
            /* The host words the error (it knows the caller's cwd): nothing on the program's stderr. */
            report(REC_FAIL, (uint32_t)errno, r == LL_CWD_CHDIR ? STAGE_CHDIR : STAGE_CWD);
            return 125;
        }
        size_t n = ll_strlen(cwd);
        if (n < sizeof pwd - 4) {
            memcpy(pwd, "PWD=", 4);
            memcpy(pwd + 4, cwd, n + 1);
            for (char **e = envp; *e; e++)
                if (ll_strncmp(*e, "PWD=", 4) == 0) { *e = pwd; break; }
        }
    }

    int abi = 0;
    int ruleset = ll_build(&spec, LL_PART_ALL, &abi);
    if (ruleset < 0 && abi < 0) {
        report(REC_FAIL, (uint32_t)errno, STAGE_LANDLOCK);
        put(2, "lowlevel-guard: cannot set up Landlock\n");
        return 125;
    }
    report(REC_START, (uint32_t)abi, 0);
    struct child_args ca = { argv + i, envp, ruleset };
    long pid = spawn_child(&ca);
    if (pid < 0) {
        report(REC_FAIL, (uint32_t)errno, STAGE_FORK);
        return 125;
    }
    /* From here on the child may be running in our memory: no errno, no shared writes. */
    if (ruleset >= 0) lsys6_ret(__NR_close, ruleset, 0, 0, 0, 0, 0);
    /* The program has its own copies; ours would keep a closed reader's pipe alive (no EPIPE). */
    for (long fd = 0; fd < 3; fd++) lsys6_ret(__NR_close, fd, 0, 0, 0, 0, 0);
    /* As the PID 1 of the sandbox's PID namespace (bwrap --as-pid-1) orphans come to us too:
     * reap them as they end, until the program itself does. */
    int st = 0;
    for (;;) {
        long r = lsys6_ret(__NR_wait4, -1, (long)&st, 0, 0, 0, 0);
        if (r == pid) break;
        if (r < 0 && r != -G_EINTR) return 125;
    }
    report(REC_EXIT, (uint32_t)st, 0);
    if ((st & 0x7f) != 0 && (st & 0x7f) != 0x7f) return 128 + (st & 0x7f);  /* WIFSIGNALED */
    return (st >> 8) & 0xff;                                                /* WEXITSTATUS */
}

#ifdef LOWLEVEL_NOLIBC
/* The process entry: the kernel leaves argc, argv[], NULL, envp[], NULL on the stack. */
void start_c(long *sp);
__attribute__((used, noinline, noreturn)) void start_c(long *sp) {
    int argc = (int)sp[0];
    char **argv = (char **)(sp + 1);
    leave(guard_main(argc, argv, argv + argc + 1));
}
#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n\txor %rbp, %rbp\n\tmov %rsp, %rdi\n\tand $-16, %rsp\n"
        "\tcall start_c\n\thlt\n");
#else
__asm__(".text\n.global _start\n_start:\n\tmov x29, #0\n\tmov x30, #0\n\tmov x0, sp\n\tand sp, x0, #-16\n"
        "\tbl start_c\n\tbrk #0\n");
#endif
#else
int main(int argc, char **argv, char **envp) { return guard_main(argc, argv, envp); }
#endif
