"""The argparse tree of ``lowlevel``: :func:`build_parser` and each subcommand's options.

Only the parser of the subcommand being run is built (:func:`build_parser` ``only=``): the
others cost argparse set-up at every CLI start. Building any of them imports nothing of
lowlevel but the option types (:mod:`lowlevel.cli.args`): ``image``'s parser is here, not in
:mod:`lowlevel.cli.image_cli`, so ``lowlevel --help`` does not load the image machinery.
"""

from __future__ import annotations

import argparse

from lowlevel.version import __version__
from lowlevel.cli.args import (Parser, bind_spec, cores, cwd_spec, env_pair, grace, input_spec, network_mode,
                               parse_size, port, positive_float, positive_int, timeout_arg, tls_port,
                               volume_spec)

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any


#: ``lowlevel run``'s grace between the SIGTERM at the timeout and the SIGKILL (``--kill-after``), seconds.
DEFAULT_KILL_AFTER_S = 2.0

#: ``lowlevel run --help``'s closing text: exit statuses and examples.
RUN_EPILOG = """\
exit status (as timeout(1)):
  N        the program's own exit status
  124      the --timeout fired (SIGTERM to the sandbox, SIGKILL --kill-after later)
  125      lowlevel failed: a usage error, a bad option value, workspace or sandbox setup
  126      the command is not executable
  127      the command is not found
  128+N    signal N killed the program, or interrupted lowlevel (SIGINT, SIGTERM...)

examples:
  lowlevel run -- python3 -c 'print(42)'
  lowlevel run --timeout 10s --memory 512M --cpus 0.5 -- make test
  lowlevel run --timeout 2m -k 10s -- ./server       # 10 s to shut down after the SIGTERM
  lowlevel run -v "$PWD/data:/data:ro" -e API_MODE=test -w src -- ./run.sh
  lowlevel run --input main.py --json -- python3 main.py    # one JSON object (argv last)
  lowlevel run --allow-host pypi.org --allow-host files.pythonhosted.org -- pip download requests
  lowlevel run --image python:3.12 --rm -- python3 -V
"""

#: The environment variable naming the image store (:data:`lowlevel.rootfs.store.STORE_ENV`, which
#: tests/unit/test_cli_parser.py checks it against): ``--help`` does not import the image machinery.
IMAGE_STORE_ENV = "LOWLEVEL_IMAGE_STORE"

