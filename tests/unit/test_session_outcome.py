"""How a session command that never ran is reported (lowlevel/session/outcome.start_error)."""

from __future__ import annotations

import errno

from lowlevel.errors import LaunchError
from lowlevel.sandbox.failures import ExecError
from lowlevel.session import protocol as proto
from lowlevel.session.command import Command
from lowlevel.session.outcome import start_error
from lowlevel.spec.policy import Policy

EXECVE = next(k for k, v in proto.STAGES.items() if v == "execve")


def _cmd() -> Command:
    return Command(1, ["/usr/bin/true"], Policy(), None, False)


def test_execve_at_the_process_limit_is_a_launch_error_naming_rlimit_nproc() -> None:
    # execve(2) fails with EAGAIN when the uid is above its RLIMIT_NPROC: seen in a loaded .ci/run
    # as "ExecError: /usr/bin/true: resource temporarily unavailable in the sandbox".
    err = start_error(_cmd(), proto.EXIT_SETUP_FAILED, errno.EAGAIN, EXECVE)
    assert isinstance(err, LaunchError) and "RLIMIT_NPROC" in str(err) and err.errno == errno.EAGAIN


def test_a_spawn_at_the_process_limit_names_it_too() -> None:
    err = start_error(_cmd(), proto.EXIT_SPAWN_FAILED, errno.EAGAIN, 0)
    assert isinstance(err, LaunchError) and "RLIMIT_NPROC" in str(err)


def test_a_missing_program_is_still_an_exec_error() -> None:
    err = start_error(_cmd(), proto.EXIT_SETUP_FAILED, errno.ENOENT, EXECVE)
    assert isinstance(err, ExecError) and "RLIMIT_NPROC" not in str(err)
