/* lowlevel_relay: the sandbox's end of the egress proxy (Policy(network=Egress(...))).
 *
 * The sandbox has its own network namespace with only a loopback interface. The egress proxy
 * runs on the host and listens on a unix socket that the launcher binds into the sandbox. This
 * static helper is what bwrap runs first inside:
 *
 *     /proc/self/fd/EXE_FD PORT SOCKET_PATH EXE_FD -- COMMAND [ARG...]
 *
 *   1. close EXE_FD (the fd bwrap exec'd this program through: nothing of the host stays open);
 *   2. listen on 127.0.0.1:PORT (the sandbox's own loopback) before anything else runs, so the
 *      proxy is ready when the program starts;
 *   3. posix_spawnp(3) COMMAND with the signal mask and dispositions bwrap gave us (so it keeps
 *      the environment, PATH search and stdio bwrap set up); an exec failure prints
 *      "lowlevel-relay: execvp NAME: REASON" and exits 127 (not found) or 126, as a shell does;
 *   4. the parent relays: each TCP connection accepted on 127.0.0.1:PORT gets a fresh
 *      connection to SOCKET_PATH and bytes move both ways (half-closes passed on), with poll(2)
 *      and splice(2) through one kernel pipe per direction (or, without a pipe, a 64 KiB
 *      buffer), at most MAX_PAIRS connections at once;
 *   5. when COMMAND exits, the relay exits with its status (exit code N, or 128+N after
 *      signal N: what bwrap reports for a signal death), so bwrap and the launcher see the
 *      program's status.
 *
 * The relay decides nothing: every allow/deny decision, the byte caps and the report are the
 * host proxy's (lowlevel/net/proxy.py). A program that kills the relay (same uid) only cuts
 * its own network. The relay runs under the sandbox's seccomp filter, rlimits and cgroup.
 * Fails closed: a bad argument or a failing listen prints one line and exits 125 before
 * COMMAND runs.
 *
 * Sources: socket(7), ip(7), unix(7), poll(2), splice(2), signalfd(2), shutdown(2), execvp(3), bwrap(1)
 * (propagate_exit_status: 128+N for death by signal N).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lowlevel_errtext.h"

extern char **environ;

#define EXIT_SETUP 125
#define BUF_SIZE 65536
#define MAX_PAIRS 128

/* One direction of a relayed connection, `from` -> `to`. Bytes move through a kernel pipe with
 * splice(2) (never copied through this process); when a pipe cannot be made (RLIMIT_NOFILE) or
 * splice refuses the fds, through a 64 KiB buffer with recv/send instead. */
struct dir {
    int pipe_r, pipe_w; /* splice mode when pipe_r >= 0 */
    char *buf;          /* buffer mode */
    size_t len, off;    /* bytes held (pipe or buffer), offset in buf */
    size_t cap;
    int eof;  /* `from` reached EOF */
    int shut; /* shutdown(to, SHUT_WR) done */
};

struct pair {
    int tcp, unx;    /* the program's connection; ours to the host proxy */
    struct dir up;   /* tcp -> unx */
    struct dir down; /* unx -> tcp */
};

static struct pair pairs[MAX_PAIRS];
static int npairs;

static void die(const char *what, const char *arg) {
    int err = errno;
    fprintf(stderr, "lowlevel-relay: %s%s%s%s%s\n", what, arg ? " " : "", arg ? arg : "", err ? ": " : "",
            err ? ll_strerror(err) : "");
    exit(EXIT_SETUP);
}

static int parse_int(const char *s, int lo, int hi) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *s == '\0' || *end || v < lo || v > hi) {
        errno = 0;
        die("bad number", s);
    }
    return (int)v;
}

static void dir_free(struct dir *d) {
    if (d->pipe_r >= 0) {
        close(d->pipe_r);
        close(d->pipe_w);
    }
    free(d->buf);
}

/* Splice mode if a pipe can be made, else a buffer; -1 when neither. */
static int dir_init(struct dir *d) {
    int p[2];
    memset(d, 0, sizeof *d);
    d->pipe_r = d->pipe_w = -1;
    if (pipe2(p, O_NONBLOCK | O_CLOEXEC) == 0) {
        d->pipe_r = p[0];
        d->pipe_w = p[1];
        int cap = fcntl(p[1], F_GETPIPE_SZ);
        d->cap = cap > 0 ? (size_t)cap : 4096;
        return 0;
    }
    d->buf = malloc(BUF_SIZE);
    d->cap = BUF_SIZE;
    return d->buf ? 0 : -1;
}

