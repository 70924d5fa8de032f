"""``streamrft run``: the whole loop on one machine — broker, topics, tasks, every role as its own process,
and a live dashboard."""
