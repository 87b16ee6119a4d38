/* lowlevel_errtext.h: strerror(3) with glibc's wording, whichever libc the helper is linked with.
 *
 * The anchor and the relay are linked against musl where musl-gcc is installed (setup.py MUSL),
 * and musl words five errnos differently (musl 1.2.3 src/errno/__strerror.h against glibc's
 * _sys_errlist): EMFILE "No file descriptors available" / "Too many open files", ENOMEM "Out of
 * memory" / "Cannot allocate memory", EBUSY "Resource busy" / "Device or resource busy", ELOOP
 * "Symbolic link loop" / "Too many levels of symbolic links", EOPNOTSUPP "Not supported" /
 * "Operation not supported". The launcher reads these helpers' messages by those words
 * (lowlevel/sandbox/facts.py _TRANSIENT_TEXT, which is os.strerror's, glibc's; failures.py), and
 * users read them next to bwrap's, which is glibc's: so each helper says them as glibc does.
 * With glibc this is strerror itself (the table gives the same words).
 */
#ifndef LOWLEVEL_ERRTEXT_H
#define LOWLEVEL_ERRTEXT_H

#include <errno.h>
#include <string.h>

static const char *ll_strerror(int e) {
    switch (e) {
    case EMFILE: return "Too many open files";
    case ENOMEM: return "Cannot allocate memory";
    case EBUSY: return "Device or resource busy";
    case ELOOP: return "Too many levels of symbolic links";
    case EOPNOTSUPP: return "Operation not supported";
    default: return strerror(e);
    }
}

#endif
