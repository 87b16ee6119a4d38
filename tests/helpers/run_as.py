"""Run one lowlevel.run() from a JSON spec on stdin and print the Result as JSON.

The test suite executes this script as an unprivileged user (runuser) to test the
non-root path of bwrap with the same assertions as the root path. Spec keys:
``command``, ``timeout``, ``stdin_b64``, ``env``, ``network``, ``binds`` ([src, dest, writable(, allow_sockets)]),
``limits`` (Limits kwargs), ``files`` ({name: base64} written into a fresh workspace),
``workspace`` (an existing dir instead), ``cwd`` (inside the sandbox), ``commit`` (True, False or
"on_success"), ``egress`` (Egress kwargs: network by allowlist), ``resolver`` ({"answers": ...,
"pretend_public": [...]}: the egress tests' TEST-ONLY resolver override, see
scripted_resolver.py; the lookups made are returned as ``resolver_calls``), ``policy`` (more
Policy kwargs), ``extra_dirs`` ({fd number inside: host dir} opened here and passed in as fds,
see :func:`run_with_dir_fds`).
"""

import base64
import contextlib
import json
import os
import sys
import tempfile

import lowlevel
from lowlevel.workspace import write_file


def run_with_dir_fds(command, *, policy, workspace, timeout, stdin, dirs, commit=True, cwd="/workspace"):
    """``lowlevel.run`` with host directories passed in as open fds, ``{fd number inside: host
    dir}``: a test harness smuggling a handle past the mount namespace (the Landlock tests)."""
    from lowlevel.sandbox import launcher
    opened = {int(n): os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) for n, path in dirs.items()}
    try:
        from lowlevel.sandbox.request import RunRequest
        r = launcher.Run(RunRequest(command, workspace=workspace, timeout=timeout, stdin=stdin, commit=commit, cwd=cwd),
                         policy=policy, extra_fds=opened)
        try:
            from lowlevel.sandbox.drive import _drive_sync
            return _drive_sync(r)
        finally:
            r.close()
    finally:
        for fd in opened.values():
            os.close(fd)


def main() -> int:
    spec = json.load(sys.stdin)
    binds = tuple(lowlevel.Bind(s, d, writable=w, allow_sockets=bool(more and more[0]))
                  for s, d, w, *more in spec.get("binds", []))
    network = lowlevel.Egress(**spec["egress"]) if spec.get("egress") is not None else spec.get("network", False)
    policy = lowlevel.Policy(network=network, binds=binds, env=spec.get("env", {}),
                             limits=lowlevel.Limits(**spec.get("limits", {})), **spec.get("policy", {}))
    resolver = None
    override: contextlib.AbstractContextManager = contextlib.nullcontext()
    if spec.get("resolver") is not None:
        from scripted_resolver import ScriptedResolver, override_resolver
        resolver = ScriptedResolver(spec["resolver"]["answers"])
        override = override_resolver(resolver, pretend_public=spec["resolver"].get("pretend_public", ()))
    workspace = spec.get("workspace")
    if workspace is None:
        workspace = tempfile.mkdtemp(prefix="lowlevel-test-ws-")
        os.chmod(workspace, 0o755)
    for name, b64 in spec.get("files", {}).items():
        write_file(workspace, name, base64.b64decode(b64))
    stdin = base64.b64decode(spec["stdin_b64"]) if spec.get("stdin_b64") is not None else None
    out: dict = {}
    try:
        with override:
            if spec.get("extra_dirs"):
                result = run_with_dir_fds(spec["command"], policy=policy, workspace=workspace,
                                          timeout=spec.get("timeout", 60), stdin=stdin, dirs=spec["extra_dirs"],
                                          commit=spec.get("commit", True), cwd=spec.get("cwd", "/workspace"))
            else:
                result = lowlevel.run(spec["command"], policy=policy, workspace=workspace,
                                      timeout=spec.get("timeout", 60), stdin=stdin, cwd=spec.get("cwd", "/workspace"),
                                      commit=spec.get("commit", True))
    except lowlevel.LowlevelError as err:
        out = {"error": type(err).__name__, "message": str(err), "errno": getattr(err, "errno", None),
               "workspace": workspace}
    else:
        out = result.to_json()
        out["stdout_b64"] = base64.b64encode(result.stdout).decode()
        out["stderr_b64"] = base64.b64encode(result.stderr).decode()
    if resolver is not None:
        out["resolver_calls"] = resolver.calls
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
