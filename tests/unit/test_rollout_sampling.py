"""Seeded rollouts: each request's own seed (no broker)."""

def test_a_seeded_run_gives_each_request_its_own_seed_whoever_runs_it():
    from streamrft.consumers.rollout import request_sampling
    from streamrft.engines.inference import SamplingParams

    base = SamplingParams(max_tokens=4)
    assert request_sampling(base, None, "r1") is base
    seeds = {request_sampling(base, 0, f"r{i}").seed for i in range(100)}
    assert len(seeds) == 100 and all(s % 256 == 0 for s in seeds)  # distinct, with room for the sample index
    assert request_sampling(base, 0, "r1") == request_sampling(base, 0, "r1") != request_sampling(base, 1, "r1")
