/* seccomp_helper.h: the few things lowlevel needs from libseccomp that cffi's cdef can't
 * declare directly (function-like macros, version checks, the memfd export).
 *
 * Convention (libseccomp's): every int-returning function returns 0 or -errno, prints
 * nothing and frees what it allocates.
 */
#ifndef LOWLEVEL_SECCOMP_HELPER_H
#define LOWLEVEL_SECCOMP_HELPER_H

#include <stddef.h>
#include <stdint.h>
#include <seccomp.h>

/* 1 when libseccomp has seccomp_export_bpf_mem() (2.6.0 and later), else 0. */
extern const int LOWLEVEL_HAS_EXPORT_BPF_MEM;

/* SCMP_ACT_ERRNO(errnum) and SCMP_ACT_TRACE(msg_num): function-like macros. */
uint32_t ll_act_errno(uint16_t errnum);
uint32_t ll_act_trace(uint16_t msg_num);

/* Add a rule with up to 6 argument comparisons given as parallel arrays
 * (index, op, datum_a, datum_b), so Python needs no struct scmp_arg_cmp layout. */
int ll_rule_add(scmp_filter_ctx ctx, uint32_t action, int syscall, unsigned int arg_cnt,
                const unsigned int *arg_index, const int *arg_op,
                const uint64_t *datum_a, const uint64_t *datum_b);

/* Export the filter as BPF into buf (capacity *len bytes). On return *len holds the size
 * of the program. Returns -ERANGE (and the needed size in *len) if buf is too small. */
int ll_export_bpf(scmp_filter_ctx ctx, unsigned char *buf, size_t *len);

/* Name of syscall num on arch, copied into buf (NUL-terminated). -ENOENT if unknown. */
int ll_syscall_name(uint32_t arch, int num, char *buf, size_t len);

#endif