#: The subcommands, in the order ``lowlevel --help`` lists them.
COMMANDS = ("run", "doctor", "cleanup", "replay", "mcp", "image")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser for ``lowlevel`` (exposed for docs and tests).

    Args:
        only: build just this subcommand's parser (what :func:`main` does once it knows the
            command: the others, ``image`` above all, cost ~10-40 ms of imports and argparse
            set-up at every CLI start); None builds them all (``lowlevel --help``, an unknown
            command, docs).
    """
    parser = Parser(prog="lowlevel", description="Run untrusted programs in a bubblewrap "
                                     "sandbox with seccomp and resource limits.")
    parser.add_argument("--version", action="version", version=f"lowlevel {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{run,doctor,cleanup,replay,mcp,image}")
    if only in (None, "run"):
        _add_run(sub)
    if only in (None, "cleanup", "doctor", "replay", "mcp"):
        _add_others(sub, only)
    if only in (None, "image"):
        _add_image(sub)
    return parser


def _add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="run a command in a fresh sandbox",
                       description="Run COMMAND in a fresh sandbox. Put -- before the command.",
                       epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workspace", metavar="DIR", help="existing host dir seen at /workspace, copy-on-write: the run's "
                   "changes are applied to it after the run (see --discard) (default: a fresh "
                   "per-run dir, its path printed to stderr)")
    p.add_argument("--input", metavar="PATH[:DEST]", action="append", default=[], type=input_spec,
                   help="file or dir copied into the workspace before the run, under its base name or at "
                   "DEST (relative to the workspace) (repeatable)")
    p.add_argument("-w", "--cwd", "--workdir", dest="cwd", metavar="DIR", type=cwd_spec, default=None,
                   help="working directory inside the sandbox, absolute or relative to /workspace "
                   "(default /workspace, or the image's WorkingDir)")
    p.add_argument("--timeout", metavar="DURATION", type=timeout_arg, default=60.0,
                   help="wall-clock limit: seconds, or with an s/m/h/d suffix as timeout(1) (10s, 2m; "
                   "default 60; 0: none, as timeout 0); exit 124 when it fires")
    p.add_argument("-k", "--kill-after", metavar="DURATION", type=grace, default=None,
                   help="as timeout -k: at the timeout, SIGTERM every process of the sandbox, and SIGKILL "
                   f"it this long after if it has not ended (default {DEFAULT_KILL_AFTER_S:g}s; 0: SIGKILL at "
                   "once; with --record: 0)")
    _add_run_network(p)
    _add_run_binds(p)
    _add_run_limits(p)
    _add_run_outcome(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")


def _add_run_network(p: argparse.ArgumentParser) -> None:
    """``run``'s network options: the host network or the egress allowlist."""
    p.add_argument("--network", nargs="?", const="bare", default=None, type=network_mode, metavar="{none,host}",
                   help="none (default): the sandbox's own loopback only; host: the host's whole network "
                   "(its 127.0.0.1 services, cloud metadata and abstract unix sockets included). A bare "
                   "--network means host and prints a warning. For an allowlist use --allow-host")
    p.add_argument("--allow-host", metavar="PATTERN", action="append", default=[],
                   help="egress by allowlist: let the sandbox reach this host through lowlevel's HTTP proxy "
                   "(exact name, *.suffix, or *; repeatable; HTTP_PROXY/HTTPS_PROXY are set inside, no DNS). "
                   "Names resolving to loopback/private/link-local addresses and IP literals are refused")
    p.add_argument("--deny-host", metavar="PATTERN", action="append", default=[],
                   help="egress: refuse this host pattern even when --allow-host matches (repeatable)")
    p.add_argument("--allow-cidr", metavar="CIDR", action="append", default=[],
                   help="egress: also allow addresses in this network, private ones included (repeatable)")
    p.add_argument("--allow-port", metavar="PORT", action="append", default=[], type=port,
                   help="egress: allow this port besides 80 and 443 (repeatable)")
    p.add_argument("--tls-port", metavar="PORT", action="append", default=[], type=tls_port,
                   help="egress: tunnels to this allowed port must start with a TLS ClientHello (its server "
                   "name checked), as on 443 (repeatable); none: on no port, 443 included (SSH over 443)")
    p.add_argument("--ca-cert", metavar="FILE.pem", action="append", default=[],
                   help="egress: CA certificate(s) the sandbox trusts besides the system's (repeatable)")
    p.add_argument("--net-bytes", metavar="BYTES", type=parse_size,
                   help="egress: bytes the run may move through the proxy, both ways; past it connections are cut")


def _add_run_binds(p: argparse.ArgumentParser) -> None:
    """``run``'s binds and environment."""
    p.add_argument("--ro", metavar="PATH[:DEST]", action="append", default=[], type=bind_spec,
                   help="extra read-only bind (repeatable)")
    p.add_argument("--rw", metavar="PATH[:DEST]", action="append", default=[], type=bind_spec,
                   help="extra writable bind (repeatable)")
    p.add_argument("-v", "--volume", metavar="SRC:DEST[:ro]", action="append", default=[], type=volume_spec,
                   help="bind as docker run -v: writable, read-only with :ro (repeatable; the same checks "
                   "as --ro/--rw)")
    p.add_argument("--allow-sensitive", action="store_true",
                   help="allow binds of credential dirs, home, /run, sockets, and a --workspace that is a "
                   "system or home dir (dangerous)")
    p.add_argument("--allow-sockets", action="store_true",
                   help="keep the unix sockets inside --ro/--rw directories reachable (default: the ones found "
                   "are masked; a D-Bus or Docker socket there is a way out of the sandbox)")
    p.add_argument("-e", "--env", metavar="KEY=VALUE", action="append", default=[], type=env_pair,
                   help="environment variable inside (repeatable); a bare KEY passes on the caller's value")
    p.add_argument("--env-file", metavar="FILE", action="append", default=[],
                   help="read KEY=VALUE lines from FILE, as docker run --env-file (repeatable; -e wins)")


