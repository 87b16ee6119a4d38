/* lowlevel_landlock.h: the Landlock ruleset of a sandbox, built from command-line options.
 *
 * Header-only, shared by the run guard (lowlevel_guard.c) and the session init
 * (lowlevel_init.c). Both run inside the sandbox, after bwrap has set up the mounts, so the
 * rules name sandbox paths; the host (lowlevel/landlock.py) derives the options from the
 * Policy:
 *
 *   --ll=MODE        off | on (best effort: no Landlock in the kernel, none applied) | require
 *   --ll-rx=PATH     read files, list directories and execute beneath PATH (read-only mounts)
 *   --ll-rw=PATH     every filesystem right beneath PATH (workspace, /tmp, /dev/shm, writable binds)
 *   --ll-dev=PATH    read, write and ioctl existing device files beneath PATH (/dev, mounted read-only)
 *   --ll-proc=PATH   read and write existing files beneath PATH (/proc; /proc/sys is read-only)
 *   --ll-ls=PATH     list directories beneath PATH (only that: "/", so `ls /` works)
 *   --ll-unix=PATH   connect to pathname unix sockets beneath PATH made outside the program's
 *                    domain (ABI >= 9; --ll-rw does not grant it): /tmp, /dev/shm, /workspace and
 *                    binds with allow_sockets
 *   --ll-net=MODE    TCP (ABI >= 4): none (no bind, no connect) | connect (connect only) | any |
 *                    port:N (no bind, connect to port N only: the egress proxy's relay)
 *   --ll-abi-max=N   use at most ABI N (tests of the fallbacks)
 *
 * Rights the running kernel does not know are dropped (best effort down to ABI 1, as in the
 * kernel's samples/landlock/sandboxer.c): REFER needs ABI 2 (before, the kernel refuses every
 * rename or link across directories with EXDEV, which tools answer with a copy), TRUNCATE
 * ABI 3, TCP bind/connect ABI 4, IOCTL_DEV ABI 5, the abstract-unix-socket and signal scopes
 * ABI 6, RESOLVE_UNIX (connecting to pathname unix sockets) ABI 9 (Linux 7.1). The standard streams (fds 0-2) that are regular files or character devices get a
 * rule of their own matching their open mode, so reopening them through /dev/stdout (a
 * magic link to a host file or terminal, outside every rule) keeps working.
 *
 * Sources: Documentation/userspace-api/landlock.rst; landlock(7); landlock_create_ruleset(2),
 * landlock_add_rule(2), landlock_restrict_self(2); include/uapi/linux/landlock.h.
 */
#ifndef LOWLEVEL_LANDLOCK_H
#define LOWLEVEL_LANDLOCK_H

#include "lowlevel_sys.h"

/* Same numbers on every architecture (the unified syscall table, Linux 5.13). */
#ifndef __NR_landlock_create_ruleset
#define __NR_landlock_create_ruleset 444
#endif
#ifndef __NR_landlock_add_rule
#define __NR_landlock_add_rule 445
#endif
#ifndef __NR_landlock_restrict_self
#define __NR_landlock_restrict_self 446
#endif

#define LL_CREATE_RULESET_VERSION (1U << 0)
#define LL_RULE_PATH_BENEATH 1
#define LL_RULE_NET_PORT 2

#define LL_FS_EXECUTE (1ULL << 0)
#define LL_FS_WRITE_FILE (1ULL << 1)
#define LL_FS_READ_FILE (1ULL << 2)
#define LL_FS_READ_DIR (1ULL << 3)
#define LL_FS_REMOVE_DIR (1ULL << 4)
#define LL_FS_REMOVE_FILE (1ULL << 5)
#define LL_FS_MAKE_CHAR (1ULL << 6)
#define LL_FS_MAKE_DIR (1ULL << 7)
#define LL_FS_MAKE_REG (1ULL << 8)
#define LL_FS_MAKE_SOCK (1ULL << 9)
#define LL_FS_MAKE_FIFO (1ULL << 10)
#define LL_FS_MAKE_BLOCK (1ULL << 11)
#define LL_FS_MAKE_SYM (1ULL << 12)
#define LL_FS_REFER (1ULL << 13)     /* ABI 2 */
#define LL_FS_TRUNCATE (1ULL << 14)  /* ABI 3 */
#define LL_FS_IOCTL_DEV (1ULL << 15) /* ABI 5 */
#define LL_FS_RESOLVE_UNIX (1ULL << 16) /* ABI 9: connect/sendmsg to a pathname unix socket */
#define LL_NET_BIND_TCP (1ULL << 0)  /* ABI 4 */
#define LL_NET_CONNECT_TCP (1ULL << 1)
#define LL_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0) /* ABI 6 */
#define LL_SCOPE_SIGNAL (1ULL << 1)