/* splice(2) refused these fds: fall back to the buffer (nothing is in the pipe yet). */
static int dir_to_buffer(struct dir *d) {
    if (d->len > 0)
        return -1;
    close(d->pipe_r);
    close(d->pipe_w);
    d->pipe_r = d->pipe_w = -1;
    d->buf = malloc(BUF_SIZE);
    d->cap = BUF_SIZE;
    return d->buf ? 0 : -1;
}

static void pair_close(int i) {
    close(pairs[i].tcp);
    close(pairs[i].unx);
    dir_free(&pairs[i].up);
    dir_free(&pairs[i].down);
    pairs[i] = pairs[--npairs];
}

static int set_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Accept one connection and pair it with a connection to the host proxy. Returns 0 when
 * there was nothing (left) to accept, 1 otherwise (a refused or failed pairing included). */
static int accept_one(int lfd, const struct sockaddr_un *addr) {
    int tcp = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (tcp < 0)
        return errno == EINTR || errno == ECONNABORTED;
    if (npairs == MAX_PAIRS) {
        close(tcp);
        return 1;
    }
    int one = 1;
    setsockopt(tcp, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* A blocking connect: the host proxy accepts at once; on a full backlog we wait briefly
     * rather than drop the program's connection. */
    int unx = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (unx < 0 || connect(unx, (const struct sockaddr *)addr, sizeof *addr) < 0 || set_nonblock(unx) < 0) {
        if (unx >= 0)
            close(unx);
        close(tcp);
        return 1;
    }
    struct pair *p = &pairs[npairs];
    p->tcp = tcp;
    p->unx = unx;
    if (dir_init(&p->up) < 0 || dir_init(&p->down) < 0) {
        dir_free(&p->up);
        dir_free(&p->down);
        close(tcp);
        close(unx);
        return 1;
    }
    npairs++;
    return 1;
}

static int again(void) {
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
}

/* Move what can move in one direction. Returns -1 on a fatal error of the connection. */
static int pump(struct dir *d, int from, int to, short from_ev, short to_ev) {
    if (d->len < d->cap && !d->eof && (from_ev & (POLLIN | POLLHUP | POLLERR))) {
        ssize_t n;
        if (d->pipe_r >= 0) {
            n = splice(from, NULL, d->pipe_w, NULL, d->cap - d->len, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
            if (n < 0 && errno == EINVAL) {
                if (dir_to_buffer(d) < 0)
                    return -1;
                n = recv(from, d->buf, d->cap, 0);
            }
        } else {
            if (d->len == 0)
                d->off = 0;
            n = d->off + d->len < d->cap ? recv(from, d->buf + d->off + d->len, d->cap - d->off - d->len, 0)
                                         : (errno = EAGAIN, -1);
        }
        if (n > 0)
            d->len += (size_t)n;
        else if (n == 0)
            d->eof = 1;
        else if (!again())
            return -1;
        to_ev |= POLLOUT; /* try to write at once: most of the time the other side can take it */
    }
    if (d->len > 0 && (to_ev & (POLLOUT | POLLERR | POLLHUP))) {
        ssize_t n = d->pipe_r >= 0 ? splice(d->pipe_r, NULL, to, NULL, d->len, SPLICE_F_MOVE | SPLICE_F_NONBLOCK)
                                   : send(to, d->buf + d->off, d->len, MSG_NOSIGNAL);
        if (n > 0) {
            d->len -= (size_t)n;
            if (d->pipe_r < 0)
                d->off += (size_t)n;
        } else if (n < 0 && !again()) {
            return -1;
        }
    }
    if (d->eof && d->len == 0 && !d->shut) {
        shutdown(to, SHUT_WR);
        d->shut = 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 6 || strcmp(argv[4], "--") != 0) {
        errno = 0;
        die("usage: lowlevel_relay PORT SOCKET_PATH EXE_FD -- COMMAND [ARG...]", NULL);
    }
    int port = parse_int(argv[1], 1, 65535);
    const char *path = argv[2];
    int exe_fd = parse_int(argv[3], -1, 1 << 20);
    char **command = &argv[5];
    if (exe_fd >= 0)
        close(exe_fd);

    struct sockaddr_un uaddr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof uaddr.sun_path) {
        errno = ENAMETOOLONG;
        die("socket path", path);
    }
    strcpy(uaddr.sun_path, path);

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (lfd < 0)
        die("socket(AF_INET)", NULL);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in in = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
    in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&in, sizeof in) < 0)
        die("bind 127.0.0.1 port", argv[1]);
    if (listen(lfd, SOMAXCONN) < 0)
        die("listen", NULL);

    /* SIGCHLD through a signalfd: blocked here, restored in the child before exec. */
    sigset_t chld, old;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &chld, &old) < 0)
        die("sigprocmask", NULL);
    int sfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd < 0)
        die("signalfd", NULL);

    /* posix_spawnp: glibc clones with CLONE_VM|CLONE_VFORK (no copy of our address space) and
     * reports an exec failure as its return value. */
    pid_t child;
    posix_spawnattr_t attr;
    sigset_t dfl;
    sigemptyset(&dfl);
    sigaddset(&dfl, SIGCHLD);
    sigaddset(&dfl, SIGPIPE);
    if (posix_spawnattr_init(&attr) != 0 || posix_spawnattr_setsigmask(&attr, &old) != 0 ||
        posix_spawnattr_setsigdefault(&attr, &dfl) != 0 ||
        posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF) != 0)
        die("posix_spawnattr", NULL);
    int err = posix_spawnp(&child, command[0], NULL, &attr, command, environ);
    if (err == ENOEXEC) {
        /* A script without "#!": execvp(3) (what bwrap itself uses) runs it with /bin/sh,
         * posix_spawnp (glibc >= 2.29) does not. Do as execvp does. */
        child = fork();
        if (child < 0)
            die("fork", NULL);
        if (child == 0) {
            sigprocmask(SIG_SETMASK, &old, NULL);
            execvp(command[0], command);
            int e = errno;
            fprintf(stderr, "lowlevel-relay: execvp %s: %s\n", command[0], ll_strerror(e));
            _exit(e == ENOENT || e == ENOTDIR ? 127 : 126);
        }
        err = 0;
    }
    if (err != 0) {
        fprintf(stderr, "lowlevel-relay: execvp %s: %s\n", command[0], ll_strerror(err));
        exit(err == ENOENT || err == ENOTDIR ? 127 : 126);
    }
    posix_spawnattr_destroy(&attr);
    signal(SIGPIPE, SIG_IGN);

    static struct pollfd fds[2 + 2 * MAX_PAIRS];
    for (;;) {
        int n = 0;
        fds[n++] = (struct pollfd){.fd = sfd, .events = POLLIN};
        fds[n++] = (struct pollfd){.fd = npairs < MAX_PAIRS ? lfd : -1, .events = POLLIN};
        for (int i = 0; i < npairs; i++) {
            struct pair *p = &pairs[i];
            short tcp_ev = 0, unx_ev = 0;
            if (p->up.len < p->up.cap && !p->up.eof)
                tcp_ev |= POLLIN;
            if (p->down.len > 0)
                tcp_ev |= POLLOUT;
            if (p->down.len < p->down.cap && !p->down.eof)
                unx_ev |= POLLIN;
            if (p->up.len > 0)
                unx_ev |= POLLOUT;
            /* An fd with nothing to wait for is left out (fd -1): poll would report its
             * POLLHUP again and again while the other side drains. */
            fds[n++] = (struct pollfd){.fd = tcp_ev ? p->tcp : -1, .events = tcp_ev};
            fds[n++] = (struct pollfd){.fd = unx_ev ? p->unx : -1, .events = unx_ev};
        }
        if (poll(fds, (nfds_t)n, -1) < 0) {
            if (errno == EINTR)
                continue;
            die("poll", NULL);
        }
        if (fds[0].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {
            }
            int status;
            pid_t w = waitpid(child, &status, WNOHANG);
            if (w == child) {
                if (WIFEXITED(status))
                    _exit(WEXITSTATUS(status));
                _exit(128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0));
            }
        }
        /* Pairs first (their slots in fds[] match pairs[] only before any accept or close). */
        int count = npairs;
        for (int i = count - 1; i >= 0; i--) {
            struct pair *p = &pairs[i];
            short tcp_ev = fds[2 + 2 * i].revents, unx_ev = fds[3 + 2 * i].revents;
            if (!tcp_ev && !unx_ev)
                continue;
            if (pump(&p->up, p->tcp, p->unx, tcp_ev, unx_ev) < 0 ||
                pump(&p->down, p->unx, p->tcp, unx_ev, tcp_ev) < 0 ||
                (p->up.shut && p->down.shut)) {
                pair_close(i);
            }
        }
        if (fds[1].revents & POLLIN) {
            for (int k = 0; k < 64 && npairs < MAX_PAIRS && accept_one(lfd, &uaddr); k++) {
            }
        }
    }
}
