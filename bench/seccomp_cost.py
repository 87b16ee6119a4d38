"""What the default seccomp filter costs: once per sandbox (attaching it) and per system call.

    python bench/seccomp_cost.py [--rounds N] [--calls N] [--json FILE]

The default profile's filter (``lowlevel.host.seccomp_filter.compile_bpf(DEFAULT_PROFILE)``,
libseccomp's default linear layout) and the same rules with ``SCMP_FLTATR_CTL_OPTIMIZE=2``
(libseccomp >= 2.5: a binary tree of syscall numbers, through pyseccomp), each attached in a
fresh process by a small C program (built here with ``cc``) that then times, per call:
``getppid`` (a syscall the filter allows by number only), ``ioctl(FIONREAD)`` (one whose rule
looks at an argument: TIOCSTI/TIOCLINUX) and ``fork`` + ``_exit`` + ``waitpid``; and the
``seccomp(SECCOMP_SET_MODE_FILTER)`` call itself. A third variant attaches nothing: the
baseline. Rounds interleave the three; the figures are medians over the rounds.

Why attaching costs what it does: since Linux 5.11 the kernel emulates a new filter for every
syscall number of each of its architectures at attach time (``seccomp_cache_prepare``,
kernel/seccomp.c) to fill the per-architecture bitmap of syscalls it may allow without running
the filter; so a call the filter allows by number alone costs no filter run at all, and the
attach costs about (syscall numbers x instructions walked). Source: seccomp(2),
seccomp_attr_set(3) (SCMP_FLTATR_CTL_OPTIMIZE), the kernel's commit f9d480b6ffbe ("seccomp/cache:
Lookup syscall allowlist bitmap for fast path").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

SOURCE = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <unistd.h>
#include <time.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    int n = atoi(argv[1]); double attach = 0;
    if (argc > 2) {
        static struct sock_filter buf[65536];
        FILE *f = fopen(argv[2], "rb"); size_t len = fread(buf, 8, 65536, f); fclose(f);
        struct sock_fprog prog = { .len = (unsigned short)len, .filter = buf };
        prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
        double t0 = now();
        if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog)) { perror("seccomp"); return 1; }
        attach = now() - t0;
    }
    double t0 = now(); for (int i = 0; i < n; i++) syscall(SYS_getppid); double g = (now() - t0) / n;
    int v; t0 = now(); for (int i = 0; i < n; i++) ioctl(0, FIONREAD, &v); double io = (now() - t0) / n;
    int forks = n / 500; t0 = now();
    for (int i = 0; i < forks; i++) { pid_t p = fork(); if (!p) _exit(0); waitpid(p, 0, 0); }
    double fk = (now() - t0) / forks;
    printf("%.3f %.2f %.2f %.3f\n", attach * 1e6, g * 1e9, io * 1e9, fk * 1e6);
    return 0;
}
"""


def _filters(tmp: str) -> dict[str, str | None]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pyseccomp

    from lowlevel.host import seccomp_filter as sf
    from lowlevel.spec.seccomp import DEFAULT_PROFILE
    linear = sf.compile_bpf(DEFAULT_PROFILE)
    backend = sf._PySeccompBackend(pyseccomp)
    arches = sf.filter_arches(sf._backend().native_arch(), False)
    rules = [(a, backend.resolve(n), args) for a, n, args in DEFAULT_PROFILE.effective_rules()]
    set_attr = pyseccomp.SyscallFilter.set_attr

    def with_tree(self: object, attr: object, value: int) -> None:
        set_attr(self, attr, value)
        if attr == pyseccomp.Attr.ACT_BADARCH:
            set_attr(self, pyseccomp.Attr.CTL_OPTIMIZE, 2)
    pyseccomp.SyscallFilter.set_attr = with_tree
    try:
        tree = backend.build(DEFAULT_PROFILE.effective_default_action(), arches, rules)
    finally:
        pyseccomp.SyscallFilter.set_attr = set_attr
    out: dict[str, str | None] = {"none": None}
    for name, data in (("linear", linear), ("tree", tree)):
        path = os.path.join(tmp, f"{name}.bpf")
        with open(path, "wb") as f:
            f.write(data)
        out[name] = path
        print(f"{name}: {len(data) // 8} BPF instructions")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("seccomp_cost: needs a C compiler (cc)")
    tmp = tempfile.mkdtemp(prefix="lowlevel-bench-seccomp-")
    try:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(SOURCE.replace("#include <stdio.h>", "#include <stdio.h>\n#include <stdlib.h>"))
        exe = os.path.join(tmp, "probe")
        subprocess.run([cc, "-O2", "-o", exe, src], check=True)
        filters = _filters(tmp)
        samples: dict[str, list[list[float]]] = {k: [] for k in filters}
        for r in range(args.rounds):
            names = list(filters)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                argv = [exe, str(args.calls)] + ([filters[name]] if filters[name] else [])
                out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True)
                samples[name].append([float(x) for x in out.stdout.split()])
        cols = ("attach_us", "getppid_ns", "ioctl_ns", "fork_us")
        result = {name: {c: round(statistics.median(s[i] for s in rows), 3) for i, c in enumerate(cols)}
                  for name, rows in samples.items()}
        print(f"{'filter':8} " + " ".join(f"{c:>11}" for c in cols))
        for name, row in result.items():
            print(f"{name:8} " + " ".join(f"{row[c]:11.2f}" for c in cols))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rounds": args.rounds, "calls": args.calls, "median": result}, f, indent=2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
