"""CFFI build script (API mode, out-of-line) for ``lowlevel.host._native``.

Used by ``setup.py`` (``cffi_modules=["native/build_seccomp.py:ffibuilder"]``); run it by hand
with ``python native/build_seccomp.py`` to build in place. Needs libseccomp's headers
(Debian: ``apt-get install libseccomp-dev``). Not shipped in the package.

Only ``lowlevel/host/seccomp_filter.py`` imports the result (``lowlevel/doctor.py`` checks that it loads).
"""

from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent

ffibuilder = FFI()

ffibuilder.cdef(
    """
    typedef void *scmp_filter_ctx;

    /* actions */
    #define SCMP_ACT_KILL_PROCESS ...
    #define SCMP_ACT_KILL_THREAD ...
    #define SCMP_ACT_TRAP ...
    #define SCMP_ACT_LOG ...
    #define SCMP_ACT_ALLOW ...
    #define SCMP_ACT_NOTIFY ...

    /* arches (as libseccomp spells them) */
    #define SCMP_ARCH_NATIVE ...
    #define SCMP_ARCH_X86 ...
    #define SCMP_ARCH_X86_64 ...
    #define SCMP_ARCH_X32 ...
    #define SCMP_ARCH_ARM ...
    #define SCMP_ARCH_AARCH64 ...

    #define SCMP_VER_MAJOR ...
    #define SCMP_VER_MINOR ...
    #define SCMP_VER_MICRO ...

    #define __NR_SCMP_ERROR ...

    enum scmp_filter_attr {
        SCMP_FLTATR_ACT_DEFAULT, SCMP_FLTATR_ACT_BADARCH, SCMP_FLTATR_CTL_NNP, ...
    };
    enum scmp_compare {
        SCMP_CMP_NE, SCMP_CMP_LT, SCMP_CMP_LE, SCMP_CMP_EQ, SCMP_CMP_GE, SCMP_CMP_GT,
        SCMP_CMP_MASKED_EQ, ...
    };

    struct scmp_version { unsigned int major; unsigned int minor; unsigned int micro; };
    const struct scmp_version *seccomp_version(void);

    scmp_filter_ctx seccomp_init(uint32_t def_action);
    void seccomp_release(scmp_filter_ctx ctx);
    int seccomp_arch_add(scmp_filter_ctx ctx, uint32_t arch_token);
    uint32_t seccomp_arch_native(void);
    int seccomp_attr_set(scmp_filter_ctx ctx, enum scmp_filter_attr attr, uint32_t value);
    int seccomp_syscall_resolve_name(const char *name);

    /* seccomp_helper.h */
    extern const int LOWLEVEL_HAS_EXPORT_BPF_MEM;
    uint32_t ll_act_errno(uint16_t errnum);
    uint32_t ll_act_trace(uint16_t msg_num);
    int ll_rule_add(scmp_filter_ctx ctx, uint32_t action, int syscall, unsigned int arg_cnt,
                    const unsigned int *arg_index, const int *arg_op,
                    const uint64_t *datum_a, const uint64_t *datum_b);
    int ll_export_bpf(scmp_filter_ctx ctx, unsigned char *buf, size_t *len);
    int ll_syscall_name(uint32_t arch, int num, char *buf, size_t len);
    """
)



def _path(p: pathlib.Path) -> str:
    # setuptools wants relative paths; the in-place build below compiles in a scratch dir,
    # where only absolute ones resolve.
    return str(p) if __name__ == "__main__" else os.path.relpath(p)


ffibuilder.set_source(
    "lowlevel.host._native",
    '#include "seccomp_helper.h"',
    sources=[_path(HERE / "seccomp_helper.c")],
    include_dirs=[_path(HERE)],
    libraries=["seccomp"],
    extra_compile_args=["-Wall", "-Wextra", "-O2"],
)

if __name__ == "__main__":
    # In-place build for development: compile in a scratch dir, copy the .so into lowlevel/host/.
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        built = ffibuilder.compile(tmpdir=tmp, verbose=False)
        shutil.copy2(built, HERE.parent / "lowlevel" / "host" / pathlib.Path(built).name)
        print(HERE.parent / "lowlevel" / "host" / pathlib.Path(built).name)
