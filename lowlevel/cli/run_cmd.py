"""``lowlevel run``: the command line turned into a Policy and a run, the run's report and exit status.

See :mod:`lowlevel.cli` for the contract (exit statuses, ``--json``, stdin and ``--record``).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys

from lowlevel.cli.args import UsageError, read_env_file
from lowlevel.cli.output import (EXIT_FAILED, EXIT_NOEXEC, EXIT_NOTFOUND, EXIT_TIMEOUT, error_object, print_json,
                                 reader_may_leave, report_error)
from lowlevel.cli.parser import DEFAULT_KILL_AFTER_S
from lowlevel.cli.signals import Interrupted, Terminated, is_interrupt
from lowlevel.errors import LaunchError, LowlevelError, PolicyError, UnsupportedError
from lowlevel.api import run
from lowlevel.host.fd_limit import FD_EXHAUSTED, open_files_hint  # imported now: at EMFILE no import can open its file
from lowlevel.sandbox.failures import ExecError, classify_setup_failure
from lowlevel.sandbox.result import Result
from lowlevel.spec.egress import DEFAULT_PORTS, DEFAULT_TLS_PORTS, Egress
from lowlevel.spec.limits import (CPU_QUOTA_FALLBACK_NOTE, MEMORY_FALLBACK_NOTE, PIDS_FALLBACK_NOTE,
                                  VERDICT_NOTE_PREFIXES, Limits)
from lowlevel.spec.policy import Bind, Policy
from lowlevel.spec.report import RECORD_NOT_WRITTEN, WARNING_PREFIX

TYPE_CHECKING = False
if TYPE_CHECKING:  # not imported at run time: typing costs a `lowlevel run` ~2 ms
    from typing import Any


#: The most stdin ``--record`` reads (and stores in the record), bytes.
MAX_RECORD_STDIN_BYTES = 64 * 1024 * 1024


def cmd_run(args: argparse.Namespace) -> int:
    """``lowlevel run``: returns the exit status to use."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.image_store:
        from lowlevel.cli.image_cli import use_store
        use_store(args.image_store)
    if not command and args.image:
        # The image's Entrypoint + Cmd (an explicit COMMAND replaces both: explicit arguments win).
        from lowlevel.image import ImageStore
        try:
            command = ImageStore().get(args.image).command()
        except LowlevelError as err:  # no such image, or no Entrypoint/Cmd: one line, exit 125
            return report_error(args, err, EXIT_FAILED)
    if not command:
        raise UsageError("run: no command given: write `lowlevel run [OPTIONS] -- COMMAND [ARG...]`")
    if args.rm and args.workspace is not None:
        raise UsageError("run: --rm removes the fresh per-run workspace; it does not go with "
                         "--workspace (lowlevel never deletes your directory)")
    if args.network in ("host", "bare", "none") and egress_requested(args):
        raise UsageError(f"run: --network={'host' if args.network == 'bare' else args.network} and --allow-host "
                         "(or --deny-host/--allow-cidr/--allow-port/--tls-port/--ca-cert) contradict each other: "
                         "--allow-host alone gives an allowlist")
    if args.net_bytes is not None and not egress_requested(args):
        raise UsageError("run: --net-bytes is enforced by the egress proxy: use it with --allow-host")
    if egress_requested(args) and not (args.allow_host or args.allow_cidr):
        alone = [o for o, v in (("--deny-host", args.deny_host), ("--allow-port", args.allow_port),
                                ("--tls-port", args.tls_port), ("--ca-cert", args.ca_cert)) if v]
        raise UsageError(f"run: {'/'.join(alone)} only {'refines' if len(alone) == 1 else 'refine'} an egress "
                         "allowlist, which allows nothing without "
                         "--allow-host (or --allow-cidr): add the hosts the sandbox may reach")
    if None in args.tls_port and len(args.tls_port) > 1:
        raise UsageError("run: --tls-port none (no port requires TLS) does not go with --tls-port PORT: "
                         "give one or the other")
    allowed = set(DEFAULT_PORTS) | set(args.allow_port)
    for tls in args.tls_port:
        if tls is not None and tls not in allowed:
            raise UsageError(f"run: --tls-port {tls}: port {tls} is not allowed (80, 443 and --allow-port): "
                             f"add --allow-port {tls}")
    if args.record is not None and args.kill_after:
        raise UsageError("run: --kill-after does not go with --record (a record replays the SIGKILL at the "
                         "timeout): drop --kill-after, or --record")
    if args.record is not None and (args.discard or args.commit_on_success):
        raise UsageError("run: --record hashes the workspace after the run, so the run's changes are always "
                         "applied: drop --discard/--commit-on-success, or --record")
    if args.network == "bare":
        print("lowlevel: warning: --network gives the sandbox the host's whole network (127.0.0.1 services, "
              "cloud metadata); say --network=host to confirm, or use --allow-host HOST", file=sys.stderr)
    created: list[str] = []  # the fresh workspace, while it exists
    try:
        return _cmd_run(args, command, created)
    except ExecError as err:
        return report_error(args, err, EXIT_NOTFOUND if err.errno == errno.ENOENT else EXIT_NOEXEC,
                      workspace=created[0] if created else None)
    except LowlevelError as err:
        if isinstance(getattr(err, "result", None), Result):
            return _report_commit_failure(args, err, created[0] if created else None)
        return report_error(args, err, EXIT_FAILED, workspace=created[0] if created else None)


