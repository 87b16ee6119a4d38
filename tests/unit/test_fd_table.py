"""The fd table of a run (lowlevel/sandbox/plan.py): every child fd number in one place, no overlap.

Pure: no process, no fd opened. The Session's (9, 10) and the egress relay's (20, 21) numbers are
defined in their own modules; they must sit in the ``extra_fds`` range the table gives them.
"""

from __future__ import annotations

from lowlevel.host.probe import ETC_ENTRIES
from lowlevel.net.egress_run import CA_FD, RELAY_FD
from lowlevel.sandbox.argv import Fds
from lowlevel.sandbox.plan import ARGS_FD, CHILD_FDS, ETC_COPY_FD, EXTRA_FDS_MIN, guard_numbers, lay_out
from lowlevel.session.protocol import EXE_FD as _EXE_FD
from lowlevel.session.protocol import SOCK_FD as _SOCK_FD


def test_the_fixed_numbers_are_the_tables() -> None:
    assert ARGS_FD == 3
    assert CHILD_FDS == Fds(json_status=4, seccomp=6, passwd=7, group=8)
    assert EXTRA_FDS_MIN == 9 and ETC_COPY_FD == 24


def test_no_two_protocols_share_a_number() -> None:
    bwrap = {ARGS_FD, CHILD_FDS.json_status, CHILD_FDS.seccomp, CHILD_FDS.passwd, CHILD_FDS.group}
    assert len(bwrap) == 5 and max(bwrap) < EXTRA_FDS_MIN
    extra = {_SOCK_FD, _EXE_FD, RELAY_FD, CA_FD}
    assert len(extra) == 4
    assert all(EXTRA_FDS_MIN <= fd < ETC_COPY_FD for fd in extra), extra
    etc = set(range(ETC_COPY_FD, ETC_COPY_FD + len(ETC_ENTRIES)))
    assert not etc & (bwrap | extra | {0, 1, 2})


def test_the_anchor_numbers_its_own_fds_above_bwraps() -> None:
    bwrap = [(100, 0), (101, 1), (102, 2), (103, ARGS_FD), (104, 4), (105, 24)]
    exe, status = guard_numbers(bwrap)
    assert (exe, status) == (25, 26)
    bwrap += [(106, exe), (107, status)]
    layout = lay_out(bwrap, (("report", 110), ("lower", None), ("root", 111), ("lease", None)), [112, 113], 114)
    assert layout.pass_fds == (3, 4, 24, 25, 26)  # 0-2 are stdio, never "passed"
    assert layout.anchor_fds == {"report": 27, "root": 28, "cgroups": [29, 30], "cgroup_dir": 31}
    assert layout.threshold == 32 > max(dst for _s, dst in layout.mapping)
    children = [dst for _s, dst in layout.mapping]
    assert len(children) == len(set(children))  # one fd per number
    assert layout.mapping[:len(bwrap)] == tuple(bwrap)  # bwrap's first, in order
