"""Build hook: the CFFI extension modules and the session init executable (see native/)."""
import os
import shutil
import subprocess
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext

INIT_SOURCE = os.path.join("native", "lowlevel_init.c")
INIT_TARGET = os.path.join("lowlevel", "_lowlevel_init")


class BuildExtWithInit(build_ext):
    """build_ext, then compile native/lowlevel_init.c into a static ``lowlevel/_lowlevel_init``.

    A plain executable, not an extension module: bwrap execs it inside the sandbox, where no
    Python runs. Linked statically (glibc's libc.a, Debian package libc6-dev) so it does not
    depend on the sandbox's libraries; falls back to dynamic linking when libc.a is missing.
    Editable installs (``pip install -e``) build it in place, next to ``lowlevel/_native*.so``.
    """

    def run(self) -> None:
        super().run()
        self.build_init()

    def init_output(self) -> str:
        base = "" if self.inplace else self.build_lib
        return os.path.join(base, INIT_TARGET)

    def build_init(self) -> None:
        out = self.init_output()
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
        cc = cc.split()
        flags = ["-O2", "-Wall", "-std=gnu11", "-o", out + ".tmp", INIT_SOURCE]
        try:
            subprocess.run([*cc, "-static", *flags], check=True)
        except subprocess.CalledProcessError:
            self.warn("static link of lowlevel_init failed (no libc.a?); linking dynamically")
            subprocess.run([*cc, *flags], check=True)
        os.chmod(out + ".tmp", 0o755)
        shutil.move(out + ".tmp", out)

    def get_outputs(self) -> list:
        return [*super().get_outputs(), self.init_output()]


setup(cffi_modules=["native/build_seccomp.py:ffibuilder"], cmdclass={"build_ext": BuildExtWithInit})
