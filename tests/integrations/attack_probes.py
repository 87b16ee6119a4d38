"""Attack probes shared by the framework-adapter tests (imported by name: ``import attack_probes``).

Every attack is run twice: on the host (the control, which must succeed, so the probe is known
to work) and through the integration (where it must fail). The secret lives in a temporary
HOME made here; the real home is never read or written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class PlantedSecret:
    """A fake SSH key in a temporary HOME (``$HOME`` points there for the test)."""

    home: Path
    key_path: Path
    secret: str

    def ssh_attack(self) -> str:
        """Python source that prints every planted key it can read, by ``~`` and by host path."""
        return ("import os\n"
                f"for p in (os.path.expanduser('~/.ssh/id_ed25519'), {str(self.key_path)!r}):\n"
                "    try:\n"
                "        print(open(p).read())\n"
                "    except OSError as e:\n"
                "        print('blocked', p, type(e).__name__)\n")


def loopback_attack(port: int) -> str:
    """Python source that prints what a TCP server on host loopback answers, or why it could not."""
    return ("import socket\n"
            "try:\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "    print('got', s.recv(16).decode())\n"
            "except OSError as e:\n"
            "    print('blocked', type(e).__name__, e)\n")


def run_on_host(code: str) -> str:
    """The control: the same attack run as a plain host process, with the test's HOME."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ})
    return out.stdout + out.stderr


def blocked_lines(output: str) -> int:
    """How many attempts the probe reported as blocked (lines starting ``blocked ``)."""
    return sum(line.startswith("blocked ") for line in output.splitlines())
