/* lowlevel_exec: set rlimits, drop to an unprivileged uid/gid, exec bwrap. One exec, not two.
 *
 * A root caller must not hand bwrap host uid 0 (bwrap 0.8.0 maps it into the sandbox, where
 * it can write /proc/sys), and a root caller without CAP_SYS_RESOURCE cannot prlimit(2) a
 * process of another uid, so its rlimits must be in force before bwrap starts. The portable
 * way is `prlimit --cpu=S:H ... -- setpriv --reuid=U --regid=G --clear-groups -- bwrap ...`:
 * two extra execs of dynamically linked programs. This static helper does the same in one:
 *
 *     _lowlevel_exec [--rlimit=NAME=SOFT:HARD]... [--uid=U --gid=G] -- /abs/path/bwrap ARGS...
 *
 *   1. setrlimit(2) each NAME (RLIMIT_CPU, RLIMIT_AS, RLIMIT_DATA, RLIMIT_NPROC,
 *      RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE) to SOFT:HARD (decimal, or "unlimited");
 *   2. with --uid/--gid: setgroups(0, NULL), setresgid(G, G, G), setresuid(U, U, U), in
 *      that order (groups and gid need the privilege the uid change gives up), then check
 *      with getresuid/getresgid/getgroups that the ids really are U and G and no
 *      supplementary group is left, and that setuid(0) fails (U != 0);
 *   3. execv(2) the absolute path that follows "--", with the rest as its argv.
 *
 * Fails closed: a bad argument or any failing call prints one line naming the call and its
 * arguments to stderr and exits 125 without exec'ing anything, so the program never runs
 * with root ids or without its limits. An execv failure exits 127. Both exit before bwrap
 * writes its json-status, so the launcher reports a setup failure with this stderr.
 *
 * The uid change clears the permitted, effective and ambient capability sets (no
 * SECBIT_KEEP_CAPS here): bwrap then starts as an ordinary user, exactly as under setpriv.
 * Sources: setrlimit(2), setgroups(2), setresuid(2), capabilities(7) "Effect of user ID
 * changes on capabilities", setpriv(1), prlimit(1); CERT POS36-C/POS37-C (drop order, verify).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <unistd.h>

#define EXIT_SETUP 125
#define EXIT_EXEC 127
#define MAX_RLIMITS 16

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
            err ? strerror(err) : "");
    exit(EXIT_SETUP);
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

/* Decimal id, 0 <= id < (uid_t)-1 (-1 means "unchanged" to setresuid). */
static int parse_id(const char *s, unsigned int *out) {
    if (*s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || *end || v >= (unsigned long)(uid_t)-1)
        return -1;
    *out = (unsigned int)v;
    return 0;
}

int main(int argc, char **argv) {
    struct {
        int resource;
        struct rlimit value;
        const char *arg;
    } limits[MAX_RLIMITS];
    int nlimits = 0, have_uid = 0, have_gid = 0, i;
    unsigned int uid = 0, gid = 0;

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
            if (have_uid || parse_id(a + 6, &uid))
                die("bad option", a);
            have_uid = 1;
        } else if (strncmp(a, "--gid=", 6) == 0) {
            if (have_gid || parse_id(a + 6, &gid))
                die("bad option", a);
            have_gid = 1;
        } else {
            die("unknown option", a);
        }
    }
    errno = 0;
    if (have_uid != have_gid)
        die("--uid and --gid go together", NULL);
    if (i >= argc || argv[i][0] != '/')
        die("usage: _lowlevel_exec [--rlimit=NAME=SOFT:HARD]... [--uid=U --gid=G] -- /ABS/PATH ARGS...", NULL);

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
    }

    execv(argv[i], &argv[i]);
    fprintf(stderr, "lowlevel_exec: execv %s: %s\n", argv[i], strerror(errno));
    return EXIT_EXEC;
}