#define LL_FS_V1 ((1ULL << 13) - 1)
#define LL_FS_READ (LL_FS_READ_FILE | LL_FS_READ_DIR)
/* Rights that apply to a file (not only to a directory); landlock_add_rule refuses others on a file. */
#define LL_FS_FILE (LL_FS_EXECUTE | LL_FS_WRITE_FILE | LL_FS_READ_FILE | LL_FS_TRUNCATE | LL_FS_IOCTL_DEV \
                    | LL_FS_RESOLVE_UNIX)

struct ll_ruleset_attr { uint64_t handled_access_fs, handled_access_net, scoped; };
struct ll_path_beneath_attr { uint64_t allowed_access; int32_t parent_fd; } __attribute__((packed));
struct ll_net_port_attr { uint64_t allowed_access, port; };

enum { LL_OFF = 0, LL_ON = 1, LL_REQUIRE = 2 };
enum { LL_NET_ANY = 0, LL_NET_CONNECT = 1, LL_NET_NONE = 2, LL_NET_PORT = 3 };
enum { LL_CLS_RX, LL_CLS_RW, LL_CLS_DEV, LL_CLS_PROC, LL_CLS_LS, LL_CLS_UNIX };

#define LL_MAX_RULES 128

struct ll_spec {
    int mode, net, net_port, abi_max;
    unsigned nrules;
    struct { const char *path; int cls; } rules[LL_MAX_RULES];
};

static uint64_t ll_class_rights(int cls) {
    switch (cls) {
    case LL_CLS_RX: return LL_FS_READ | LL_FS_EXECUTE;
    /* Every right (masked with the handled set) but connecting to sockets made outside the
     * domain: a writable bind may hold a host daemon's socket; --ll-unix grants that. */
    case LL_CLS_RW: return ~LL_FS_RESOLVE_UNIX;
    case LL_CLS_UNIX: return LL_FS_RESOLVE_UNIX;
    case LL_CLS_DEV: return LL_FS_READ | LL_FS_WRITE_FILE | LL_FS_TRUNCATE | LL_FS_IOCTL_DEV;
    case LL_CLS_PROC: return LL_FS_READ | LL_FS_WRITE_FILE | LL_FS_TRUNCATE;
    default: return LL_FS_READ_DIR;
    }
}

