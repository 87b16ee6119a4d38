"""Copy-on-write workspaces: read an overlayfs upper directory, commit it, save it. Fds only.

A copy-on-write run mounts overlayfs with the user's directory as the read-only *lower* layer
and a per-run *upper* directory (on a sized tmpfs) taking every write; the sandbox sees the
merged tree. After the run the caller holds two ``O_DIRECTORY`` fds: ``upper_fd`` on the upper
directory (the mount namespace may be gone) and ``lower_fd`` on the user's directory. This
module turns the upper into a change report (:func:`read_changes`), applies it to the user's
directory (:func:`commit`), or copies it aside for the user (:func:`save_upper`) after a
conflict. Nothing here mounts anything.

What an upper directory holds (Documentation/filesystems/overlayfs.rst, "whiteouts and opaque
directories"; checked on Linux 6.18, see ``/work/shared/notes/overlay-workspace.md``):

- every entry the run created or changed, whole (a file appended to is *copied up*: the upper
  holds the full new content);
- a *whiteout* for every lower entry the run removed: a character device 0/0, or (never made
  by overlayfs itself, accepted here) a zero-size regular file with the ``<prefix>whiteout``
  xattr;
- *opaque* directories, ``<prefix>opaque`` = ``"y"``: the lower directory of that name is hidden
  entirely (``rm -rf d && mkdir d``). ``"x"`` is not opaque (it marks a directory holding
  xattr whiteouts);
- renames as delete + add: with ``redirect_dir`` off/nofollow, renaming a lower directory
  fails with EXDEV and ``mv`` copies it, so the upper holds a whiteout at the old name and a
  full copy at the new one. Uppers written with ``redirect_dir=on`` (``<prefix>redirect``) or
  ``metacopy=on`` (``<prefix>metacopy``: the upper file has no data) cannot be read
  correctly from the upper alone and are refused (WorkspaceError EOPNOTSUPP).

``<prefix>`` is ``"trusted.overlay."`` for overlays mounted by real root and ``"user.overlay."``
for ``userxattr`` mounts (unprivileged callers, in a user namespace). Note: on Linux 6.x with
``CONFIG_OVERLAY_FS_REDIRECT_ALWAYS_FOLLOW``, ``redirect_dir=off`` means ``follow``, which the
kernel refuses together with ``userxattr`` ("conflicting options"): mount ``userxattr``
overlays with ``redirect_dir=nofollow``.

Paths: every relative path reported here is built from the names ``os.listdir`` returns for a
directory fd: ``str`` decoded with the filesystem encoding and ``surrogateescape`` (PEP 383),
``/``-separated, without a leading ``./``. A non-UTF-8 name is kept exactly (``os.fsencode(path)``
gives its bytes back) and never crashes the walk; printing such a ``str`` to a strict UTF-8
stream raises, so encode it first.

Everything in an upper directory is untrusted (the sandbox made it). Never followed: every
open uses ``O_NOFOLLOW`` relative to a directory fd (``openat``/``unlinkat``/``renameat2``); no
path is ever walked from ``/``. Only the lower listing of a directory the upper marks opaque is
read (and, by :func:`commit`, the lower subtrees it deletes or replaces): the cost is
O(entries in the upper), never O(the user's directory).

The package's public face (this module) re-exports the functions above; the modules, one
concept each: :mod:`~lowlevel.workspace.overlay.fdops` (fd-relative operations),
:mod:`~lowlevel.workspace.overlay.upper` (reading an upper: :func:`read_changes`),
:mod:`~lowlevel.workspace.overlay.state`, :mod:`~lowlevel.workspace.overlay.apply_files` and
:mod:`~lowlevel.workspace.overlay.apply` (the commit walk), :mod:`~lowlevel.workspace.overlay.commits`
(:func:`commit`, :func:`commit_upper`), :mod:`~lowlevel.workspace.overlay.save` (:func:`save_upper`,
:func:`clear_dir`), :mod:`~lowlevel.workspace.overlay.leftovers` (:func:`cleanup_commit_leftovers`).
"""

from __future__ import annotations

from lowlevel.errors import CommitConflictError, CommitIncompleteError
from lowlevel.workspace.overlay.apply import COMMIT_SKIPPED_NOTE, CommitReport
from lowlevel.workspace.overlay.commits import NO_ROOM_ERRNOS, commit, commit_upper
from lowlevel.workspace.overlay.fdops import LEFTOVER_PREFIX, XATTR_PREFIXES
from lowlevel.workspace.overlay.leftovers import cleanup_commit_leftovers
from lowlevel.workspace.overlay.save import (
                                             SAVED_APPLIED,
                                             SAVED_NOT_APPLIED,
                                             SAVED_OPAQUE,
                                             SAVED_SKIPPED,
                                             SAVED_WHITEOUTS,
                                             clear_dir,
                                             iter_saved_list,
                                             save_upper,
)
from lowlevel.workspace.overlay.state import MAX_LINKED, STOP_ERRNOS
from lowlevel.workspace.overlay.upper import read_changes, upper_is_empty

__all__ = ["COMMIT_SKIPPED_NOTE",
           "LEFTOVER_PREFIX", "MAX_LINKED", "NO_ROOM_ERRNOS", "SAVED_APPLIED", "SAVED_NOT_APPLIED", "SAVED_OPAQUE",
           "SAVED_SKIPPED", "SAVED_WHITEOUTS", "STOP_ERRNOS", "XATTR_PREFIXES", "CommitConflictError",
           "CommitIncompleteError", "CommitReport", "cleanup_commit_leftovers", "clear_dir", "commit", "commit_upper",
           "iter_saved_list", "read_changes", "save_upper", "upper_is_empty"]
