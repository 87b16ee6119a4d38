#!/bin/sh
# The task's test command: exit 0 when every case passes; writes results.txt.
fail=0
check() {
    got=$(printf '%s\n' "$1" | sh ./wordcount.sh)
    if [ "$got" = "$2" ]; then echo "PASS $3"; else echo "FAIL $3: got '$got', want '$2'"; fail=1; fi
}
check "one two three" 3 three-words
check "" 0 empty-line
check "  padded   words  " 2 extra-spaces
check "tab	separated" 2 tab
echo "uname: $(uname -s), image: $(cat /etc/task-image 2>/dev/null || echo none)" > results.txt
exit $fail