def _add_run_limits(p: argparse.ArgumentParser) -> None:
    """``run``'s resource limits (:class:`lowlevel.Limits`)."""
    p.add_argument("--memory", metavar="BYTES", type=parse_size, help="memory limit of the run (cgroup; "
                   "RLIMIT_DATA fallback), e.g. 512M (default 2.5G: 1G for the program + the tmpfs bounds of "
                   "--workspace-size and twice --tmp-size, whose files are RAM counted in it)")
    p.add_argument("--cpu", metavar="DURATION", type=positive_float, help="CPU time, seconds or with a "
                   "suffix (RLIMIT_CPU; the program is killed past it), default 60")
    p.add_argument("--cpus", metavar="CORES", type=cores, help="CPU bandwidth in cores, as docker run --cpus "
                   "(0.5 = half a core; cgroup cpu.max / cpu.cfs_quota_us): throttles, never kills. Without a "
                   "writable cpu cgroup (an unprivileged caller) it is not enforced and a warning says so")
    p.add_argument("--pids", metavar="N", type=positive_int, help="processes+threads (cgroup pids.max; "
                   "RLIMIT_NPROC fallback), default 256")
    p.add_argument("--fsize", metavar="BYTES", type=parse_size, help="largest file written (RLIMIT_FSIZE), "
                   "default 2G (above the workspace bound: filling it is ENOSPC, not SIGXFSZ)")
    p.add_argument("--nofile", metavar="N", type=positive_int, help="open files (RLIMIT_NOFILE), default 1024")
    p.add_argument("--tmp-size", metavar="BYTES", type=parse_size, help="size of /tmp tmpfs, default 256M")
    p.add_argument("--workspace-size", metavar="BYTES", type=parse_size,
                   help="total bytes the run may write into its workspace (the copy-on-write upper "
                   "layer's tmpfs: ENOSPC inside beyond it), default 1G")
    p.add_argument("--upper", choices=("tmpfs", "disk"),
                   help="where the workspace's copy-on-write writes live: tmpfs (RAM, the default) or disk "
                   "(root only: a per-run loop device of --workspace-size bytes, the same hard bound, no RAM "
                   "held; in $LOWLEVEL_UPPER_DIR, default /var/tmp)")


def _add_run_outcome(p: argparse.ArgumentParser) -> None:
    """``run``'s workspace outcome, output, record and root filesystem options."""
    keep = p.add_mutually_exclusive_group()
    keep.add_argument("--discard", action="store_true", help="drop the run's changes: the workspace stays "
                      "exactly as it was (they are still listed with --json)")
    keep.add_argument("--commit-on-success", action="store_true", help="apply the run's changes to the "
                      "workspace only if the program exited 0 and was not killed (default: always)")
    p.add_argument("--json", action="store_true", help="capture output; print one JSON object with the Result")
    p.add_argument("--rm", action="store_true", help="remove the fresh per-run workspace after the run "
                   "(--json still lists its changes); not with --workspace")
    p.add_argument("--deterministic", action="store_true", help="deterministic mode: TZ=UTC, LANG, "
                   "SOURCE_DATE_EPOCH, PYTHONHASHSEED=0, fixed uid/gid, sorted env")
    p.add_argument("--record", metavar="FILE", help="write a run record (JSON) to FILE and copy the inputs "
                   "to FILE.inputs/ for `lowlevel replay`")
    p.add_argument("--image", metavar="REF", help="run on an imported image (NAME[:TAG] or sha256:ID) instead of "
                   "the host's /usr; without a COMMAND, its Entrypoint+Cmd (see `lowlevel image`)")
    p.add_argument("--rootfs", metavar="DIR", help="run on this root filesystem tree instead of the host's /usr")
    p.add_argument("--writable-root", action="store_true", help="a per-run writable layer over --image/--rootfs, "
                   "discarded after the run")
    p.add_argument("--image-store", metavar="DIR", help="image store for --image (default $LOWLEVEL_IMAGE_STORE, "
                   "else /var/lib/lowlevel/images for root, ~/.local/share/lowlevel/images otherwise)")
    p.add_argument("--landlock", choices=("on", "off", "require"), default="on",
                   help="Landlock, the second wall (default on: best effort; require: fail without it)")


