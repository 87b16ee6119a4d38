/* lowlevel_sys.h: the few system calls and string helpers lowlevel_landlock.h and the guard use.
 *
 * Two builds from one source:
 * - with libc (the session init; the guard on architectures below): ``lsys`` is syscall(2);
 * - with ``LOWLEVEL_NOLIBC`` (the guard on x86_64 and aarch64): a freestanding static binary,
 *   raw syscalls, no libc at all. glibc's static start-up (IRELATIVE relocations, TLS, ~25 page
 *   faults) costs ~0.3 ms of CPU per exec on a VM; the guard runs once per sandbox, so it is
 *   built without it (see setup.py and bench/README.md).
 *
 * Every wrapper returns -1 and sets ``errno`` on failure, as libc does.
 */
#ifndef LOWLEVEL_SYS_H
#define LOWLEVEL_SYS_H

#include <stddef.h>
#include <stdint.h>

#ifdef LOWLEVEL_NOLIBC

#include <asm/unistd.h>
#include <linux/errno.h>
#include <linux/fcntl.h>
#include <linux/prctl.h>
#include <linux/stat.h>

#if !defined(__x86_64__) && !defined(__aarch64__)
#error "LOWLEVEL_NOLIBC supports x86_64 and aarch64; build without it elsewhere"
#endif

static int ll_errno_value;
#define errno ll_errno_value

static inline long ll_raw6(long n, long a, long b, long c, long d, long e, long f) {
#if defined(__x86_64__)
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
#else
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    register long x5 __asm__("x5") = f;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory", "cc");
    return x0;
#endif
}

static inline long lsys6(long n, long a, long b, long c, long d, long e, long f) {
    long r = ll_raw6(n, a, b, c, d, e, f);
    if (r < 0 && r > -4096) { errno = (int)-r; return -1; }
    return r;
}

/* As lsys6, but the error comes back as -errno and the shared errno is left alone (for a
 * process that shares its memory with a CLONE_VM child). */
static inline long lsys6_ret(long n, long a, long b, long c, long d, long e, long f) {
    return ll_raw6(n, a, b, c, d, e, f);
}

/* The compiler may emit calls to these for struct copies and zeroing. */
void *memset(void *s, int c, size_t n);
void *memcpy(void *d, const void *s, size_t n);
void *memset(void *s, int c, size_t n) {
    unsigned char *p = s;
    while (n--) *p++ = (unsigned char)c;
    return s;
}
void *memcpy(void *d, const void *s, size_t n) {
    unsigned char *p = d;
    const unsigned char *q = s;
    while (n--) *p++ = *q++;
    return d;
}

static size_t ll_strlen(const char *s) { size_t n = 0; while (s[n]) n++; return n; }
static int ll_strncmp(const char *a, const char *b, size_t n) {
    for (; n; n--, a++, b++) {
        if (*a != *b) return (unsigned char)*a - (unsigned char)*b;
        if (!*a) return 0;
    }
    return 0;
}
static int ll_strcmp(const char *a, const char *b) { return ll_strncmp(a, b, (size_t)-1); }

#else /* libc */

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline long lsys6(long n, long a, long b, long c, long d, long e, long f) {
    return syscall(n, a, b, c, d, e, f);
}

static inline long lsys6_ret(long n, long a, long b, long c, long d, long e, long f) {
    long r = syscall(n, a, b, c, d, e, f);
    return r < 0 ? -errno : r;
}
#define ll_strlen strlen
#define ll_strncmp strncmp
#define ll_strcmp strcmp

#endif

#define lsys0(n) lsys6((n), 0, 0, 0, 0, 0, 0)
#define lsys1(n, a) lsys6((n), (long)(a), 0, 0, 0, 0, 0)
#define lsys2(n, a, b) lsys6((n), (long)(a), (long)(b), 0, 0, 0, 0)
#define lsys3(n, a, b, c) lsys6((n), (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define lsys4(n, a, b, c, d) lsys6((n), (long)(a), (long)(b), (long)(c), (long)(d), 0, 0)
#define lsys5(n, a, b, c, d, e) lsys6((n), (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), 0)

/* Parse a decimal int >= 0; -1 when not one. */
static int ll_atoi(const char *s) {
    long v = 0;
    if (!*s) return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || v > 100000000) return -1;
        v = v * 10 + (*s - '0');
    }
    return (int)v;
}

/* chdir(2) to ``path``, then prove with getcwd(2) that the new working directory lies inside
 * this process's root. A directory reached through a magic link to an open file of another
 * mount tree (``/proc/self/fd/N`` naming an fd of the host's ``/proc`` that bwrap held:
 * CVE-2024-21626, "leaky vessels") is outside it, and the kernel's getcwd then fails with
 * ENOENT or returns a path prefixed "(unreachable)" (d_path(9), fs/d_path.c). runc 1.1.12 checks
 * its cwd the same way. ``buf`` (``size`` bytes) receives the path.
 * Returns 0; LL_CWD_CHDIR (errno from chdir); LL_CWD_OUTSIDE (errno ENOENT or EPERM). */
#define LL_CWD_CHDIR 1
#define LL_CWD_OUTSIDE 2
static int ll_chdir_inside(const char *path, char *buf, size_t size) {
    if (lsys1(__NR_chdir, path) < 0) return LL_CWD_CHDIR;
    long n = lsys2(__NR_getcwd, buf, size);
    if (n < 0) { if (errno != ENOENT) errno = EPERM; return LL_CWD_OUTSIDE; }
    if (n < 2 || buf[0] != '/') { errno = EPERM; return LL_CWD_OUTSIDE; }
    return 0;
}

/* Signals 32 and 33, glibc's internal SIGCANCEL and SIGSETXID, back to SIG_DFL: the caller's
 * glibc posix_spawn of the anchor sets them to SIG_IGN in its child (spawni.c: "the internal
 * signals ... SIG_IGN"), glibc's sigaction refuses to touch them (so
 * posix_spawnattr_setsigdefault cannot reset them), and SIG_IGN survives every execve down to the
 * program, where a shell's fork+exec would give SIG_DFL. Measured: 32/33 ignored in every
 * sandboxed program, whether or not the caller ignored them. The raw syscall with the kernel's
 * struct sigaction (handler, flags, restorer, mask: one layout on x86_64 and aarch64; the mask
 * is 8 bytes). Called by the guard's child and the session init's command child before exec. */
static void ll_default_glibc_signals(void) {
    static const unsigned long dfl[4] = { 0 /* SIG_DFL */, 0, 0, 0 };
    lsys4(__NR_rt_sigaction, 32, dfl, 0, 8);
    lsys4(__NR_rt_sigaction, 33, dfl, 0, 8);
}

/* The file type bits (S_IFMT) of an open fd, or -1. statx: one layout on every architecture. */
static long ll_fd_type(int fd) {
    struct statx stx;
    if (lsys5(__NR_statx, fd, "", AT_EMPTY_PATH, STATX_TYPE, &stx) < 0) return -1;
    return stx.stx_mode & 0170000;
}

#endif
