/* seccomp_helper.c: small C functions around libseccomp for lowlevel.seccomp.
 * See seccomp_helper.h for the conventions. */
#define _GNU_SOURCE
#include "seccomp_helper.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* seccomp_export_bpf_mem() arrived in libseccomp 2.6.0; Debian 12 ships 2.5.4. */
#if SCMP_VER_MAJOR > 2 || (SCMP_VER_MAJOR == 2 && SCMP_VER_MINOR >= 6)
const int LOWLEVEL_HAS_EXPORT_BPF_MEM = 1;
#else
const int LOWLEVEL_HAS_EXPORT_BPF_MEM = 0;
#endif

uint32_t
ll_act_errno (uint16_t errnum)
{
  return SCMP_ACT_ERRNO (errnum);
}

uint32_t
ll_act_trace (uint16_t msg_num)
{
  return SCMP_ACT_TRACE (msg_num);
}

int
ll_rule_add (scmp_filter_ctx ctx, uint32_t action, int syscall, unsigned int arg_cnt,
             const unsigned int *arg_index, const int *arg_op,
             const uint64_t *datum_a, const uint64_t *datum_b)
{
  struct scmp_arg_cmp cmp[6];
  unsigned int i;

  if (arg_cnt > 6)
    return -EINVAL;
  for (i = 0; i < arg_cnt; i++)
    {
      cmp[i].arg = arg_index[i];
      cmp[i].op = (enum scmp_compare) arg_op[i];
      cmp[i].datum_a = datum_a[i];
      cmp[i].datum_b = datum_b[i];
    }
  return seccomp_rule_add_array (ctx, action, syscall, arg_cnt, arg_cnt ? cmp : NULL);
}

#if SCMP_VER_MAJOR > 2 || (SCMP_VER_MAJOR == 2 && SCMP_VER_MINOR >= 6)
int
ll_export_bpf (scmp_filter_ctx ctx, unsigned char *buf, size_t *len)
{
  size_t need = 0;
  int rc = seccomp_export_bpf_mem (ctx, NULL, &need);
  if (rc < 0)
    return rc;
  if (need > *len)
    {
      *len = need;
      return -ERANGE;
    }
  *len = need;
  return seccomp_export_bpf_mem (ctx, buf, len);
}
#else
int
ll_export_bpf (scmp_filter_ctx ctx, unsigned char *buf, size_t *len)
{
  struct stat st;
  size_t done = 0;
  int fd, rc;

  fd = memfd_create ("lowlevel-seccomp-export", MFD_CLOEXEC);
  if (fd < 0)
    return -errno;
  rc = seccomp_export_bpf (ctx, fd);
  if (rc < 0)
    goto out;
  if (fstat (fd, &st) < 0)
    {
      rc = -errno;
      goto out;
    }
  if ((size_t) st.st_size > *len)
    {
      *len = (size_t) st.st_size;
      rc = -ERANGE;
      goto out;
    }
  while (done < (size_t) st.st_size)
    {
      ssize_t n = pread (fd, buf + done, (size_t) st.st_size - done, (off_t) done);
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0)
        {
          rc = n < 0 ? -errno : -EIO;
          goto out;
        }
      done += (size_t) n;
    }
  *len = done;
  rc = 0;
out:
  close (fd);
  return rc;
}
#endif

int
ll_syscall_name (uint32_t arch, int num, char *buf, size_t len)
{
  char *name = seccomp_syscall_resolve_num_arch (arch, num);
  size_t n;

  if (name == NULL)
    return -ENOENT;
  n = strlen (name);
  if (n + 1 > len)
    {
      free (name);
      return -ERANGE;
    }
  memcpy (buf, name, n + 1);
  free (name);
  return 0;
}