def _report_commit_failure(args: argparse.Namespace, err: LowlevelError, workspace: str | None) -> int:
    """The program ran but its commit failed (CommitConflictError, CommitIncompleteError carry its
    Result): what it printed is delivered as after any run (captured with --record), the error is
    one line and 125; with --json the error object holds the Result (``"result"``). A record
    names the failure in its notes (:func:`lowlevel.record.record_run`)."""
    result: Result = err.result  # type: ignore[attr-defined]
    message = " ".join(str(err).split())
    if args.json:
        with reader_may_leave():
            print_json(error_object(type(err).__name__, message, EXIT_FAILED, err_no=getattr(err, "errno", None),
                                    workspace=workspace, result=result.to_json()))
    else:
        if args.record is not None:
            with reader_may_leave():
                sys.stdout.buffer.write(result.stdout)
                sys.stdout.flush()
            sys.stderr.buffer.write(result.stderr)
            sys.stderr.flush()
        print(f"lowlevel: {message} (the program exited {result.exit_code})", file=sys.stderr)
    return EXIT_FAILED


def _remove(path: str) -> None:
    from lowlevel.workspace import remove_workspace
    try:
        remove_workspace(path)
    except LowlevelError as err:
        print(f"lowlevel: --rm: {err}", file=sys.stderr)


def _fd_exhaustion(err: BaseException) -> BaseException:
    """A LaunchError naming RLIMIT_NOFILE for an EMFILE/ENFILE OSError that escaped the run's own
    checks (the terminal relay's pipes, a host probe's import at a tiny ``ulimit -n``: a
    traceback, and --rm's workspace left), else ``err`` itself."""
    if not isinstance(err, OSError) or isinstance(err, LowlevelError) or err.errno not in FD_EXHAUSTED:
        return err
    held = "a run holds up to about 45 while it starts; each live Session about 11"
    return LaunchError(f"cannot start the run: {err.strerror}: {open_files_hint(err.errno, held)}", errno=err.errno)


def _fresh_workspace(args: argparse.Namespace, created: list[str]) -> str:
    """A fresh workspace with ``--input``'s copies, in ``created`` from the moment it exists
    (:func:`lowlevel.sandbox.run_workspace.fresh_workspace`: ``--rm`` removes it whenever a
    signal comes)."""
    from lowlevel.sandbox.run_workspace import fresh_workspace

    def own(path: str) -> None:
        created[:] = [path] if path else []

    return fresh_workspace(args.input, None, disposable=args.rm, own=own)