/* Parse one option into spec. Returns 1 when consumed, 0 when not a Landlock option, -1 when invalid. */
static int ll_parse_opt(struct ll_spec *s, const char *arg) {
    static const struct { const char *prefix; int cls; } paths[] = {
        { "--ll-rx=", LL_CLS_RX }, { "--ll-rw=", LL_CLS_RW }, { "--ll-dev=", LL_CLS_DEV },
        { "--ll-proc=", LL_CLS_PROC }, { "--ll-ls=", LL_CLS_LS }, { "--ll-unix=", LL_CLS_UNIX },
    };
    if (ll_strncmp(arg, "--ll", 4) != 0) return 0;
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        size_t n = ll_strlen(paths[i].prefix);
        if (ll_strncmp(arg, paths[i].prefix, n) == 0) {
            if (arg[n] != '/' || s->nrules >= LL_MAX_RULES) return -1;
            s->rules[s->nrules].path = arg + n;
            s->rules[s->nrules].cls = paths[i].cls;
            s->nrules++;
            return 1;
        }
    }
    if (ll_strcmp(arg, "--ll=off") == 0) { s->mode = LL_OFF; return 1; }
    if (ll_strcmp(arg, "--ll=on") == 0) { s->mode = LL_ON; return 1; }
    if (ll_strcmp(arg, "--ll=require") == 0) { s->mode = LL_REQUIRE; return 1; }
    if (ll_strcmp(arg, "--ll-net=any") == 0) { s->net = LL_NET_ANY; return 1; }
    if (ll_strcmp(arg, "--ll-net=connect") == 0) { s->net = LL_NET_CONNECT; return 1; }
    if (ll_strcmp(arg, "--ll-net=none") == 0) { s->net = LL_NET_NONE; return 1; }
    if (ll_strncmp(arg, "--ll-net=port:", 14) == 0) {
        int v = ll_atoi(arg + 14);
        if (v < 1 || v > 65535) return -1;
        s->net = LL_NET_PORT;
        s->net_port = v;
        return 1;
    }
    if (ll_strncmp(arg, "--ll-abi-max=", 13) == 0) {
        int v = ll_atoi(arg + 13);
        if (v < 1) return -1;
        s->abi_max = v;
        return 1;
    }
    return -1;
}

/* The kernel's Landlock ABI version, or 0 when Landlock is not built in or not enabled. */
static int ll_kernel_abi(void) {
    long v = lsys3(__NR_landlock_create_ruleset, 0, 0, LL_CREATE_RULESET_VERSION);
    return v > 0 ? (int)v : 0;
}

/* Rule for one standard stream that is a regular file or a character device (see above). */
static int ll_stdio_rule(int ruleset, int fd, uint64_t handled) {
    long fl = lsys2(__NR_fcntl, fd, F_GETFL), type = ll_fd_type(fd);
    if (fl < 0 || !(type == 0100000 || type == 0020000)) return 0;  /* S_IFREG, S_IFCHR */
    uint64_t want = 0;
    long acc = fl & O_ACCMODE;
    if (acc == O_RDONLY || acc == O_RDWR) want |= LL_FS_READ_FILE;
    if (acc == O_WRONLY || acc == O_RDWR) want |= LL_FS_WRITE_FILE | LL_FS_TRUNCATE;
    if (type == 0020000) want |= LL_FS_IOCTL_DEV;
    struct ll_path_beneath_attr pb = { want & handled & LL_FS_FILE, fd };
    if (!pb.allowed_access) return 0;
    return (int)lsys4(__NR_landlock_add_rule, ruleset, LL_RULE_PATH_BENEATH, &pb, 0);
}

/* Parts of the ruleset ll_build makes. The guard applies all of them at once; the session init
 * applies NET|SCOPE to itself (a domain every command shares, so commands can still signal
 * each other) and FS to each command in a nested domain, rebuilt when a watched mount point
 * changes (Landlock ignores rules on a mount point once another mount covers it: a Session's
 * reset stacks a fresh overlay on /workspace). */
#define LL_PART_FS 1u
#define LL_PART_NET 2u
#define LL_PART_SCOPE 4u
#define LL_PART_STDIO 8u  /* rules for fds 0-2 (with FS) */
#define LL_PART_ALL (LL_PART_FS | LL_PART_NET | LL_PART_SCOPE | LL_PART_STDIO)

/* Build the ruleset's ``parts``. Returns its fd (O_CLOEXEC); -1 with *abi_used >= 0 when none
 * is to be applied (mode off, no Landlock in the kernel in best-effort mode: 0; nothing these
 * parts handle at this ABI: the ABI); -1 with errno set and *abi_used = -1 on failure (require
 * without Landlock: EOPNOTSUPP). A rule path that cannot be opened (missing, not reachable) is
 * skipped: a missing rule only takes access away. */
