"""Write every report of the accuracy matrix and the documented examples (README, docs/) into a folder, or diff two.

Used to show that a restructuring leaves every report byte-identical:

    python scripts/report_snapshot.py record /tmp/before            # on the old commit
    python scripts/report_snapshot.py record /tmp/after             # on the new one
    python scripts/report_snapshot.py diff /tmp/before /tmp/after   # exit 0: identical, 1: lists what differs

Each job runs through the installed ``hyperdryrun`` command (``run`` and, for the accuracy rows, ``measure``), so the
script depends on no internal API. ``--quick`` skips the big-model examples (minutes each).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
"""Where the documented commands are: the README and the reference pages."""
BIG = ("llama3-405b", "deepseek-v3", "llama3-70b")


def accuracy_jobs() -> list[tuple[str, dict]]:
    from hyperdryrun.measure.accuracy import BASE, MATRIX, PIPELINE_MATRIX, merge

    return [(name, merge(BASE, over)) for name, over in [*MATRIX, *PIPELINE_MATRIX]]


def readme_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    """The ``hyperdryrun run``/``measure`` commands of the bash blocks of the README and docs/ (job.yaml examples
    excluded)."""
    text = "\n".join(page.read_text() for page in DOC_PAGES)
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("python3 -m venv") and "hyperdryrun run" in line:
                line = line[line.index(".venv/bin/hyperdryrun") + len(".venv/bin/") :]
            words = shlex.split(line) if line and not line.startswith("#") else []
            env = {}
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                k, v = words.pop(0).split("=", 1)
                env[k] = v
            if len(words) < 2 or words[0] != "hyperdryrun" or words[1] not in ("run", "measure"):
                continue
            if "--config" in words or any((words[1:], env) == (argv, e) for _, argv, e in out):
                continue  # a job file, or a command another page shows too
            out.append((f"readme-{len(out):02d}", words[1:], env))
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def _hyperdryrun() -> str:
    exe = Path(sys.executable).with_name("hyperdryrun")
    return str(exe) if exe.exists() else "hyperdryrun"


def _run(argv: list[str], env: dict[str, str], log: Path) -> int:
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    full_env.update(env)
    proc = subprocess.run([_hyperdryrun(), *argv], env=full_env, capture_output=True, text=True)
    log.write_text(f"$ {shlex.join(argv)}\nexit {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return proc.returncode


def record(out: Path, quick: bool) -> int:
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    for name, data in accuracy_jobs():
        d = out / _slug(name)
        d.mkdir(exist_ok=True)
        (d / "job.yaml").write_text(yaml.safe_dump(data, sort_keys=True))
        for cmd in ("run", "measure"):
            rc = _run([cmd, "--config", str(d / "job.yaml"), "--output-dir", str(d / cmd), "--quiet"], {},
                      d / f"{cmd}.log")  # fmt: skip
            print(f"{cmd:7s} exit {rc}  {name}", flush=True)
    for name, argv, env in readme_commands():
        if quick and any(b in argv for b in BIG):
            continue
        d = out / name
        d.mkdir(exist_ok=True)
        rc = _run([*argv, "--output-dir", str(d / "out")], env, d / "cmd.log")
        print(f"{argv[0]:7s} exit {rc}  {name}: {shlex.join(argv)}", flush=True)
    return 0


def _reports(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.suffix in (".json", ".csv") and p.is_file()}


def _how(a: Path, b: Path) -> str:
    """For two CSVs with the same rows and header: which columns differ, and how (at most 3 value pairs each)."""
    import csv

    if a.suffix != ".csv":
        return ""
    ra, rb = list(csv.reader(a.open())), list(csv.reader(b.open()))
    if len(ra) != len(rb) or not ra or ra[0] != rb[0]:
        return f" ({len(ra)} vs {len(rb)} rows)"
    cols: dict[str, set[tuple[str, str]]] = {}
    for x, y in zip(ra[1:], rb[1:]):
        for name, u, v in zip(ra[0], x, y):
            if u != v:
                cols.setdefault(name, set()).add((u, v))
    return "".join(
        f"\n    column {c}: " + "; ".join(f"{u!r} -> {v!r}" for u, v in sorted(d)[:3])
        for c, d in cols.items()
    )


def diff(a: Path, b: Path) -> int:
    ra, rb = _reports(a), _reports(b)
    problems = [f"only in {a}: {p}" for p in sorted(ra - rb)] + [f"only in {b}: {p}" for p in sorted(rb - ra)]
    for p in sorted(ra & rb):
        if not filecmp.cmp(a / p, b / p, shallow=False):
            problems.append(f"differs: {p}{_how(a / p, b / p)}")
    for p in sorted(ra & rb):
        if p.suffix == ".json" and json.loads((a / p).read_text()).get("status") == "error":
            problems.append(f"error report: {p}")
    for line in problems:
        print(line)
    print(f"{len(ra & rb)} reports compared, {len(problems)} problems")
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--quick", action="store_true", help="skip the big-model examples of the docs")
    d = sub.add_parser("diff")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    args = ap.parse_args()
    return record(args.out, args.quick) if args.cmd == "record" else diff(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
