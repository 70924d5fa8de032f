"""The rollout worker's ledger of done requests: commit points and their metadata (no broker)."""
from streamrft.consumers.rollout.ledger import MAX_DONE_AHEAD, RequestLedger, decode_done, encode_done

P = ("rft.x.rollouts", 0)


def test_a_commit_stops_at_the_lowest_unfinished_request_and_lists_the_done_ones_above_it():
    ledger = RequestLedger()
    ledger.load(P, -1, "")
    for offset in range(5):
        assert ledger.admit(P, offset)
    ledger.finish(P, 1)
    ledger.finish(P, 3)
    assert ledger.commit_points() == {P: (0, "done:1,3")}
    ledger.finish(P, 0)
    points = ledger.commit_points()
    assert points == {P: (2, "done:1")}  # 0 and 1 are below the point now; 3 is still listed
    ledger.committed(points)
    ledger.finish(P, 2)
    ledger.finish(P, 4)
    assert ledger.commit_points() == {P: (5, "done:")}


def test_the_next_reader_skips_exactly_what_a_commit_says_is_done():
    first = RequestLedger()
    first.load(P, 10, "")
    for offset in (10, 11, 12, 13):
        first.admit(P, offset)
    first.finish(P, 12)
    first.finish(P, 11)
    offset, metadata = first.commit_points()[P]

    second = RequestLedger()
    second.load(P, offset, metadata)
    assert [o for o in (10, 11, 12, 13) if second.admit(P, o)] == [10, 13]
    second.finish(P, 10)
    assert second.commit_points() == {P: (13, "done:")}


def test_records_the_consumer_dead_lettered_are_covered_by_the_commit():
    ledger = RequestLedger()
    ledger.load(P, 0, "")
    ledger.admit(P, 0)
    ledger.saw({P: 3})  # offsets 1 and 2 went to the DLQ at the edge
    ledger.finish(P, 0)
    assert ledger.commit_points()[P][0] == 3


def test_metadata_of_another_tool_lists_nothing_and_the_window_has_a_bound():
    assert decode_done(7, "committed by kafka-consumer-groups") == set()
    assert decode_done(7, encode_done(7, {9, 12})) == {9, 12}
    ledger = RequestLedger()
    ledger.load(P, 0, "")
    for offset in range(MAX_DONE_AHEAD + 1):
        ledger.admit(P, offset)
    for offset in range(1, MAX_DONE_AHEAD + 1):
        ledger.finish(P, offset)
    assert ledger.full(P)
    assert len(ledger.commit_points()[P][1]) < 4096  # the broker's offset.metadata.max.bytes default
    ledger.forget({P})
    assert not ledger.knows(P) and not ledger.full(P)

