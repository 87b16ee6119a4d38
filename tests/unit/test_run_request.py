"""RunRequest (lowlevel/sandbox/request.py): each bad field is a PolicyError naming it, made
before anything exists; the values are normalized once. Pure: no process."""

from __future__ import annotations

import os

import pytest

from lowlevel.errors import PolicyError
from lowlevel.sandbox.request import RunRequest


@pytest.mark.parametrize("fields, match", [
    ({"command": "echo hi"}, "command must be a non-empty list"),
    ({"command": []}, "command must be a non-empty list"),
    ({"timeout": 0}, "timeout must be a finite number"),
    ({"timeout": True}, "timeout must be a finite number"),
    ({"kill_after": -1}, "kill_after must be a number of seconds >= 0"),
    ({"stdin": "text"}, "stdin must be bytes"),
    ({"capture": 1}, "capture must be a bool"),
    ({"commit": "yes"}, "commit must be True, False or 'on_success'"),
    ({"keep_workspace": 0}, "keep_workspace must be a bool"),
    ({"keep_workspace": False, "workspace": "/tmp/x"}, "keep_workspace=False removes the fresh"),
    ({"cwd": "/proc/self"}, "cwd"),
    ({"cwd": "/workspace/../etc"}, "must not contain '..'"),
    ({"env": ["A=b"]}, "env must be a mapping"),
    ({"inputs": "main.py"}, "inputs must be a list of paths"),
    ({"inputs": [("a",)]}, r"inputs\[0\] must be a path or a \(path, dest\) pair"),
    ({"workspace": ""}, "workspace"),
    ({"stdio_fds": (0, 1)}, "stdio_fds must be"),
    ({"stdio_fds": (None, 1, 2)}, "capture=True pipes stdout and stderr"),
    ({"stdin": b"x", "stdio_fds": (0, None, None)}, "pass stdin bytes or stdio_fds"),
    ({"record": "/tmp/r.json", "commit": False}, "does not go with record"),
    ({"record": "/tmp/r.json", "commit": "on_success"}, "does not go with record"),
    ({"record": "/tmp/r.json", "kill_after": 1}, "kill_after does not go with record"),
    ({"record": "/tmp/r.json", "stdio_fds": (0, None, None)}, "stdio_fds does not go with record"),
])
def test_a_bad_field_is_refused_with_its_name(fields: dict[str, object], match: str) -> None:
    fields = {"command": ["true"], **fields}
    with pytest.raises(PolicyError, match=match):
        RunRequest(**fields)  # type: ignore[arg-type]


def test_values_are_normalized_once() -> None:
    r = RunRequest(["true"], timeout=5, kill_after=1, stdin=bytearray(b"in"), env={"A": "b"},
                   cwd="/workspace//src/.", inputs=[("a", "b/c")], workspace=os.curdir)
    assert r.command == ("true",) and r.timeout == 5.0 and r.kill_after == 1.0 and r.stdin == b"in"
    assert dict(r.env) == {"A": "b"} and r.cwd == "/workspace/src" and r.inputs == (("a", "b/c"),)
    with pytest.raises(TypeError):
        r.env["B"] = "c"  # type: ignore[index]  # read-only
    with pytest.raises(AttributeError):
        r.timeout = 1  # type: ignore[misc]  # frozen


def test_refuse_names_the_entry_point_and_the_field() -> None:
    RunRequest(["true"]).refuse("x", "record", "commit", why="w")  # defaults: nothing to refuse
    with pytest.raises(PolicyError, match=r"lowlevel.arun does not take record= \(use record_run\)"):
        RunRequest(["true"], record="/tmp/r.json").refuse("lowlevel.arun", "record", why="use record_run")
