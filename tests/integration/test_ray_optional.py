"""Ray is an optional extra: the core package never imports it; lowlevel.ray says how to get it.

These run with or without Ray installed (each check is a fresh interpreter, so modules
imported by other tests do not count).
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import lowlevel

CORE_MODULES = sorted(name for name in (m.name.removeprefix("lowlevel.")
                                          for m in pkgutil.walk_packages(lowlevel.__path__, "lowlevel."))
                      if name not in ("ray", "__main__") and not name.startswith(("integrations.", "ray."))
                      and not name.rsplit(".", 1)[-1].startswith("_"))


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_core_modules_listed():
    # the list the next test imports is the package's real content, not an empty loop
    assert {"sandbox.launcher", "sandbox.aio", "session", "spec.policy", "cli", "doctor", "workspace",
            "mcp_server"} <= set(CORE_MODULES)


def test_import_lowlevel_and_every_core_module_never_imports_ray():
    code = (
        "import importlib, sys\n"
        "import lowlevel\n"
        "for name in lowlevel.__all__: getattr(lowlevel, name)\n"   # the lazy names too
        f"for m in {CORE_MODULES!r}:\n"
        "    try:\n"
        "        importlib.import_module('lowlevel.' + m)\n"
        "    except ImportError as err:\n"   # an optional extra of its own (mcp) may be missing
        "        print('skipped', m, err, file=sys.stderr)\n"
        "bad = sorted(k for k in sys.modules if k == 'ray' or k.startswith('ray.'))\n"
        "print(','.join(bad))\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"core modules imported Ray: {proc.stdout.strip()}"


def test_cli_help_and_doctor_json_never_import_ray():
    code = ("import sys, runpy\n"
            "sys.argv = ['lowlevel', '--help']\n"
            "try:\n"
            "    runpy.run_module('lowlevel', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('RAY' if any(k == 'ray' or k.startswith('ray.') for k in sys.modules) else 'CLEAN')\n")
    proc = _python(code)
    assert proc.stdout.strip().endswith("CLEAN"), proc.stdout + proc.stderr


def test_lowlevel_ray_without_ray_says_how_to_install():
    # sys.modules["ray"] = None makes "import ray" fail as if the package were absent
    proc = _python("import sys; sys.modules['ray'] = None\n"
                   "try:\n"
                   "    import lowlevel.ray\n"
                   "except ImportError as err:\n"
                   "    print('ERR', err)\n")
    assert proc.returncode == 0, proc.stderr
    assert "ERR lowlevel.ray needs Ray: pip install '.[ray]' in the lowlevel checkout" in proc.stdout
