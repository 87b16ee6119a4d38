"""Network egress, the host side: the per-run HTTP/CONNECT proxy that ``Policy(network=Egress(...))`` gets.

The decisions are :mod:`lowlevel.spec.egress`'s (pure); this package asks them and moves the
bytes. One concept per module:

- :mod:`lowlevel.net.egress_run`: what egress adds to one sandbox (:class:`EgressRun`: the
  listener, the relay in front of the command, its fds and bwrap mounts);
- :mod:`lowlevel.net.proxy`: one run's :class:`Listener` and what it does per connection;
- :mod:`lowlevel.net.loop`: the process's one asyncio thread serving every listener;
- :mod:`lowlevel.net.http_head`: the bounded request-head parser and its refusals;
- :mod:`lowlevel.net.tls_sni`: the TLS ClientHello server-name parser;
- :mod:`lowlevel.net.resolve`: one lookup per request, bounded per run, and the check of the
  answers (with its one injection point, :data:`lowlevel.net.resolve.override`);
- :mod:`lowlevel.net.host_addresses`: the host's own addresses, read from the kernel;
- :mod:`lowlevel.net.tunnel`: bytes both ways with splice(2), counted and capped;
- :mod:`lowlevel.net.attempts`: the run's record of its connection attempts.
"""