static int ll_build(const struct ll_spec *s, unsigned parts, int *abi_used) {
    *abi_used = 0;
    if (s->mode == LL_OFF) return -1;
    int abi = ll_kernel_abi();
    if (s->abi_max && abi > s->abi_max) abi = s->abi_max;
    if (abi < 1) {
        if (s->mode == LL_REQUIRE) { *abi_used = -1; errno = EOPNOTSUPP; return -1; }
        return -1;
    }
    struct ll_ruleset_attr attr = { 0, 0, 0 };
    if (parts & LL_PART_FS) {
        attr.handled_access_fs = LL_FS_V1;
        if (abi >= 2) attr.handled_access_fs |= LL_FS_REFER;
        if (abi >= 3) attr.handled_access_fs |= LL_FS_TRUNCATE;
        if (abi >= 5) attr.handled_access_fs |= LL_FS_IOCTL_DEV;
        if (abi >= 9) attr.handled_access_fs |= LL_FS_RESOLVE_UNIX;
    }
    if ((parts & LL_PART_NET) && abi >= 4 && s->net != LL_NET_ANY)
        attr.handled_access_net = s->net == LL_NET_CONNECT ? LL_NET_BIND_TCP : (LL_NET_BIND_TCP | LL_NET_CONNECT_TCP);
    if ((parts & LL_PART_SCOPE) && abi >= 6) attr.scoped = LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL;
    if (!attr.handled_access_fs && !attr.handled_access_net && !attr.scoped) {
        *abi_used = abi;  /* nothing to restrict at this ABI */
        return -1;
    }
    /* Older kernels take the struct's first 8 or 16 bytes only (copy_struct_from_user). */
    size_t size = abi >= 6 ? sizeof attr : abi >= 4 ? 2 * sizeof(uint64_t) : sizeof(uint64_t);
    int rs = (int)lsys3(__NR_landlock_create_ruleset, &attr, size, 0);
    if (rs < 0) { *abi_used = -1; return -1; }
    if ((attr.handled_access_net & LL_NET_CONNECT_TCP) && s->net == LL_NET_PORT) {
        struct ll_net_port_attr np = { LL_NET_CONNECT_TCP, (uint64_t)s->net_port };
        if (lsys4(__NR_landlock_add_rule, rs, LL_RULE_NET_PORT, &np, 0) < 0) goto fail;
    }
    for (unsigned i = 0; i < s->nrules && (parts & LL_PART_FS); i++) {
        int fd = (int)lsys4(__NR_openat, AT_FDCWD, s->rules[i].path, O_PATH | O_CLOEXEC, 0);
        if (fd < 0) continue;  /* missing or unreachable: the rule would only have granted access */
        uint64_t rights = ll_class_rights(s->rules[i].cls) & attr.handled_access_fs;
        struct ll_path_beneath_attr pb = { rights, fd };
        long r = rights ? lsys4(__NR_landlock_add_rule, rs, LL_RULE_PATH_BENEATH, &pb, 0) : 0;
        if (r < 0 && errno == EINVAL && (rights & ~LL_FS_FILE)) {
            /* Not a directory (a bind of one file): only the rights that apply to a file. (No
             * fstat first: every syscall here also runs the sandbox's seccomp filter.) */
            pb.allowed_access = rights & LL_FS_FILE;
            r = pb.allowed_access ? lsys4(__NR_landlock_add_rule, rs, LL_RULE_PATH_BENEATH, &pb, 0) : 0;
        }
        int e = errno;
        lsys1(__NR_close, fd);
        if (r < 0) { errno = e; goto fail; }
    }
    for (int fd = 0; fd < 3 && (parts & LL_PART_STDIO) && attr.handled_access_fs; fd++)
        ll_stdio_rule(rs, fd, attr.handled_access_fs);  /* best effort: a failure only takes access away */
    *abi_used = abi;
    return rs;
fail:;
    int e = errno;
    lsys1(__NR_close, rs);
    errno = e;
    *abi_used = -1;
    return -1;
}

/* Enforce the ruleset on the calling thread (and what it execs). 0 or -1 with errno. */
static int ll_restrict(int ruleset) {
    if (lsys5(__NR_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return -1;
    return (int)lsys2(__NR_landlock_restrict_self, ruleset, 0);
}

#endif
