"""What `keras-multigpu launch` says when a process fails: which rank to blame, and how.

A process whose peer died, left or hung fails too, waiting for it (a `CollectiveError`,
gloo's closed connection), and may be seen first; the rank named is the cause.
"""

import contextlib
import math
import signal
import time

# What a process prints when it fails because another one did.
SECONDARY = ("CollectiveError", "Connection closed by peer", "Connection reset by peer")


def signal_name(code):
    with contextlib.suppress(ValueError):
        return signal.Signals(-code).name
    return f"signal {-code}"


def describe_exit(code):
    return f"was killed by {signal_name(code)}" if code < 0 else f"exited with status {code}"


def root_cause(ranks, first):
    """`(rank, how)`: the process to blame for `first`'s failure, and `"failed"` (it failed
    itself), `"left"` (it exited with status 0, and the others failed waiting for it) or
    `"running"` (still running, the others failed waiting for it: it hangs, or lags far).

    Among the processes failed within a second of `first`, one that did not fail for a peer
    is chosen. When every failure is for a peer, one that left with status 0 (a
    `sys.exit(0)` in the middle of the program) is the cause, or else the one process
    still running (of this machine's: a peer on another machine is not seen here).
    """
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(r.process.poll() is None for r in ranks):
        time.sleep(0.05)
    for reader in first.readers:
        reader.join(timeout=1)
    failed = [r for r in ranks if r.process.poll() not in (None, 0)]
    for rank in failed:
        for reader in rank.readers:
            reader.join(timeout=1)
        if _peer_error(rank) is None:
            return rank, "failed"
    early = [r for r in ranks if r.process.poll() == 0]
    if early:
        return min(early, key=lambda r: r.ended_at or math.inf), "left"
    running = [r for r in ranks if r.process.poll() is None]
    if len(running) == 1 and _peer_error(first) is not None:
        return running[0], "running"
    return first, "failed"  # (several still running: any of them may be the one)


def report(blamed, how, first, world, stopped):
    """`(message, exit status)` for a group that `blamed` ended (`root_cause`'s `how`)."""
    lines = "\n".join(f"    {line}" for line in blamed.tail) or "    (it printed nothing)"
    code = blamed.process.returncode
    if how == "failed":
        said = describe_exit(code)
    else:
        said = (f"exited with status 0 while the others still ran, and rank {first.rank} then "
                "failed waiting for it (every process must run the whole program)"
                if how == "left" else
                f"was still running when rank {first.rank} failed waiting for it (stuck, in a "
                "hang or a deadlock, or far behind the others); rank "
                f"{first.rank}'s error: {_peer_error(first)}")
        code = first.process.returncode
    message = (f"keras-multigpu launch: rank {blamed.rank} of {world} {said}. "
               f"Its last lines:\n{lines}\n")
    if stopped:
        message += f"keras-multigpu launch: stopped rank(s) {stopped}.\n"
    return message, (code if code > 0 else 128 - code)


def _peer_error(rank):
    """The last line of `rank`'s tail that says it failed for a peer, or None."""
    for line in reversed(rank.tail):
        if any(marker in line for marker in SECONDARY):
            return line.strip()
    return None