def _add_others(sub: Any, only: str | None) -> None:
    if only in (None, "cleanup"):
        _add_cleanup(sub)
    if only in (None, "doctor"):
        d = sub.add_parser("doctor", help="check what this host can do",
                           description="Check what this host can do for lowlevel: bwrap, user namespaces, "
                           "seccomp, Landlock, pidfds, cgroups, the workspace model and uid range, images, "
                           "leftovers of interrupted runs. Exit 0 when every required check passes.")
        d.add_argument("--json", action="store_true", help="print a JSON report")
    if only in (None, "replay"):
        _add_replay(sub)
    if only in (None, "mcp"):
        _add_mcp(sub)


def _add_cleanup(sub: Any) -> None:
    c = sub.add_parser("cleanup", help="remove what interrupted runs left (stale cgroups, egress sockets, "
                       "commit temporaries, --rm workspaces of dead callers); never a kept workspace",
                       description="Remove what interrupted runs left on this host: per-run cgroups of dead "
                       "callers, egress socket directories whose proxy is gone, temporaries of commits killed "
                       "mid-way, the disposable workspaces (--rm, keep_workspace=False) of callers that died, "
                       "workspaces a killed root caller left handed over (fallback without overlay: given back, "
                       "not removed). Never the content of a kept workspace. Exit 0: nothing left; 1: something "
                       "stayed (listed). With --dry-run: 0 when nothing would be removed, 1 when something would "
                       "(listed).")
    c.add_argument("--workspace", metavar="DIR", action="append", default=[],
                   help="also remove interrupted commits' temporaries in DIR (repeatable)")
    c.add_argument("--store", metavar="DIR", action="append", default=[],
                   help="also remove interrupted image imports' staging in the image store DIR (repeatable; "
                   "the default store, $LOWLEVEL_IMAGE_STORE, is always checked)")
    c.add_argument("--dry-run", action="store_true",
                   help="list, remove nothing; exit 1 when something would be removed, 0 when clean")
    c.add_argument("--json", action="store_true", help="print one JSON object")


def _add_replay(sub: Any) -> None:
    r = sub.add_parser("replay", help="rerun a recorded run and compare its outputs",
                       description="Rerun the run recorded in FILE (written by `lowlevel run --record FILE`) "
                       "with the same policy and inputs. Exit 0: outputs match; 1: they differ; 125: cannot replay.")
    r.add_argument("file", metavar="FILE", help="the record")
    r.add_argument("--json", action="store_true", help="print the differences and the new record as JSON")
    r.add_argument("--keep-workspace", action="store_true", help="keep the replay's workspace")
    r.add_argument("--max-bytes", metavar="BYTES", type=parse_size, default=None,
                   help="most bytes rebuilding the record's workspace may write (default 256M)")
    r.add_argument("--trust-record-policy", action="store_true",
                   help="replay even when the record's policy is looser than the default (binds, network, "
                   "seccomp off, higher limits); a record is untrusted input")
    r.add_argument("--image-store", metavar="DIR", help="image store holding the record's image")


