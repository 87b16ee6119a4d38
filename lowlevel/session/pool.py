"""A warm Pool of fresh sandboxes: each call gets a sandbox of its own, used once.

One concept: keeping N session sandboxes started in advance (a background thread starts
replacements, another tears used ones down) so that a call has the isolation of :func:`lowlevel.run`
at close to a session's latency. Each sandbox is a :class:`lowlevel.session.sync.Session` whose
cgroup limits are rewritten for the one call it serves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lowlevel import workspace as _ws
from lowlevel.errors import PolicyError, SessionError, UnsupportedError
from lowlevel.sandbox._interrupts import deferred_interrupts
from lowlevel.sandbox.facts import planned_policy
from lowlevel.sandbox.failures import ExecError
from lowlevel.sandbox.request import DEFAULT_TIMEOUT_S
from lowlevel.sandbox.result import Result
from lowlevel.session.sync import Session
from lowlevel.spec import validate as _validate
from lowlevel.spec.limits import Limits
from lowlevel.spec.policy import WORKSPACE_DEST, Policy

log = logging.getLogger("lowlevel")

#: A path that exists in no sandbox: the Pool's warm-up command fails in execve on purpose.
_WARMUP_PROGRAM = "/.lowlevel-warmup-does-not-exist"
#: The warm-up command's timeout, seconds (it fails at once in execve).
WARMUP_TIMEOUT_S = 10


#: The largest Pool size: a bound against a typo (``size=10**6`` started sandboxes until the uid
#: range or memory ran out), well above what the per-run uid range holds by default.
MAX_SIZE = 4096

#: How many of a Pool's sandboxes start at once (each start mostly waits on bwrap and the init's
#: hello, so a few side by side refill faster; ``Pool(size=40)`` had started 80 bwrap processes
#: within 0.5 s).
MAX_PARALLEL_STARTS = max(4, 2 * (os.cpu_count() or 1))

#: What a call in flight raises once its sandbox was killed under it (``_Call.killed``).
_KILLED = {"closed": "the pool was closed while this call was in flight: Pool.close() killed its sandbox",
           "cancelled": "the call was cancelled: its sandbox was killed"}


def _retrieve(task: asyncio.Future[Result]) -> None:
    """Mark the outcome of a cancelled :meth:`Pool.arun`'s thread as seen (it raised what its
    sandbox's kill made of it): no "exception was never retrieved" log."""
    if not task.cancelled():
        task.exception()


class _Call:
    """One :meth:`Pool.run` in flight, from taking a sandbox to handing it back: its thread (close()
    does not wait for its own), the sandbox it holds (None before it has one and once it is handed
    back: only an attached sandbox is killed, never one being torn down) and why it was killed."""

    __slots__ = ("thread", "session", "killed")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.session: Session | None = None
        #: "closed" (Pool.close()) or "cancelled" (Pool.arun's task), set under the pool's lock.
        self.killed: str | None = None

    def error(self) -> SessionError:
        assert self.killed is not None
        return SessionError(_KILLED[self.killed], self.killed)


