"""Mutation check of the Lua commit script (RECORD: genq/core/scripts/record.lua), run by `make mutation`.

mutmut mutates Python only, so the logic that decides what is stored and counted would go
unchecked. Each mutant below is one hand-written change of that Lua, applied to a copy of the
tree; tests/test_commit.py must fail on every one. Usage: python tests/lua_mutants.py COPY_DIR  (exits 1 if any survives).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MUTANTS = [
    ("a result stored over one already there (the first writer loses)",
     "if has_result[k] then over[ids[k]] = 'result' end", ""),
    ("results stored whatever is there (a second write replaces the first, counted again)",
     "  if not over[rs[i]] then", "  if true then"),
    ("stored letters not looked at (a result and a letter for one prompt)",
     "if has_letter[k] then over[ids[k]] = 'letter' end", ""),
    ("no done-batch guard (late writes after the shard)",
     "if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return {-1, -1} end", ""),
    ("letter without the has-an-outcome check", "  if not over[ds[i]] then", "  if true then"),
    ("a result of this call does not exclude a later one of the same call",
     "    over[rs[i]] = 'result'\n", ""),
    ("letters not counted", "dead = dead + 1", "dead = dead + 0"),
    ("input tokens read from the output field", "intok = intok + tonumber(rs[i + 2])",
     "intok = intok + tonumber(rs[i + 3])"),
    ("output tokens read from the input field", "outtok = outtok + tonumber(rs[i + 3])",
     "outtok = outtok + tonumber(rs[i + 2])"),
    ("histogram counts 2", "buckets[bucket] = (buckets[bucket] or 0) + 1", "buckets[bucket] = (buckets[bucket] or 0) + 2"),
    ("a write of letters only updates no counter", "if added > 0 or dead > 0 then", "if added > 0 then"),
    ("counters written even when nothing was stored", "if added > 0 or dead > 0 then", "if true then"),
    ("done counts letters too", "redis.call('HINCRBY', KEYS[3], 'done', added)",
     "redis.call('HINCRBY', KEYS[3], 'done', added + dead)"),
    ("worker not added to the job's workers", "redis.call('SADD', KEYS[6], ARGV[2])", ""),
]


def main(copy_dir: str) -> int:
    root = Path(copy_dir)
    target = root / "genq/core/scripts/record.lua"
    original = target.read_text()
    survived = []
    try:
        for name, old, new in MUTANTS:
            assert original.count(old) == 1, f"mutant {name!r}: {old!r} is not in {target} exactly once"
            target.write_text(original.replace(old, new))
            run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                  "tests/test_commit.py"], cwd=root, capture_output=True, text=True, timeout=600)
            verdict = "killed" if run.returncode != 0 else "SURVIVED"
            if run.returncode == 0:
                survived.append(name)
            print(f"    lua: {verdict:8} {name}", flush=True)
    finally:
        target.write_text(original)
    print(f"lua mutation score {len(MUTANTS) - len(survived)}/{len(MUTANTS)}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