def _add_mcp(sub: Any) -> None:
    m = sub.add_parser("mcp", help="serve the Model Context Protocol over stdio",
                       description="MCP tool server over stdio. The operator's settings (file and flags) bound "
                       "every request: clients can narrow limits, never widen them.")
    m.add_argument("--config", metavar="FILE.toml", help="operator config (see lowlevel.mcp_server)")
    m.add_argument("--workspace-base", metavar="DIR", help="directory of the workspaces")
    m.add_argument("--network", action=argparse.BooleanOptionalAction, default=None,
                   help="let clients request the host's whole network (default: --no-network)")
    m.add_argument("--allow-host", metavar="PATTERN", action="append", default=None,
                   help="egress allowlist for every run (repeatable; config [egress] allow); clients may "
                   "narrow it with allow_hosts, never widen it")
    m.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="deterministic mode for every run")
    m.add_argument("--max-timeout", metavar="DURATION", type=positive_float, help="ceiling for timeout_s")
    m.add_argument("--max-output-bytes", metavar="BYTES", type=parse_size, help="per stream in results")
    m.add_argument("--memory", metavar="BYTES", type=parse_size, help="memory ceiling per run")
    m.add_argument("--cpu", metavar="DURATION", type=positive_float, help="CPU seconds ceiling")
    m.add_argument("--pids", metavar="N", type=positive_int, help="process ceiling")
    m.add_argument("--allow-bind", metavar="PATH", action="append", default=None,
                   help="host path clients may ask to bind read-only (repeatable)")


def _add_image(sub: Any) -> None:
    """Add ``image`` and its subcommands to the ``lowlevel`` parser's subparsers."""
    img = sub.add_parser("image", help="import, list and remove images (OCI / docker save archives)",
                         description="Images for `lowlevel run --image`. No registry is contacted: fetch with "
                         "`skopeo copy docker://IMAGE oci-archive:FILE:NAME:TAG` on a host that reaches one.",
                         epilog="exit status: 0 done; 125 lowlevel refused or failed (a bad archive, a limit, an "
                         "unknown image, a bad option): one line on stderr")
    isub = img.add_subparsers(dest="image_cmd", required=True, metavar="{import,ls,rm,prune,inspect,tag}")

    def store_opt(p: argparse.ArgumentParser) -> None:
        p.add_argument("--store", metavar="DIR", help=f"image store (default ${IMAGE_STORE_ENV} or "
                       "/var/lib/lowlevel/images for root, ~/.local/share/lowlevel/images otherwise)")

    p = isub.add_parser("import", help="import an OCI archive, OCI layout dir or docker save archive")
    p.add_argument("file", metavar="FILE", help="the archive (or OCI image layout directory)")
    p.add_argument("--name", metavar="NAME[:TAG]", help="name to give it (default: the name the archive records)")
    p.add_argument("--ref", metavar="REF", help="which image of an archive holding several")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, print only the image id")
    p.add_argument("--json", action="store_true", help="print the image as JSON")
    p.add_argument("--max-bytes", metavar="BYTES", type=parse_size, help="refuse images whose files add up to "
                   "more (default 8G)")
    p.add_argument("--max-entries", metavar="N", type=int, help="refuse images with more entries (default 1000000)")
    store_opt(p)
    p = isub.add_parser("ls", help="list images: name, id, digest, layers, size, last use")
    p.add_argument("--json", action="store_true", help="print JSON")
    store_opt(p)
    p = isub.add_parser("rm", help="remove names or images")
    p.add_argument("refs", metavar="REF", nargs="+", help="NAME[:TAG] (untag; the image goes with its last name) "
                   "or sha256:ID / ID prefix of 12+ hex digits (the image and all its names)")
    store_opt(p)
    p = isub.add_parser("prune", help="remove the images no name points to (<none> in `image ls`)")
    store_opt(p)
    p = isub.add_parser("inspect", help="print one image as JSON")
    p.add_argument("ref", metavar="REF")
    store_opt(p)
    p = isub.add_parser("tag", help="give an image another name")
    p.add_argument("ref", metavar="REF")
    p.add_argument("name", metavar="NAME[:TAG]")
    store_opt(p)
