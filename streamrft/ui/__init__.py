"""``streamrft ui``: a read-only web UI of a run's cluster (topics, consumer groups and their lag over time,
decoded records, dead letters) and of the monitor's files (steps and evals). Served by FastAPI from this
package alone: plain HTML and inline SVG, no script, nothing fetched from elsewhere. It never writes to the
cluster: no produce, no commit, no group membership; every method but GET and HEAD is answered 405."""

DEFAULT_PORT = 8089  # beside serve mode's 8000 and kafbat's 8080 in compose/