def _cmd_run(args: argparse.Namespace, command: list[str], created: list[str]) -> int:
    from lowlevel.sandbox.relay import StdioRelay, is_terminal_or_none

    stdin: bytes | None = None
    if args.record is not None:
        stdin = read_stdin_for_record()
    result: Result | None = None
    try:
        policy = policy_from_args(args)
        workspace = args.workspace
        if workspace is None:
            workspace = _fresh_workspace(args, created)
            inputs: list[Any] = []
        else:
            inputs = args.input
        capture = args.json or args.record is not None
        kw: dict[str, Any] = dict(policy=policy, workspace=workspace, inputs=inputs, timeout=args.timeout,
                                  capture=capture, cwd=args.cwd, allow_sensitive_workspace=args.allow_sensitive)
        if args.record is None:
            kw["commit"] = False if args.discard else "on_success" if args.commit_on_success else True
            kw["kill_after"] = DEFAULT_KILL_AFTER_S if args.kill_after is None else args.kill_after
        if args.record is not None:
            result = run(command, record=args.record, stdin=stdin, **kw)
        elif args.json and is_terminal_or_none(0):
            result = run(command, **kw)  # a terminal is not read with --json: /dev/null
        else:
            with StdioRelay(stdin=True, output=not capture) as relay:
                try:
                    result = run(command, stdio_fds=relay.child_fds, **kw)
                except LaunchError as err:
                    relay.finish()
                    shown = relay.stderr_tail.replace(b"\r\n", b"\n")
                    # A failure the guard reported (errno set: a cwd, Landlock) is already specific.
                    if isinstance(err, ExecError) or err.stderr or err.errno is not None or not shown:
                        raise _not_twice(err, shown) from None
                    # bwrap's own message (an execvp failure: a missing ELF interpreter...)
                    # went through the relay, not into the Result.
                    raise _not_twice(classify_setup_failure(shown, err.argv, command), shown) from None
                relay.finish()
        if args.record is not None and not args.json:
            with reader_may_leave():
                sys.stdout.buffer.write(result.stdout)
                sys.stdout.flush()
            sys.stderr.buffer.write(result.stderr)
            sys.stderr.flush()
        if created and not args.rm:
            print(f"lowlevel: workspace {created[0]}", file=sys.stderr)
    except BaseException as caught:
        if isinstance(caught, Terminated) or is_interrupt(caught):
            # The program may have written into its workspace: keep it (as after a normal end)
            # unless --rm asked for it to go.
            signum = caught.signum if isinstance(caught, Terminated) else signal.SIGINT
            if created and args.rm:
                _remove(created[0])
            raise Interrupted(signum, created[0] if created else None, bool(created and args.rm)) from None
        failure = _fd_exhaustion(caught)
        if created:
            from lowlevel.record import RecordError
            if isinstance(failure, (PolicyError, UnsupportedError, UsageError, LaunchError, RecordError)):
                # Nothing ran (a bad option, the command not found, setup failed): the
                # fresh workspace holds only the inputs.
                _remove(created[0])
                created.clear()
            else:
                # Maybe after the program ran (giving the workspace back failed...): keep it.
                print(f"lowlevel: workspace {created[0]}", file=sys.stderr)
        if failure is not caught:
            raise failure from None
        raise
    try:
        return _report(args, result)
    finally:
        if created and args.rm:
            _remove(created[0])


def _not_twice(err: LaunchError, shown: bytes) -> LaunchError:
    """``err`` without its quote of bwrap's message when the relay has put that message on the
    terminal already (it would be printed twice, one line after the other)."""
    quote = f" bwrap said: {err.stderr}"
    if err.stderr and quote in err.message and err.stderr.encode() in shown:
        err.message = err.message.replace(quote, " (bwrap's message is above)")
    return err


def _report(args: argparse.Namespace, result: Result) -> int:
    for note in result.notes:
        if note.startswith((RECORD_NOT_WRITTEN, WARNING_PREFIX)):
            print(f"lowlevel: {note}", file=sys.stderr)
        elif note == CPU_QUOTA_FALLBACK_NOTE and args.cpus is not None:
            print(f"lowlevel: warning: --cpus {args.cpus:g}: {note}; --cpu SECONDS (RLIMIT_CPU) still bounds "
                  "CPU time", file=sys.stderr)
        elif note == MEMORY_FALLBACK_NOTE and args.memory is not None:
            # Asked for on the command line and weaker than asked: said, as --cpus is (an
            # unprivileged caller without a writable memory cgroup got a bare MemoryError).
            print(f"lowlevel: warning: --memory {args.memory}: no writable memory cgroup here: it is RLIMIT_DATA "
                  "per process (an allocation past it fails with ENOMEM/MemoryError; files in /tmp, /dev/shm "
                  "and the sum over processes are not bounded by it); --json notes say more", file=sys.stderr)
        elif note == PIDS_FALLBACK_NOTE and args.pids is not None:
            print(f"lowlevel: warning: --pids {args.pids}: {note}", file=sys.stderr)
    if args.json:
        with reader_may_leave():
            print_json(result.to_json(), last=("argv",))
    if result.timed_out:
        if not args.json:
            grace = DEFAULT_KILL_AFTER_S if args.kill_after is None else args.kill_after
            how = (f"SIGTERM, then SIGKILL within {grace:g} s" if grace and args.record is None
                   else "the sandbox was killed")
            print(f"lowlevel: timed out after {args.timeout:g} s; {how}", file=sys.stderr)
        return EXIT_TIMEOUT
    if result.network and not args.json:
        from lowlevel.net.attempts import describe_attempt
        for attempt in result.network:
            if not attempt.allowed or attempt.error:
                print(f"lowlevel: egress: {describe_attempt(attempt)}", file=sys.stderr)
    if result.killed_by and not args.json:
        print(f"lowlevel: killed by {result.killed_by}"
              + (f" ({result.signal_name()})" if result.term_signal else ""), file=sys.stderr)
    if not args.json:
        for note in result.notes:  # why: the memory limit and the tmpfs bounds, pids, the network policy
            if note.startswith(VERDICT_NOTE_PREFIXES):
                print(f"lowlevel: {note}", file=sys.stderr)
    return result.exit_code


