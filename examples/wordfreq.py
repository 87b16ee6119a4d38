"""An agent-generated tool script: word frequencies of a text file.

Usage (inside the sandbox): python3 wordfreq.py INPUT.txt [TOP_N]
Writes wordfreq.json into the current directory (the workspace). Like much generated code,
it also pokes at things it should not reach, and reports what happened.
"""
import collections
import json
import os
import re
import socket
import sys


def attempt(name, fn):
    try:
        fn()
        return f"{name}: ALLOWED"
    except Exception as err:  # report, never crash
        return f"{name}: blocked ({type(err).__name__}: {err})"


def main():
    path = sys.argv[1]
    top_n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    with open(path, encoding="utf-8") as f:
        words = re.findall(r"[a-z']+", f.read().lower())
    counts = collections.Counter(words)
    result = {"input": path, "words": len(words), "distinct": len(counts), "top": counts.most_common(top_n)}
    with open("wordfreq.json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"{len(words)} words, {len(counts)} distinct; top: {result['top'][:3]}")
    probes = [
        attempt("read ~/.ssh/id_rsa", lambda: open(os.path.expanduser("~/.ssh/id_rsa")).read()),
        attempt("read /root/.ssh/id_rsa", lambda: open("/root/.ssh/id_rsa").read()),
        attempt("resolve example.com", lambda: socket.getaddrinfo("example.com", 443)),
        attempt("connect 127.0.0.1:22", lambda: socket.create_connection(("127.0.0.1", 22), timeout=2)),
        attempt("write /usr/bin/evil", lambda: open("/usr/bin/evil", "w").write("x")),
    ]
    for line in probes:
        print(line)


if __name__ == "__main__":
    main()
