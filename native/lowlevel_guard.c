/* lowlevel_guard: the first program of a fresh sandbox (lowlevel.run, arun, the CLI, MCP).
 *
 * bwrap execs this (through an fd the host passes in, /proc/self/fd/N: no bind mount) in
 * place of the user's program. It
 *
 *   1. builds the Landlock ruleset the host derived from the Policy (lowlevel_landlock.h),
 *   2. vforks; the child resets every signal disposition and the mask, starts a new session
 *      (as bwrap --new-session did for the program), restricts itself with the ruleset and
 *      execvp()s the program (the same PATH search and ENOEXEC /bin/sh fallback as bwrap's
 *      own execvp),
 *   3. reports to the host over a pipe: START (the Landlock ABI the program will run under)
 *      before the vfork (the program could otherwise end the guard before it says so), then
 *      EXIT with the program's exact wait status; or FAIL (errno and stage) when the ruleset
 *      or the exec failed,
 *   4. exits with the program's code (128+N after death by signal N, as bwrap encodes it).
 *
 * The guard itself stays outside the program's Landlock domain, so with ABI >= 6 (the
 * signal scope) the program cannot signal it; without that it ignores every catchable
 * signal, and it is not dumpable (no /proc/PID/fd, so the report pipe is out of reach). Its
 * wait status is the fact bwrap's exit code cannot carry: "exit 152" and "killed by SIGXCPU"
 * are the same 152 to bwrap.
 *
 * Usage: lowlevel_guard --fd=EXE_FD --status=FD [--ll...] -- PROGRAM [ARG...]
 * Exit: the program's code; 127 (not found) or 126 (not executable) when exec failed; 125
 * when the guard could not set up (bad usage, Landlock failed).
 *
 * Static, no allocation, only syscalls the default seccomp profile allows (vfork, execve,
 * wait4, prctl, setsid, the landlock_* calls).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lowlevel_landlock.h"

/* Records on the status fd (16 bytes, native byte order), mirrored in lowlevel/landlock.py. */
#define REC_START 1 /* a: Landlock ABI applied (0: none) */
#define REC_EXIT 2  /* a: wait status */
#define REC_FAIL 3  /* a: errno, b: stage */
#define STAGE_LANDLOCK 1
#define STAGE_EXEC 2
#define STAGE_FORK 3

struct rec { uint32_t type, a, b, c; };

static int status_fd = -1;
/* Shared with the vfork child (same memory until it execs or exits). */
static volatile int child_errno, child_stage;

static void report(uint32_t type, uint32_t a, uint32_t b) {
    struct rec r = { type, a, b, 0 };
    if (status_fd >= 0)
        while (write(status_fd, &r, sizeof r) < 0 && errno == EINTR) {}
}

static void die_setup(int stage, int err, const char *what) {
    report(REC_FAIL, (uint32_t)err, (uint32_t)stage);
    fprintf(stderr, "lowlevel-guard: %s: %s\n", what, strerror(err));
    _exit(125);
}

static const int ignored_signals[] = {
    SIGHUP, SIGINT, SIGQUIT, SIGPIPE, SIGALRM, SIGTERM, SIGUSR1, SIGUSR2, SIGTSTP, SIGTTIN,
    SIGTTOU, SIGXCPU, SIGXFSZ, SIGVTALRM, SIGPROF, SIGIO, SIGPWR, SIGURG, SIGWINCH,
};

static __attribute__((noinline)) pid_t spawn(char **argv, int ruleset) {
    child_errno = 0;
    child_stage = 0;
    pid_t pid = vfork();
    if (pid == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = SIG_DFL;
        for (size_t i = 0; i < sizeof ignored_signals / sizeof ignored_signals[0]; i++)
            sigaction(ignored_signals[i], &sa, NULL);
        for (int s = SIGRTMIN; s <= SIGRTMAX; s++) sigaction(s, &sa, NULL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        setsid();
        if (ruleset >= 0 && ll_restrict(ruleset) < 0) {
            child_errno = errno; child_stage = STAGE_LANDLOCK; _exit(125);
        }
        execvp(argv[0], argv);
        child_errno = errno ? errno : ENOEXEC;
        child_stage = STAGE_EXEC;
        _exit(errno == ENOENT ? 127 : 126);
    }
    return pid;
}

int main(int argc, char **argv) {
    struct ll_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.mode = LL_OFF;
    int exe_fd = -1, i;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) { i++; break; }
        if (strncmp(a, "--fd=", 5) == 0) exe_fd = atoi(a + 5);
        else if (strncmp(a, "--status=", 9) == 0) status_fd = atoi(a + 9);
        else if (ll_parse_opt(&spec, a) != 1) {
            fprintf(stderr, "lowlevel-guard: bad option %s\n", a);
            return 125;
        }
    }
    if (i >= argc) {
        fprintf(stderr, "usage: lowlevel_guard --fd=EXE_FD --status=FD [--ll...] -- PROGRAM [ARG...]\n");
        return 125;
    }
    if (exe_fd >= 0) close(exe_fd);  /* the fd our binary was exec'd through */
    if (status_fd >= 0 && fcntl(status_fd, F_SETFD, FD_CLOEXEC) < 0) status_fd = -1;
    prctl(PR_SET_NAME, "lowlevel-guard");
    prctl(PR_SET_DUMPABLE, 0);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_IGN;
    for (size_t k = 0; k < sizeof ignored_signals / sizeof ignored_signals[0]; k++)
        sigaction(ignored_signals[k], &sa, NULL);
    for (int s = SIGRTMIN; s <= SIGRTMAX; s++) sigaction(s, &sa, NULL);

    int abi = 0;
    int ruleset = ll_build(&spec, &abi);
    if (ruleset < 0 && abi < 0) die_setup(STAGE_LANDLOCK, errno, "landlock");

    report(REC_START, (uint32_t)abi, 0);
    pid_t pid = spawn(argv + i, ruleset);
    int err = errno;
    if (ruleset >= 0) close(ruleset);
    if (pid < 0) die_setup(STAGE_FORK, err, "vfork");
    if (child_errno) {
        int st;
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
        report(REC_FAIL, (uint32_t)child_errno, (uint32_t)child_stage);
        if (child_stage == STAGE_EXEC) {
            /* The host turns this into ExecError; the message is for a terminal (capture=False). */
            fprintf(stderr, "lowlevel: execvp %s: %s\n", argv[i], strerror(child_errno));
            _exit(child_errno == ENOENT ? 127 : 126);
        }
        fprintf(stderr, "lowlevel-guard: landlock_restrict_self: %s\n", strerror(child_errno));
        _exit(125);
    }
    /* The program has its own copies; ours would keep a closed reader's pipe alive (no EPIPE). */
    close(0); close(1); close(2);
    int st;
    while (waitpid(pid, &st, 0) < 0) {
        if (errno != EINTR) _exit(125);
    }
    report(REC_EXIT, (uint32_t)st, 0);
    if (WIFSIGNALED(st)) _exit(128 + WTERMSIG(st));
    _exit(WEXITSTATUS(st));
}