class Pool:
    """N sandboxes started in advance; each call gets a fresh one, used once, then destroyed.

    Each sandbox has its own fresh workspace (under ``workspace_base``, kept after use like
    :func:`lowlevel.run`'s: ``Result.workspace``), its own namespaces, ``/tmp`` and cgroup:
    nothing is shared between calls. A background thread starts replacements (a call that finds
    none ready waits for one already being started, else starts its own), another tears used
    sandboxes down.

    With the copy-on-write workspace, a call's Result is final when :meth:`run` returns: its
    changes are in ``Result.changes`` and (without a template) committed to its workspace.

    Args:
        policy: as for :func:`lowlevel.run`.
        size: how many sandboxes to keep ready (1 to :data:`MAX_SIZE`); at most
            :data:`MAX_PARALLEL_STARTS` of them start at once.
        workspace_base, bwrap: as for :class:`Session`.
        track_changes: fill ``Result.changes`` where the overlay is unavailable (a snapshot walk
            of the fresh workspace; with the overlay the changes come from its upper layer).
        template: a directory every call starts from: each sandbox gets a fresh copy-on-write
            overlay over it (nothing is copied; the directory is never written: calls' changes
            are reported and discarded). Needs the overlay (UnsupportedError otherwise).
        keep_workspace: keep each call's fresh workspace (default, as :func:`lowlevel.run`);
            False: a call's changes are reported in ``Result.changes`` and not committed, and
            its workspace is removed when its sandbox is torn down (named ``rm-...`` meanwhile,
            so ``lowlevel cleanup`` removes it if this process dies first). Ignored with
            ``template`` (which has no workspace of its own to keep).
    Raises:
        PolicyError: a bad argument. The first sandbox's start errors surface on the first call.
    """

    def __init__(self, policy: Policy | None = None, *, size: int = 2, workspace_base: str | None = None,
                 bwrap: str | None = None, track_changes: bool = True,
                 template: str | os.PathLike[str] | None = None, keep_workspace: bool = True) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_SIZE:
            raise PolicyError(f"Pool size must be an int from 1 to {MAX_SIZE}, got {size!r}: each one is a live "
                              "sandbox (five processes, a per-run uid); hold more with Sessions of your own")
        self.policy = planned_policy(Policy() if policy is None else policy)
        self.size = size
        self.template = None if template is None else os.fspath(template)
        self._kwargs: dict[str, Any] = {"workspace_base": workspace_base, "bwrap": bwrap,
                                        "track_changes": track_changes}
        if not isinstance(keep_workspace, bool):
            raise PolicyError(f"keep_workspace must be a bool, got {keep_workspace!r}")
        self.keep_workspace = keep_workspace or self.template is not None
        if self.template is not None:
            self._kwargs.update(workspace=self.template, commit=False, track_changes=False)
        elif not keep_workspace:
            self._kwargs.update(commit=False, keep_workspace=False)
        self._ready: collections.deque[Session] = collections.deque()
        self._retired: collections.deque[Session] = collections.deque()
        #: Sandboxes the starter is bringing up / the reaper is tearing down now / calls waiting
        #: for one of the starter's (each waits for one start already under way).
        self._starting = 0
        self._retiring = 0
        self._waiting = 0
        #: The calls in flight (:meth:`_take` to :meth:`_hand_back`): close() kills their sandboxes.
        self._calls: set[_Call] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        #: Calls served by a ready sandbox (or one the starter already had under way) / calls
        #: that had to start one themselves.
        self.hits = 0
        self.misses = 0
        # Two threads: starting a replacement never waits behind the teardown of a used sandbox
        # (bwrap's reap, the commit, the cgroup's removal: several ms, much of it waiting).
        self._thread = threading.Thread(target=self._worker, name="lowlevel-pool", daemon=True)
        self._reaper = threading.Thread(target=self._reap, name="lowlevel-pool-reaper", daemon=True)
        self._thread.start()
        self._reaper.start()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new(self) -> Session:
        s = Session(self.policy, **self._kwargs)
        if self.template is not None and not s._core.run.cow:
            s.close()
            raise UnsupportedError("overlay", "Pool(template=...) needs the copy-on-write workspace: "
                                   + "; ".join(s._core.run.notes))
        try:
            # Warm the path once (the init's first message, allocations, shepherd fork, a
            # failed execve) so the caller's command is not the first through it.
            s.run([_WARMUP_PROGRAM], timeout=WARMUP_TIMEOUT_S, track_changes=False)
        except ExecError:
            pass
        except BaseException:
            s.close()
            raise
        return s

    def _worker(self) -> None:
        """The starter: keep ``size`` sandboxes ready or starting. Each start runs in a thread of
        its own, several at once: a start is mostly waiting (bwrap, the cgroup's attach, the
        init's hello), so starts side by side refill the pool faster than one after another."""
        while True:
            with self._cond:
                while not self._closed and (len(self._ready) + self._starting >= self.size
                                            or self._starting >= MAX_PARALLEL_STARTS
                                            or self._error is not None):
                    self._cond.wait()
                if self._closed:
                    return
                self._starting += 1
            threading.Thread(target=self._start_one, name="lowlevel-pool-start", daemon=True).start()

    def _start_one(self) -> None:
        try:
            s = self._new()
        except BaseException as err:  # noqa: BLE001 - reported on the next call
            with self._cond:
                self._starting -= 1
                self._error = err
                self._cond.notify_all()
            return
        with self._cond:
            if not self._closed:
                self._starting -= 1
                self._ready.append(s)
                self._cond.notify_all()
                return
        try:
            s.close()
            if self.template is None:
                _ws.remove_workspace(s.directory)  # started as the pool closed: never used
        finally:
            with self._cond:  # counted until gone: close() waits for it
                self._starting -= 1
                self._cond.notify_all()

    def _reap(self) -> None:
        """The reaper: tear down used (or dead) sandboxes, beside the starter."""
        while True:
            with self._cond:
                while not self._closed and not self._retired:
                    self._cond.wait()
                if self._closed:
                    return
                retire = self._retired.popleft()
                self._retiring += 1
            try:
                retire.close()
            except Exception as err:  # noqa: BLE001
                log.warning("lowlevel: pool teardown failed: %s", err)
            finally:
                with self._cond:
                    self._retiring -= 1
                    self._cond.notify_all()

    def _take(self, call: _Call) -> Session:
        """A sandbox for ``call``, attached to it: a ready one, one the starter has under way,
        else one started here. From here until :meth:`_hand_back` the call is in flight: close()
        kills its sandbox and waits for it.

        Raises:
            SessionError(reason="closed"): the pool is (or was meanwhile) closed; "cancelled": the
                call was cancelled before it had its sandbox (kept ready for the next call).
            Others: the starter's (or this call's own) sandbox start failed.
        """
        with self._cond:
            if self._closed:
                raise SessionError("the pool is closed", "closed")
            self._calls.add(call)
        try:
            s = self._take_ready(call)
            if s is None:
                s = self._new()
        except BaseException:
            with self._cond:
                self._calls.discard(call)
                self._cond.notify_all()
            raise
        with self._cond:
            if not self._closed:
                if call.killed is None:
                    call.session = s
                    return s
                self._ready.appendleft(s)  # cancelled before it was used: still fresh
                self._calls.discard(call)
                self._cond.notify_all()
                raise call.error()
        self._tear_down(call, s, unused=True)
        raise call.error()

    def _take_ready(self, call: _Call) -> Session | None:
        """A ready sandbox, waiting for one the starter has under way; None: start one (a miss)."""
        with self._cond:
            # No notify on a hit: the worker refills when this call is over (run's finally), so
            # starting the replacement (bwrap, cgroup, workspace: CPU and the GIL) does not
            # compete with the call itself.
            while True:
                while self._ready:
                    s = self._ready.popleft()
                    if s.alive:
                        self.hits += 1
                        return s
                    self._retired.append(s)
                    self._cond.notify_all()
                # A start the starter has under way (begun before this call, so sooner done than
                # one begun now), not yet promised to another waiting call: wait for it.
                if call.killed is not None or self._error is not None or self._starting <= self._waiting:
                    break
                self._waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self._waiting -= 1
            if call.killed is not None:
                raise call.error()
            err, self._error = self._error, None
            self.misses += 1
            self._cond.notify_all()
        if err is not None:
            raise err
        return None

    def _hand_back(self, call: _Call, s: Session) -> None:
        """The call is over: its sandbox goes to the reaper, or, the pool being closed, is torn
        down here (close() waits for it)."""
        with self._cond:
            call.session = None  # never killed from now on: it is being torn down
            if not self._closed:
                self._calls.discard(call)
                self._retired.append(s)
                self._cond.notify_all()
                return
        self._tear_down(call, s, unused=False)

    def _tear_down(self, call: _Call, s: Session, *, unused: bool) -> None:
        """Close ``s`` (a call's, the pool closed: close() waits for it), then the call is over."""
        try:
            with deferred_interrupts():
                s.close()
                if unused and self.template is None:
                    _ws.remove_workspace(s.directory)  # started for the call, never used
        except Exception as err:  # noqa: BLE001
            log.warning("lowlevel: pool teardown failed: %s", err)
        finally:
            with self._cond:
                self._calls.discard(call)
                self._cond.notify_all()

    def _kill(self, call: _Call, why: str) -> None:
        """Kill the sandbox of ``call`` (its command sees the session end and raises); holds the lock.
        Only SIGKILLs (no wait for the cgroup to empty): the teardown empties and removes it."""
        if call.killed is None:
            call.killed = why
        s = call.session
        if s is not None:
            try:
                s._core.run.kill(None, cgroup_kill=False)
            except Exception as err:  # noqa: BLE001
                log.warning("lowlevel: cannot kill a pool call's sandbox: %s", err)
        self._cond.notify_all()

    def run(self, argv: Sequence[str], *, inputs: Sequence[str | os.PathLike[str] | tuple[str, str]] = (),
            stdin: bytes | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
            env: Mapping[str, str] | None = None, cwd: str | None = None,
            limits: Limits | None = None) -> Result:
        """Run one command in a fresh sandbox taken from the pool (as :func:`lowlevel.run`).

        Args:
            inputs: host files or directories copied into the sandbox's empty workspace first
                (paths, or ``(path, dest)`` pairs as for :func:`lowlevel.run`).
            limits: this call's limits (default: the Pool's Policy's). The sandbox serves
                this call alone, so its cgroup's ``memory_bytes``, ``pids`` and ``cpu_quota``
                are rewritten to these values first and apply exactly as in
                :func:`lowlevel.run` (where no cgroup enforces them, the rlimit fallbacks
                apply per process, at most the Pool's values); ``tmp_size_bytes`` and
                ``workspace_bytes`` were fixed when the sandbox started and must equal the
                Pool's (else PolicyError).
            Others: as :meth:`Session.run`.
        Raises:
            WorkspaceError: an input is missing or unreadable. Others as :meth:`Session.run`.
        """
        return self._run(_Call(), argv, inputs=inputs, stdin=stdin, timeout=timeout, env=env, cwd=cwd,
                         limits=limits)

    def _run(self, call: _Call, argv: Sequence[str], *,
             inputs: Sequence[str | os.PathLike[str] | tuple[str, str]] = (), stdin: bytes | None = None,
             timeout: float | None = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None,
             cwd: str | None = None, limits: Limits | None = None) -> Result:
        """:meth:`run` as ``call`` (which :meth:`arun` keeps, to kill its sandbox on cancellation)."""
        call.thread = threading.get_ident()
        cwd = cwd if cwd is not None else (self.policy.workdir or WORKSPACE_DEST)
        _validate.run_args(command=argv, cwd=cwd, env=env, inputs=inputs)  # before a sandbox is used up
        s = self._take(call)
        try:
            result = self._serve(s, argv, inputs=inputs, stdin=stdin, timeout=timeout, env=env, cwd=cwd,
                                 limits=limits)
        except Exception as err:
            if call.killed is None:
                raise
            raise call.error() from err  # what the kill made of it (the session ended under it...)
        finally:
            self._hand_back(call, s)
        if call.killed is not None:  # killed as it finished: in flight at close() all the same
            raise call.error()
        return result

    def _serve(self, s: Session, argv: Sequence[str], *, inputs: Sequence[str | os.PathLike[str] | tuple[str, str]],
               stdin: bytes | None, timeout: float | None, env: Mapping[str, str] | None, cwd: str,
               limits: Limits | None) -> Result:
        """The call in its sandbox ``s``: the limits, the inputs, the command, the changes."""
        if limits is not None:
            s._core.set_cgroup_limits(limits)
        if inputs and self.template is not None:
            # Into this call's view (its upper layer), owned as its sandbox.
            names = _ws.copy_inputs(s.workspace, inputs)
            if s._core.run.facts.caller_is_root:
                for name in dict.fromkeys(n.split("/")[0] for n in names):
                    _ws.chown_tree(os.path.join(s.workspace, name), *s.host_ids)
        elif inputs:
            # Into the directory itself (the overlay's lower layer: this sandbox's fresh,
            # still unvisited workspace), so they are inputs, not changes; the idmapped lower
            # gives them to the sandbox's uid without a chown.
            names = _ws.copy_inputs(s.directory, inputs)
            if s._core.run.facts.caller_is_root and not s._core.run.cow:
                for name in dict.fromkeys(n.split("/")[0] for n in names):
                    _ws.chown_tree(os.path.join(s.directory, name), *s.host_ids)
            # The call starts from here: its commit must not take the inputs for host changes
            # made during the run (a program that edits or deletes an input got a conflict).
            s._core.run.since_ns = time.time_ns()
        result = s.run(argv, stdin=stdin, timeout=timeout, env=env, cwd=cwd, limits=limits,
                       track_changes=False if s._core.run.cow else None)
        if self.template is not None:
            result.changes = s.diff()  # reported; the template is never written
        elif not self.keep_workspace:
            if s._core.run.cow:
                result.changes = s.diff()  # reported, not committed: the workspace goes with the sandbox
            result.notes = (*result.notes, "workspace removed after the call (keep_workspace=False)")
        elif s._core.run.cow:
            # The Result is final when it is returned: the call's changes are in its workspace.
            # No fresh layer after it (the sandbox runs nothing more): no anchor RESET round trip.
            result.changes = s._final_commit()
        return result

    async def arun(self, argv: Sequence[str], **kwargs: Any) -> Result:
        """:meth:`run` in a worker thread, for asyncio callers: same arguments, Result and errors.

        Cancelling the task kills the call's sandbox (its command with it, as cancelling
        :func:`lowlevel.arun` does) and waits for the call to hand it back (a call still
        starting its own sandbox or copying its ``inputs`` finishes that first; one still waiting
        for a sandbox leaves it ready for the next call), then raises CancelledError."""
        call = _Call()
        task = asyncio.ensure_future(asyncio.to_thread(self._run, call, argv, **kwargs))
        task.add_done_callback(_retrieve)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with self._cond:
                self._kill(call, "cancelled")
            await asyncio.wait({task})  # prompt after the kill; its error is the cancellation's doing
            raise

    def close(self) -> None:
        """Stop refilling and destroy every sandbox; idempotent.

        Calls in flight (in other threads, or :meth:`arun` tasks) are ended: their sandboxes are
        killed at once and they raise ``SessionError(reason="closed")`` ("the pool was closed while
        this call was in flight"), even one whose command had just finished; close() waits for
        them to hand their sandboxes back (a kill makes that prompt; a call still copying its
        ``inputs`` finishes the copy first) and returns once every sandbox is torn down: no
        process, fd, cgroup, run record or ``keep_workspace=False`` workspace of the pool is
        left. (A call of the thread calling close(), as from a signal handler, is killed and
        tears its sandbox down itself once it returns.) Calls made after close() raise
        ``SessionError(reason="closed")`` ("the pool is closed").

        A signal handler's exception (^C, a SIGTERM handler's SystemExit) arriving meanwhile is
        held back until every sandbox is gone (:class:`deferred_interrupts`; each close is
        bounded: a kill and a reap), then raised: it abandoned the ones not yet closed before,
        their cgroups and records left to ``lowlevel cleanup`` (bench/kill_campaign.py)."""
        me = threading.get_ident()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for call in self._calls:
                self._kill(call, "closed")
            self._cond.notify_all()
        with deferred_interrupts():  # delivered once every sandbox is gone
            self._thread.join()
            self._reaper.join()
            with self._cond:
                # Starts under way close what they started (the pool is closed); calls in flight
                # tear theirs down as they hand them back (_hand_back).
                while self._starting or any(call.thread != me for call in self._calls):
                    self._cond.wait()
            while self._ready or self._retired:
                unused = bool(self._ready)
                s = (self._ready or self._retired).popleft()
                try:
                    s.close()
                    if unused and self.template is None:
                        _ws.remove_workspace(s.directory)  # started in advance, never used: nothing to keep
                except Exception as err:  # noqa: BLE001
                    log.warning("lowlevel: pool teardown failed: %s", err)
