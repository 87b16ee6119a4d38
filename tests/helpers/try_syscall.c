/* try_syscall: make raw syscalls and print what each returned.
 *
 *   try_syscall ABI NR A0 A1 A2 A3 A4 A5 [NR A0 ... A5]...
 *
 * ABI is "64" (syscall(2)), "32" (int 0x80 from this 64-bit process, i386 numbers and
 * 32-bit arguments) or "x32" (syscall(2) with bit 30, 0x40000000, set). Numbers are parsed
 * with strtoull base 0, so 0x... works and high 32 bits can be set. For each call one line
 * "RET ERRNO" is printed (ERRNO 0 on success) and flushed before the next call, so a call
 * that kills the process still leaves the earlier lines.
 *
 * The arguments the tests pass make each call fail harmlessly (EBADF, EFAULT, EINVAL,
 * ESRCH) when no filter stops it. The word "&c" as an argument passes a pointer to a char
 * 'x' (for TIOCSTI).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static char c = 'x';

static unsigned long long
arg (const char *s)
{
  if (strcmp (s, "&c") == 0)
    return (unsigned long long) (unsigned long) &c;
  return strtoull (s, NULL, 0);
}

static long
call32 (long nr, long a0, long a1, long a2, long a3, long a4, long a5)
{
#if defined(__x86_64__)
  long ret;
  register long r8 __asm__ ("r8") = a5;
  __asm__ volatile ("push %%rbp\n\t"
                    "mov %%r8d, %%ebp\n\t"
                    "int $0x80\n\t"
                    "pop %%rbp"
                    : "=a" (ret)
                    : "a" (nr), "b" (a0), "c" (a1), "d" (a2), "S" (a3), "D" (a4), "r" (r8)
                    : "memory", "cc");
  return (int) ret;
#else
  (void) nr; (void) a0; (void) a1; (void) a2; (void) a3; (void) a4; (void) a5;
  return -ENOSYS;
#endif
}

int
main (int argc, char **argv)
{
  int i, last = 0;

  if (argc < 2 || (argc - 2) % 7 != 0)
    {
      fprintf (stderr, "usage: %s 64|32|x32 NR A0 A1 A2 A3 A4 A5 ...\n", argv[0]);
      return 2;
    }
  for (i = 2; i < argc; i += 7)
    {
      long nr = (long) arg (argv[i]);
      unsigned long long a[6];
      long ret;
      int j, err = 0;

      for (j = 0; j < 6; j++)
        a[j] = arg (argv[i + 1 + j]);
      errno = 0;
      if (strcmp (argv[1], "32") == 0)
        {
          ret = call32 (nr, (long) a[0], (long) a[1], (long) a[2], (long) a[3], (long) a[4], (long) a[5]);
          if (ret < 0 && ret > -4096)
            {
              err = (int) -ret;
              ret = -1;
            }
        }
      else
        {
          if (strcmp (argv[1], "x32") == 0)
            nr |= 0x40000000L;
          ret = syscall (nr, a[0], a[1], a[2], a[3], a[4], a[5]);
          err = ret == -1 ? errno : 0;
        }
      printf ("%ld %d\n", ret, err);
      fflush (stdout);
      last = err;
    }
  return last;
}
