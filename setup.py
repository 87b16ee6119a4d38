"""Build hook: the CFFI extension modules and the session init executable (see native/)."""
import os
import platform
import shutil
import subprocess
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext

#: Static executables built next to the extension modules: (source, target in the package).
EXECUTABLES = (
    # The session init: bwrap execs it inside the sandbox, where no Python runs.
    (os.path.join("native", "lowlevel_init.c"), os.path.join("lowlevel", "_lowlevel_init")),
    # The exec helper for root callers: setrlimit, drop uid/gid/groups, execv bwrap (one exec
    # instead of prlimit(1) + setpriv(1)); the launcher falls back to those when it is missing.
    (os.path.join("native", "lowlevel_exec.c"), os.path.join("lowlevel", "_lowlevel_exec")),
    # The run guard: bwrap execs it in place of the program of a fresh sandbox; it applies
    # Landlock and reports the program's wait status (lowlevel/landlock.py). Freestanding where
    # native/lowlevel_sys.h has raw syscalls (NOLIBC_FLAGS), with libc elsewhere.
    (os.path.join("native", "lowlevel_guard.c"), os.path.join("lowlevel", "_lowlevel_guard")),
    # The egress relay: inside the sandbox, 127.0.0.1:3128 -> the host proxy's unix socket.
    (os.path.join("native", "lowlevel_relay.c"), os.path.join("lowlevel", "_lowlevel_relay")),
)

#: Executables first tried freestanding: no libc start-up (glibc's static one costs ~0.3 ms
#: of CPU per exec on a VM, and the guard runs once per sandbox).
NOLIBC = {os.path.join("lowlevel", "_lowlevel_guard")}
NOLIBC_FLAGS = ["-DLOWLEVEL_NOLIBC", "-static", "-nostdlib", "-ffreestanding", "-fno-stack-protector",
                "-fno-pie", "-no-pie", "-fno-asynchronous-unwind-tables", "-fcf-protection=none"]
#: Executables first linked statically against musl (``musl-gcc``, Debian's musl-tools) where it
#: is installed: glibc's static start-up costs ~0.45 ms of CPU per exec on a VM, most of it
#: ``cpuid`` (each a VM exit: ~6.5 us here) in its CPU-feature and cache-size probing; musl's
#: costs what a freestanding binary does (bench/exec_cost.py). The anchor is exec'd on every
#: run's critical path, the relay once per egress run. ``LOWLEVEL_NO_MUSL=1`` builds them with
#: glibc; without musl-gcc they are built with glibc as before. (The session init stays on glibc:
#: musl reserves real-time signal 34 too, and its exec is once per Session, off the per-command path.)
MUSL = {os.path.join("lowlevel", "_lowlevel_exec"), os.path.join("lowlevel", "_lowlevel_relay")}


class BuildExtWithInit(build_ext):
    """build_ext, then compile each of ``EXECUTABLES`` into a static ``lowlevel/_lowlevel_*``.

    Plain executables, not extension modules. Linked statically (glibc's libc.a, Debian
    package libc6-dev) so they do not depend on the sandbox's libraries and start fast (no
    dynamic loader); fall back to dynamic linking when libc.a is missing. Editable installs
    (``pip install -e``) build them in place, in ``lowlevel/`` (the extension goes to ``lowlevel/host/_native*.so``).
    """

    def run(self) -> None:
        super().run()
        for source, target in EXECUTABLES:
            self.build_executable(source, target)

    def output(self, target: str) -> str:
        base = "" if self.inplace else self.build_lib
        return os.path.join(base, target)

    def build_executable(self, source: str, target: str) -> None:
        out = self.output(target)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
        cc = cc.split()
        flags = ["-O2", "-Wall", "-std=gnu11", "-o", out + ".tmp", source]
        # The builds to try, best first, each with what to say when it fails; the last resort,
        # a dynamic link, raises.
        attempts: list[tuple[list[str], str]] = []
        musl = shutil.which("musl-gcc")
        if target in MUSL and musl and not os.environ.get("LOWLEVEL_NO_MUSL"):
            attempts.append(([musl, "-static", *flags], f"musl build of {source} failed; building it with glibc"))
        if target in NOLIBC and platform.machine() in ("x86_64", "aarch64"):
            attempts.append(([*cc, *NOLIBC_FLAGS, *flags, "-lgcc"],
                             f"freestanding build of {source} failed; building it with libc"))
        attempts.append(([*cc, "-static", *flags], f"static link of {source} failed (no libc.a?); linking dynamically"))
        for command, fallback in attempts:
            try:
                subprocess.run(command, check=True)
                break
            except subprocess.CalledProcessError:
                self.warn(fallback)
        else:
            subprocess.run([*cc, *flags], check=True)
        os.chmod(out + ".tmp", 0o755)
        shutil.move(out + ".tmp", out)

    def get_outputs(self) -> list:
        return [*super().get_outputs(), *(self.output(target) for _source, target in EXECUTABLES)]


setup(cffi_modules=["native/build_seccomp.py:ffibuilder"], cmdclass={"build_ext": BuildExtWithInit})
