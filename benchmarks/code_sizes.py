import ast, pathlib, sys
root = pathlib.Path(sys.argv[1])
rows, mods = [], []
for p in sorted(root.rglob('*.py')):
    if not (str(p.relative_to(root)).startswith(('solaris_jobs', 'models'))): continue
    src = p.read_text(); mods.append((len(src.splitlines()), str(p.relative_to(root))))
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            rows.append((n.end_lineno - n.lineno + 1, f"{p.relative_to(root)}:{n.name}"))
rows.sort(reverse=True); mods.sort(reverse=True)
print("largest modules:", "; ".join(f"{m} {n}" for n, m in mods[:8]))
print("ten longest functions:", "; ".join(f"{f} {n}" for n, f in rows[:10]))
print("over 80 lines:", [f for n, f in rows if n > 80])
