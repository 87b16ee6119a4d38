/* ptrace_sibling: fork a child that sleeps, then try to reach it.
 *
 * Prints three lines "ptrace ERRNO", "process_vm_readv ERRNO", "kcmp ERRNO" (0 = worked)
 * and kills the child. Used inside the sandbox (expect the filter's errno) and outside
 * (control: all three work for our own child).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile long secret = 42;

int
main (void)
{
  long buf = 0;
  struct iovec local = { &buf, sizeof buf }, remote = { (void *) &secret, sizeof secret };
  pid_t pid = fork ();
  int e;

  if (pid < 0)
    return 2;
  if (pid == 0)
    {
      for (;;)
        pause ();
    }
  errno = 0;
  e = ptrace (PTRACE_ATTACH, pid, 0, 0) == 0 ? 0 : errno;
  printf ("ptrace %d\n", e);
  if (e == 0)
    {
      waitpid (pid, NULL, 0);
      ptrace (PTRACE_DETACH, pid, 0, 0);
    }
  e = process_vm_readv (pid, &local, 1, &remote, 1, 0) >= 0 ? 0 : errno;
  printf ("process_vm_readv %d\n", e);
  e = syscall (SYS_kcmp, getpid (), pid, 0 /* KCMP_FILE */, 0, 0) >= 0 ? 0 : errno;
  printf ("kcmp %d\n", e);
  kill (pid, SIGKILL);
  waitpid (pid, NULL, 0);
  return 0;
}
