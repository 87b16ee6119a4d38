"""lowlevel.host.hostcache: host facts across processes, trusted only when they are ours and current."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from lowlevel.host import hostcache

from lowlevel.sandbox import failures

from lowlevel.host import seccomp_filter
from lowlevel.spec.seccomp import DEFAULT_PROFILE

from helpers import caches

cache = caches.cache  # the fixture (tests/helpers/caches.py)
_fresh_process = caches.fresh_process


def test_round_trip_and_key_mismatch(cache: Path) -> None:
    hostcache.put("host", "x", [1, "a"], {"v": 2})
    assert (cache / "host.json").exists()
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache / "host.json").st_mode) == 0o600
    _fresh_process()
    assert hostcache.get("host", "x", [1, "a"]) == {"v": 2}
    assert hostcache.get("host", "x", [1, "b"]) is None  # another key: a miss
    assert hostcache.get("host", "y", [1, "a"]) is None


def test_another_boot_or_kernel_invalidates_everything(cache: Path) -> None:
    hostcache.put("host", "x", 1, "v")
    doc = json.loads((cache / "host.json").read_text())
    doc["base"]["boot_id"] = "another boot"
    (cache / "host.json").write_text(json.dumps(doc))
    _fresh_process()
    assert hostcache.get("host", "x", 1) is None


@pytest.mark.parametrize("tamper", ["group_writable", "symlink", "other_owner"])
def test_a_file_we_cannot_trust_is_ignored(cache: Path, tmp_path: Path, tamper: str) -> None:
    hostcache.put("host", "x", 1, "v")
    f = cache / "host.json"
    if tamper == "group_writable":
        f.chmod(0o620)
    elif tamper == "symlink":
        real = tmp_path / "elsewhere.json"
        f.rename(real)
        f.symlink_to(real)
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root")
        os.chown(f, 65534, 65534)
    _fresh_process()
    assert hostcache.get("host", "x", 1) is None


def test_a_directory_others_may_write_is_not_used(cache: Path) -> None:
    hostcache.put("host", "x", 1, "v")
    cache.chmod(0o777)
    _fresh_process()
    assert hostcache.cache_dir() is None
    assert hostcache.get("host", "x", 1) is None
    hostcache.put("host", "y", 1, "v")  # no error, nothing written
    assert json.loads((cache / "host.json").read_text())["entries"].keys() == {"x"}


def test_turned_off(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWLEVEL_NO_CACHE", "1")
    hostcache.put("host", "x", 1, "v")
    assert not (cache / "host.json").exists()
    assert hostcache.get("host", "x", 1) is None


def test_bounded_to_the_newest_entries(cache: Path) -> None:
    for i in range(hostcache.MAX_ENTRIES + 5):
        hostcache.put("seccomp", f"e{i}", i, i)
    _fresh_process()
    entries = json.loads((cache / "seccomp.json").read_text())["entries"]
    assert len(entries) == hostcache.MAX_ENTRIES
    assert hostcache.get("seccomp", f"e{hostcache.MAX_ENTRIES + 4}", hostcache.MAX_ENTRIES + 4) is not None
    assert hostcache.get("seccomp", "e0", 0) is None


def test_forget(cache: Path) -> None:
    hostcache.put("host", "x", 1, "v")
    hostcache.forget("host")
    assert not (cache / "host.json").exists()
    assert hostcache.get("host", "x", 1) is None


# -- what is cached ------------------------------------------------------------------------------

def _forget_filters() -> None:
    with seccomp_filter._cache_lock:
        seccomp_filter._filters.clear()
        seccomp_filter._cache.clear()


def test_seccomp_filter_from_disk_equals_the_compiled_one(cache: Path) -> None:
    _forget_filters()
    compiled = seccomp_filter.compile_bpf(DEFAULT_PROFILE)
    assert len(seccomp_filter._cache) == 1
    _forget_filters()
    _fresh_process()
    assert seccomp_filter.compile_bpf(DEFAULT_PROFILE) == compiled
    assert len(seccomp_filter._cache) == 0, "served from the disk cache, not compiled again"
    # Another libseccomp (an upgrade): the entry no longer matches, the filter is compiled again.
    doc = json.loads((cache / "seccomp.json").read_text())
    for item in doc["entries"].values():
        item["value"]["libseccomp"][1] += 1  # its mtime
    (cache / "seccomp.json").write_text(json.dumps(doc))
    os.chmod(cache / "seccomp.json", 0o600)
    _forget_filters()
    _fresh_process()
    assert seccomp_filter.compile_bpf(DEFAULT_PROFILE) == compiled
    assert len(seccomp_filter._cache) == 1


def test_seccomp_entries_differ_by_profile_and_compat(cache: Path) -> None:
    _forget_filters()
    a = seccomp_filter.compile_bpf(DEFAULT_PROFILE)
    b = seccomp_filter.compile_bpf(DEFAULT_PROFILE, compat_32bit=True)
    c = seccomp_filter.compile_bpf(DEFAULT_PROFILE.with_extra_deny("getpid"))
    assert len({a, b, c}) == 3
    _forget_filters()
    _fresh_process()
    assert (seccomp_filter.compile_bpf(DEFAULT_PROFILE), seccomp_filter.compile_bpf(DEFAULT_PROFILE, compat_32bit=True),
            seccomp_filter.compile_bpf(DEFAULT_PROFILE.with_extra_deny("getpid"))) == (a, b, c)


def test_every_builtin_syscall_name_is_known_to_libseccomp() -> None:
    """The built-in table is not checked against libseccomp at import (that would load it in
    every process): this test is that check."""
    backend = seccomp_filter._backend()
    unknown = [r.syscall for r in DEFAULT_PROFILE.rules if backend.resolve(r.syscall) == -1]
    assert unknown == []


def test_a_setup_failure_forgets_the_host_facts(cache: Path) -> None:
    hostcache.put("host", "cow:1:/x", 1, {"ok": True, "reason": ""})
    err = failures.classify_setup_failure(b"lowlevel_exec: mount overlay on /x: Invalid argument\n", ["x"], ["true"])
    assert "mount overlay" in str(err)
    assert not (cache / "host.json").exists()
    # A missing command is the command's fault, not the host's: the facts stay.
    hostcache.put("host", "cow:1:/x", 1, {"ok": True, "reason": ""})
    failures.classify_setup_failure(b"bwrap: execvp nope: No such file or directory\n", ["x"], ["nope"])
    assert (cache / "host.json").exists()
