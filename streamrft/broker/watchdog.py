"""No JVM outlives its owner: the broker's nodes, the embedded schema registry and s3proxy run under a watchdog.

``watched(name, cmd)`` runs ``cmd`` (exec keeps its pid) with a background subshell that blocks reading a pipe held
by the owning Python process (start it with ``stdin=subprocess.PIPE``; close that pipe to stop it). At EOF (the
owner closed it, or died) the subshell SIGTERMs the process, SIGKILLs it after 30 s, and removes $STREAMRFT_RMDIR
if set; it says so on the process's stderr. fd 3 because a background job's own stdin is /dev/null in a
non-interactive sh.
"""
from __future__ import annotations

WATCHDOG = r"""exec 3<&0
(
  read _ <&3
  echo "streamrft watchdog: the owner of $0 closed its pipe or exited; stopping it (pid $$)" >&2
  kill -TERM $$ 2>/dev/null
  i=0; while kill -0 $$ 2>/dev/null && [ $i -lt 150 ]; do sleep 0.2; i=$((i+1)); done
  kill -KILL $$ 2>/dev/null
  if [ -n "$STREAMRFT_RMDIR" ]; then rm -rf "$STREAMRFT_RMDIR"; fi
) &
exec 3<&- </dev/null
exec "$@"
"""


def watched(name: str, cmd: list[str]) -> list[str]:
    """The command line that runs ``cmd`` under the watchdog; ``name`` is what its messages call it."""
    return ["/bin/sh", "-c", WATCHDOG, name, *cmd]
