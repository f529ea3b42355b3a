"""A benchmark script's setups, each run in a process of its own.

The script runs itself with `--child KIND` and its own arguments; the child prints one
`RESULT {json}` line (`report`), which `run` reads back.
"""

import json
import subprocess
import sys

PREFIX = "RESULT "


def report(result):
    """Prints a child's result for `run` to read."""
    print(PREFIX + json.dumps(result), flush=True)


def run(script, kinds, arguments, env):
    """Runs `script --child KIND *arguments` for each kind in turn; their results, in order.

    Raises SystemExit with the child's last stderr where one fails or prints no result.
    """
    results = []
    for kind in kinds:
        done = subprocess.run([sys.executable, script, "--child", kind, *map(str, arguments)],
                              env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
        if done.returncode or not lines:
            raise SystemExit(f"the {kind} run failed (exit {done.returncode}):\n"
                             f"{done.stderr[-3000:]}")
        results.append(json.loads(lines[-1][len(PREFIX):]))
    return results