#: The option that sets each :class:`Limits` field (a refusal names the option, not the field).
LIMIT_OPTIONS = {"memory_bytes": "--memory", "cpu_s": "--cpu", "pids": "--pids", "fsize_bytes": "--fsize",
                 "nofile": "--nofile", "tmp_size_bytes": "--tmp-size", "workspace_bytes": "--workspace-size",
                 "upper": "--upper", "cpu_quota": "--cpus", "net_bytes": "--net-bytes"}


def _in_options(err: PolicyError) -> PolicyError:
    """``err`` with the library's names (``Limits.nofile``, ``Bind source``) as the options the
    user typed (``--nofile``, ``--ro/--rw/-v source``); the same error otherwise."""
    import re
    message = re.sub(r"\bLimits\.(\w+)", lambda m: LIMIT_OPTIONS.get(m[1], m[0]), str(err))
    message = re.sub(r"^Bind (source|dest)\b", r"--ro/--rw/-v \1", message)
    return err if message == str(err) else PolicyError(message)


def policy_from_args(args: argparse.Namespace) -> Policy:
    """The :class:`Policy` of a ``run``'s options.

    Raises:
        PolicyError: an option's value is refused; the message names the option.
    """
    try:
        return _policy_from_args(args)
    except PolicyError as err:
        raise _in_options(err) from None


def _policy_from_args(args: argparse.Namespace) -> Policy:
    overrides = {name: getattr(args, name_of_arg) for name, option in LIMIT_OPTIONS.items()
                 if name not in ("cpu_quota", "net_bytes")
                 and getattr(args, name_of_arg := option[2:].replace("-", "_")) is not None}
    binds = [Bind(src, dest, writable=False, allow_sensitive=args.allow_sensitive,
                  allow_sockets=args.allow_sockets) for src, dest in args.ro]
    binds += [Bind(src, dest, writable=True, allow_sensitive=args.allow_sensitive,
                   allow_sockets=args.allow_sockets) for src, dest in args.rw]
    binds += [Bind(src, dest, writable=writable, allow_sensitive=args.allow_sensitive,
                   allow_sockets=args.allow_sockets) for src, dest, writable in args.volume]
    if args.cpus is not None:
        overrides["cpu_quota"] = args.cpus
    env = [pair for path in args.env_file for pair in read_env_file(path)]
    env += [pair for pair in args.env if pair is not None]
    if args.net_bytes is not None:
        overrides["net_bytes"] = args.net_bytes
    network: bool | Egress = args.network in ("host", "bare")
    if egress_requested(args):
        pem = ""
        for path in args.ca_cert:
            try:
                with open(path, encoding="ascii") as f:
                    pem += f.read().rstrip("\n") + "\n"
            except (OSError, UnicodeDecodeError) as err:
                raise PolicyError(f"--ca-cert {path}: cannot read it: {err}") from None
        network = Egress(allow=tuple(args.allow_host), deny=tuple(args.deny_host),
                         allow_cidrs=tuple(args.allow_cidr), allow_ports=DEFAULT_PORTS + tuple(args.allow_port),
                         tls_ports=() if None in args.tls_port else DEFAULT_TLS_PORTS + tuple(args.tls_port),
                         extra_ca_pem=pem)
    if args.image and args.rootfs:
        raise PolicyError("give --image or --rootfs, not both")
    landlock = {"on": True, "off": False}.get(args.landlock, args.landlock)
    return Policy(network=network, binds=tuple(binds), env=tuple(env), limits=Limits(**overrides),
                  deterministic=args.deterministic, image=args.image, rootfs=args.rootfs,
                  rootfs_writable=args.writable_root, landlock=landlock)


def egress_requested(args: argparse.Namespace) -> bool:
    return bool(args.allow_host or args.deny_host or args.allow_cidr or args.allow_port or args.tls_port
                or args.ca_cert)


def read_stdin_for_record(limit: int = MAX_RECORD_STDIN_BYTES, fd: int = 0) -> bytes | None:
    """Stdin for ``--record``: all of it (at most ``limit`` bytes), or None for a terminal or
    a closed fd (the program then gets ``/dev/null``).

    Raises:
        UsageError: more than ``limit`` bytes.
    """
    from lowlevel.sandbox.relay import is_terminal_or_none

    if is_terminal_or_none(fd):
        return None
    chunks: list[bytes] = []  # an empty stdin is recorded as none: the program reads EOF either way
    total = 0
    while True:
        try:
            data = os.read(fd, min(1 << 20, limit + 1 - total))
        except InterruptedError:
            continue
        if not data:
            break
        chunks.append(data)
        total += len(data)
        if total > limit:
            raise UsageError(f"stdin is larger than {limit} bytes, the most --record stores: "
                             "put the data in a file and pass it with --input")
    return b"".join(chunks) or None
