"""Caller scripts that interrupt lowlevel at a chosen instant, shared by the tests and
bench/kill_campaign_repro.py (run as ``python -c SCRIPT ARGS``)."""

#: A ^C (SIGALRM -> KeyboardInterrupt) ``argv[1]`` seconds after a Pool(size=2) served one call,
#: landing in ``Pool.close()`` at the ``with`` block's end; prints "interrupted" or "no interrupt".
POOL_CLOSE = r"""
import signal, sys
import lowlevel
def interrupt(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
try:
    try:
        with lowlevel.Pool(size=2) as pool:
            pool.run(["true"])
            signal.setitimer(signal.ITIMER_REAL, float(sys.argv[1]))  # lands in close(), at the with's end
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)  # not later, in the interpreter's exit
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupted")
"""
