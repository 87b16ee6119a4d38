"""Source of the two programs the smolagents executor runs inside the sandbox (stdlib only).

``KERNEL`` is a persistent CPython interpreter (one background command of the session): it
listens on an abstract unix socket (abstract names belong to the sandbox's own network
namespace: nothing outside can reach it) and executes each request in one namespace that
persists between steps, with ``print`` output captured. ``CLIENT`` is one command per step: it
forwards the step (stdin) to the kernel and prints the kernel's JSON answer (stdout).

Request (JSON): ``{"code": str, "check_imports": bool, "max_logs": int}``.
Answer (JSON): ``{"logs": str, "output": {"json": value} | {"repr": str} | null,
"final": str | null, "error": str | null, "error_type": str | null}``.
"""

KERNEL = r'''
import ast, builtins, contextlib, io, json, linecache, socket, struct, sys, traceback
name, authorized = sys.argv[1], json.loads(sys.argv[2])
missing = []
for imp in authorized:
    base = imp.split(".")[0]
    if base != "*":
        import importlib.util
        if importlib.util.find_spec(base) is None:
            missing.append(base)
ns = {"__name__": "__main__"}
tree = {}
for imp in authorized:
    node = tree
    for part in imp.split("."):
        node = node.setdefault(part, {})
def allowed(mod):
    node = tree
    for part in mod.split("."):
        if "*" in node:
            return True
        if part not in node:
            return False
        node = node[part]
    return True
real_import = builtins.__import__
def guarded_import(mod, globals=None, locals=None, fromlist=(), level=0):
    caller = sys._getframe(1).f_code.co_filename
    if level == 0 and caller.startswith("<step") and not allowed(mod):
        kind = "from" if fromlist else "of"
        raise ImportError(f"Import {kind} {mod} is not allowed. Authorized imports are: {sorted(authorized)}")
    return real_import(mod, globals, locals, fromlist, level)
ns_builtins = dict(vars(builtins))
ns_builtins["__import__"] = guarded_import
ns["__builtins__"] = ns_builtins
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\0" + name)
srv.listen(4)
print(json.dumps({"ready": True, "missing": missing}), flush=True)
step = 0
def recvn(conn, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)
def encode(value):
    try:
        json.dumps(value, allow_nan=False)
        return {"json": value}
    except (TypeError, ValueError):
        pass
    try:
        return {"repr": repr(value)[:1000000]}
    except Exception as e:
        return {"repr": f"<unrepresentable {type(value).__name__}: {e}>"}
def run(req):
    global step
    step += 1
    code = req["code"]
    filename = f"<step{step}>" if req["check_imports"] else f"<setup{step}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    out = io.StringIO()
    answer = {"logs": "", "output": None, "final": None, "error": None, "error_type": None}
    try:
        tree_ = ast.parse(code, filename)
    except SyntaxError as e:
        answer["error"] = (f"Code parsing failed on line {e.lineno} due to: {type(e).__name__}: {e}\n"
                           f"{e.text or ''}{' ' * (e.offset or 0)}^")
        answer["error_type"] = "SyntaxError"
        return answer
    if not req["check_imports"]:
        # Setup code (tool sources) hoists the optional imports of a tool's methods (smolagents'
        # final_answer patch: numpy, PIL) to the top: a missing one must not fail the setup; the
        # method's own guarded import decides at call time.
        body = []
        for node in tree_.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                handler = ast.ExceptHandler(ast.Name("ImportError", ast.Load()), None, [ast.Pass()])
                node = ast.copy_location(ast.Try([node], [handler], [], []), node)
            body.append(node)
        tree_.body = body
        ast.fix_missing_locations(tree_)
    last = tree_.body[-1] if tree_.body else None
    value_expr = None
    if isinstance(last, ast.Expr):
        tree_.body.pop()
        value_expr = ast.Expression(last.value)
    elif isinstance(last, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = last.targets if isinstance(last, ast.Assign) else [last.target]
        if len(targets) == 1 and isinstance(targets[0], ast.Name):
            value_expr = ast.Expression(ast.Name(targets[0].id, ast.Load()))
            ast.copy_location(value_expr.body, last)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(tree_, filename, "exec"), ns)
            if value_expr is not None:
                answer["output"] = encode(eval(compile(ast.fix_missing_locations(value_expr), filename, "eval"), ns))
    except BaseException as e:
        if type(e).__name__ == "FinalAnswerException":
            answer["final"] = str(getattr(e, "value", ""))
        else:
            line = ""
            for frame in reversed(traceback.extract_tb(e.__traceback__)):
                if frame.filename == filename:
                    line = (frame.line or "").strip()
                    break
            answer["error"] = f"Code execution failed at line '{line}' due to: {type(e).__name__}: {e}"
            answer["error_type"] = type(e).__name__
    logs = out.getvalue()
    cap = int(req.get("max_logs") or 50000)
    if len(logs) > 2 * cap:
        logs = logs[:cap] + "\n..._This content has been truncated_...\n" + logs[-cap:]
    answer["logs"] = logs
    return answer
while True:
    conn, _ = srv.accept()
    try:
        req = json.loads(recvn(conn, struct.unpack("!Q", recvn(conn, 8))[0]))
        data = json.dumps(run(req)).encode()
        conn.sendall(struct.pack("!Q", len(data)) + data)
    except (EOFError, OSError, ValueError):
        pass
    finally:
        conn.close()
'''

CLIENT = r'''
import socket, struct, sys
req = sys.stdin.buffer.read()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])
s.sendall(struct.pack("!Q", len(req)) + req)
def recvn(n):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            sys.exit("kernel closed the connection")
        buf += chunk
    return bytes(buf)
sys.stdout.buffer.write(recvn(struct.unpack("!Q", recvn(8))[0]))
'''
