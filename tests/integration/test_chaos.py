"""Chaos, the short version of ``bench/chaos.py`` (the same code, loaded from that file): 8 steps, 2 rollout
workers, one SIGKILL of a worker, of the explorer and of the trainer, and one broker restart, then the run's
invariants (see the bench's docstring); and on a 3-node cluster, one SIGKILL of a worker and one of a broker (the
transaction coordinator of a worker), the same checks. The harness starts brokers of its own (it must restart
them on the same data dir), so it ignores KAFKA_BOOTSTRAP. A test shows that the checks catch what they claim to
catch."""
from __future__ import annotations

import dataclasses

import pytest

from .chaos_harness import chaos_module

pytestmark = [pytest.mark.kafka, pytest.mark.model, pytest.mark.slow]

STEPS = 8


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    chaos = chaos_module()
    # one round: a worker, the explorer and the trainer killed once each (seeded order), the broker restarted
    settings = chaos.ChaosSettings(out=tmp_path_factory.mktemp("chaos") / "run", seed=7, steps=STEPS, workers=2,
                                   kill_every_s=4.0, rounds=1, tail_steps=2, fake_latency_s=0.3, stall_s=120,
                                   timeout_s=420)
    return chaos.run_chaos(settings)


def test_a_run_under_chaos_loses_and_doubles_nothing(outcome):
    chaos, verdict = outcome.chaos, outcome.verdict
    assert chaos.finished, f"{chaos.aborted}\n" + "\n".join(chaos.events + chaos.stacks)
    # the chaos really happened (else the invariants below prove little)
    assert {role: chaos.kills[role] >= 1 for role in ("worker", "explorer", "trainer")} == {
        "worker": True, "explorer": True, "trainer": True}, chaos.events
    assert chaos.broker_restarts == 1, chaos.events
    assert verdict.violations == {}, "\n".join(chaos.events)
    figures = verdict.figures
    assert figures["duplicates"] == 0 and figures["lost"] == 0
    assert figures["tasks"] == figures["requests"] == STEPS * 4
    assert figures["trained"] + figures["dropped stale (audit)"] + figures["dropped, dead-lettered"] + figures[
        "dropped, counted only"] == figures["experiences"]


@pytest.fixture(scope="module")
def cluster_outcome(tmp_path_factory):
    chaos = chaos_module()
    # one round: a worker SIGKILLed, then (once the loop is settled) the transaction coordinator of a live worker
    settings = chaos.ChaosSettings(out=tmp_path_factory.mktemp("chaos-cluster") / "run", seed=7, steps=10,
                                   workers=2, kill_every_s=4.0, rounds=1, tail_steps=2, fake_latency_s=0.3,
                                   stall_s=120, timeout_s=420, nodes=3, role_deck=("worker",),
                                   broker_deck=("coordinator",))
    return chaos.run_chaos(settings)


def test_a_run_on_a_cluster_loses_and_doubles_nothing_when_a_broker_dies(cluster_outcome):
    chaos, verdict = cluster_outcome.chaos, cluster_outcome.verdict
    assert chaos.finished, f"{chaos.aborted}\n" + "\n".join(chaos.events + chaos.stacks)
    assert (chaos.kills["worker"], chaos.kills["broker"]) == (1, 1), chaos.events
    [action] = chaos.broker_actions
    assert action.name == "coordinator" and action.healed is not None, chaos.events
    assert chaos.crashes == [], [(c.role, c.tail) for c in chaos.crashes]  # every role rode the failover out
    assert verdict.violations == {}, "\n".join(chaos.events)
    figures = verdict.figures
    assert figures["duplicates"] == 0 and figures["lost"] == 0
    assert figures["tasks"] == figures["requests"] == 10 * 4
    assert figures["trained"] + figures["dropped stale (audit)"] + figures["dropped, dead-lettered"] + figures[
        "dropped, counted only"] == figures["experiences"]
    # what the failover cost the loop was measured (results kept arriving, or the gap is known)
    assert action.loop_stall_s is not None and action.loop_stall_s < 60, action


def test_the_checks_catch_doubles_and_losses(outcome):
    """The same records with one fault injected each: the checker must name it (a test that cannot fail is
    worse than none)."""
    chaos = chaos_module()
    observed = outcome.observed
    lifetimes = outcome.chaos.trainer_lifetimes
    first = observed.experiences[0]
    result = next(r for r in observed.results if r.status.value == "OK")
    entry = observed.audit[-1]
    faults = {
        "eid twice on experiences": dataclasses.replace(observed, experiences=observed.experiences + [first]),
        "request without result or count": dataclasses.replace(
            observed, results=[r for r in observed.results if r is not result]),
        "OK result missing experiences": dataclasses.replace(
            observed, experiences=[e for e in observed.experiences if e is not first]),
        "eid twice in the final audit": dataclasses.replace(
            observed, audit=observed.audit + [{**entry, "version": entry["version"] + 1, "step": entry["step"] + 1}]),
        "experience neither trained nor counted as dropped": dataclasses.replace(observed, audit=observed.audit[:-1]),
        "task never rolled out": dataclasses.replace(
            observed, requests=[r for r in observed.requests if r.task.task_id != result.task_id]),
    }
    for invariant, faulty in faults.items():
        verdict = chaos.check(faulty, lifetimes, STEPS)
        assert invariant in verdict.violations, (invariant, verdict.violations)
    # a committed step of an earlier trainer lifetime that the final lineage does not hold
    forged = chaos.TrainerLifetime(99, "killed", [{**entry, "eids": ["forged/0"]}], entry["version"])
    verdict = chaos.check(observed, [*lifetimes, forged], STEPS)
    assert "committed audit entry lost" in verdict.violations
