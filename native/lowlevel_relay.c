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
 *   3. fork; the child restores the signal mask and SIGPIPE and execvp(3)s COMMAND (so it keeps
 *      the environment, PATH search and stdio bwrap set up); an exec failure prints
 *      "lowlevel-relay: execvp NAME: REASON" and exits 127 (not found) or 126, as a shell does;
 *   4. the parent relays: each TCP connection accepted on 127.0.0.1:PORT gets a fresh
 *      connection to SOCKET_PATH and bytes are copied both ways (half-closes passed on), with
 *      poll(2), one 64 KiB buffer per direction, at most MAX_PAIRS connections at once;
 *   5. when COMMAND exits, the relay exits with its status (exit code N, or 128+N after
 *      signal N: what bwrap reports for a signal death), so bwrap and the launcher see the
 *      program's status.
 *
 * The relay decides nothing: every allow/deny decision, the byte caps and the report are the
 * host proxy's (lowlevel/egress_proxy.py). A program that kills the relay (same uid) only cuts
 * its own network. The relay runs under the sandbox's seccomp filter, rlimits and cgroup.
 * Fails closed: a bad argument or a failing listen prints one line and exits 125 before
 * COMMAND runs.
 *
 * Sources: socket(7), ip(7), unix(7), poll(2), signalfd(2), shutdown(2), execvp(3), bwrap(1)
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXIT_SETUP 125
#define BUF_SIZE 65536
#define MAX_PAIRS 256

/* One direction of a relayed connection: bytes read from `from`, not yet written to `to`. */
struct dir {
    char *buf;
    size_t len, off;
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
            err ? strerror(err) : "");
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

static void pair_close(int i) {
    close(pairs[i].tcp);
    close(pairs[i].unx);
    free(pairs[i].up.buf);
    free(pairs[i].down.buf);
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
    memset(p, 0, sizeof *p);
    p->tcp = tcp;
    p->unx = unx;
    p->up.buf = malloc(BUF_SIZE);
    p->down.buf = malloc(BUF_SIZE);
    if (!p->up.buf || !p->down.buf) {
        free(p->up.buf);
        free(p->down.buf);
        close(tcp);
        close(unx);
        return 1;
    }
    npairs++;
    return 1;
}

/* Move what can move in one direction. Returns -1 on a fatal error of the connection. */
static int pump(struct dir *d, int from, int to, short from_ev, short to_ev) {
    if (d->len == 0 && !d->eof && (from_ev & (POLLIN | POLLHUP | POLLERR))) {
        ssize_t n = recv(from, d->buf, BUF_SIZE, 0);
        if (n > 0) {
            d->len = (size_t)n;
            d->off = 0;
        } else if (n == 0) {
            d->eof = 1;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            return -1;
        }
        /* Try to write at once: most of the time the other side can take it. */
        to_ev |= POLLOUT;
    }
    if (d->len > 0 && (to_ev & (POLLOUT | POLLERR | POLLHUP))) {
        ssize_t n = send(to, d->buf + d->off, d->len, MSG_NOSIGNAL);
        if (n > 0) {
            d->off += (size_t)n;
            d->len -= (size_t)n;
        } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
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

    pid_t child = fork();
    if (child < 0)
        die("fork", NULL);
    if (child == 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        execvp(command[0], command);
        int err = errno;
        fprintf(stderr, "lowlevel-relay: execvp %s: %s\n", command[0], strerror(err));
        _exit(err == ENOENT || err == ENOTDIR ? 127 : 126);
    }
    signal(SIGPIPE, SIG_IGN);

    static struct pollfd fds[2 + 2 * MAX_PAIRS];
    for (;;) {
        int n = 0;
        fds[n++] = (struct pollfd){.fd = sfd, .events = POLLIN};
        fds[n++] = (struct pollfd){.fd = npairs < MAX_PAIRS ? lfd : -1, .events = POLLIN};
        for (int i = 0; i < npairs; i++) {
            struct pair *p = &pairs[i];
            short tcp_ev = 0, unx_ev = 0;
            if (p->up.len == 0 && !p->up.eof)
                tcp_ev |= POLLIN;
            if (p->down.len > 0)
                tcp_ev |= POLLOUT;
            if (p->down.len == 0 && !p->down.eof)
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
