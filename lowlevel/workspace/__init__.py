"""Per-run workspaces, and reading them back as untrusted output: the package's public face.

A run's workspace is the one writable host directory bound into the sandbox (at
``/workspace``). :func:`create_workspace` makes a fresh one per run under a base directory and
copies the inputs in, so an agent deleting files deletes only its own run's copy.

Everything in a workspace after a run is untrusted: :func:`snapshot`, :func:`list_files` and
:func:`read_file` walk it iteratively with ``openat`` relative to directory fds, never follow
a symlink (``O_NOFOLLOW`` on every component), refuse special files (fifos, sockets, devices)
and files with more than one hard link, and cap sizes and entry counts.

The modules of the package, one concept each (import from them inside lowlevel):

- :mod:`~lowlevel.workspace.walk`: the fd-relative, no-follow, iterative tree walk;
- :mod:`~lowlevel.workspace.changes`: :class:`FileEntry`, :class:`Changes`, :func:`snapshot`, :func:`diff`;
- :mod:`~lowlevel.workspace.files`: one file at a time (:func:`read_file`, :func:`write_file`...);
- :mod:`~lowlevel.workspace.create`: making, filling and removing a per-run workspace;
- :mod:`~lowlevel.workspace.checks`: which host directories may be a workspace;
- :mod:`~lowlevel.workspace.handover` and :mod:`~lowlevel.workspace.handover_journal`: handing
  a workspace to the sandbox's uid and back (no overlay), and its on-disk record;
- :mod:`~lowlevel.workspace.overlay`, :mod:`~lowlevel.workspace.cow`,
  :mod:`~lowlevel.workspace.uids`: copy-on-write workspaces (the upper layer, the mount side,
  the per-run uids).
"""

from __future__ import annotations

from lowlevel.host.trust import SYSTEM_DIRS, SYSTEM_TREES, check_trusted_ancestors
from lowlevel.workspace.changes import Changes, FileEntry, Snapshot, diff, snapshot
from lowlevel.workspace.checks import check_traversable, check_workspace_path, check_writable_fs, workspace_refusal
from lowlevel.workspace.create import (DISPOSABLE_PREFIX, chown_tree, copy_inputs, create_workspace, default_base,
                                       ensure_base, remove_workspace)
from lowlevel.workspace.files import (DEFAULT_READ_LIMIT, list_files, make_dir, make_symlink, read_file, set_mode,
                                      write_file)
from lowlevel.workspace.handover import ACL_XATTRS, MAX_PINNED, SETID_BITS, give_back, hand_over
from lowlevel.workspace.handover_journal import Handover
from lowlevel.workspace.walk import MAX_DEPTH, MAX_SNAPSHOT_ENTRIES

__all__ = ["ACL_XATTRS", "DEFAULT_READ_LIMIT", "DISPOSABLE_PREFIX", "MAX_DEPTH", "MAX_PINNED", "MAX_SNAPSHOT_ENTRIES",
           "SETID_BITS", "SYSTEM_DIRS", "SYSTEM_TREES", "Changes", "FileEntry", "Handover", "Snapshot",
           "check_traversable", "check_trusted_ancestors", "check_workspace_path", "check_writable_fs",
           "chown_tree", "copy_inputs", "create_workspace", "default_base", "diff", "ensure_base", "give_back",
           "hand_over", "list_files", "make_dir", "make_symlink", "read_file", "remove_workspace", "set_mode",
           "snapshot", "workspace_refusal", "write_file"]
