"""Mutation check of the Lua commit script (RECORD: genq/core/scripts/record.lua), run by `make mutation`.

mutmut mutates Python only, so the logic that decides what is stored and counted would go
unchecked. Each mutant below is one hand-written change of that Lua, applied to a copy of the
tree; tests/test_commit.py must fail on every one.
Usage: python tests/lua_mutants.py COPY_DIR  (exits 1 if any survives).
PLANTS are bugs planted in the ledger's scripts for the model test (tests/test_ledger_model.py):
`python tests/lua_mutants.py --model` prints the shrunk failure of each.
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
    ("histogram counts 2", "buckets[bucket] = (buckets[bucket] or 0) + 1",
     "buckets[bucket] = (buckets[bucket] or 0) + 2"),
    ("a write of letters only updates no counter", "if added > 0 or dead > 0 then", "if added > 0 then"),
    ("counters written even when nothing was stored", "if added > 0 or dead > 0 then", "if true then"),
    ("done counts letters too", "redis.call('HINCRBY', KEYS[3], 'done', added)",
     "redis.call('HINCRBY', KEYS[3], 'done', added + dead)"),
    ("worker not added to the job's workers", "redis.call('SADD', KEYS[6], ARGV[2])", ""),
]


# Bugs planted in the ledger's scripts: tests/test_ledger_model.py must fail on each
# (test_each_planted_bug_is_caught). (what it breaks, script, its text, the planted text)
PLANTS = [
    ("a RECORD that lets a second writer win", "RECORD",
     "if has_result[k] then over[ids[k]] = 'result' end", ""),
    ("a RELEASE without the shard check", "RELEASE",
     "if not same_outcomes() then return 'short' end", ""),
    ("a CLAIM that ignores the current lease", "CLAIM",
     "if lease ~= ARGV[6] or not incarnation_ok(KEYS[6], ARGV[5]) then return 'stale' end",
     "if not lease or not incarnation_ok(KEYS[6], ARGV[5]) then return 'stale' end"),
]


def planted(plant: tuple[str, str, str, str]) -> str:
    """The script's text (genq.core.scripts) with the bug planted."""
    from genq.core import scripts

    name, script, old, new = plant
    text = getattr(scripts, script)
    assert text.count(old) == 1, f"plant {name!r}: {old!r} is not in {script} exactly once"
    return text.replace(old, new)


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


def model_plants() -> int:
    """Each PLANTS bug run through the model test with shrinking: prints the failure Hypothesis
    found for it; exits 1 if the model misses one."""
    from hypothesis import settings

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from the checkout
    from tests.test_ledger_model import MODEL, Broken, run_model

    missed = []
    for plant in PLANTS:
        try:
            run_model({plant[1]: planted(plant)}, settings(MODEL, max_examples=200))
        except (Broken, ExceptionGroup) as exc:
            steps = "\n".join(note for e in [exc, *getattr(exc, "exceptions", [])]
                              for note in getattr(e, "__notes__", []))
            print(f"    model: caught   {plant[0]}\n{exc}\n{steps}", flush=True)
        else:
            missed.append(plant[0])
            print(f"    model: MISSED   {plant[0]}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(model_plants() if sys.argv[1:] == ["--model"] else main(sys.argv[1]))
