"""The Kafka side of the weights: what the trainer publishes on ``sync`` (``publishers``), and what a rollout
worker or a server does with it (``follower``: which version to serve, checked, fetched and loaded; ``refusals``:
what it refused and why; ``receiver``: its membership of the trainer's weight-sync group). The transports
themselves are ``streamrft.engines.weights``, which knows no Kafka."""
