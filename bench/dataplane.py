"""Data-plane benchmark: what the record layer costs over raw Kafka, in the same run on the same broker.

(a) baseline: raw confluent-kafka produce + consume of opaque bytes: the encoded payloads of (b)'s records,
    encoded before the clock starts. Same bytes and the same memory footprint as (b) (by default 20,000
    distinct 8 kB payloads, cache-cold), not one small buffer reused for every record, which flatters (a);
(b) streamrft: Experience records (1,024 prompt+response tokens, 1,024 logprobs) encoded, produced through the
    client layer (idempotent producer, delivery checks), consumed read_committed through the client layer and
    decoded to numpy arrays.

Both clocks start once the consumer has its partitions (the group join is a one-off cost of a long-lived role,
and it differs: the record consumer's rebalance callbacks are served by its first poll, while the raw consumer
without callbacks is assigned in the background), and both consumers fetch while the producer runs.

Prints records/s and MB/s of each, the ratio b/a (goal >= 0.8), and encode/decode microseconds per record of the
codec: the generated code the codec uses (schemas/compiled.py) beside fastavro's generic writer and reader.
Usage: python bench/dataplane.py [--records 20000] [--rounds 3] [--bootstrap HOST:PORT]
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid
from io import BytesIO

import numpy as np
from fastavro import schemaless_reader, schemaless_writer
from rich.console import Console
from rich.table import Table

from streamrft.broker import kafka_for
from streamrft.config import TopicConfig, load_config
from streamrft.kafka import KafkaClients
from streamrft.kafka.admin import ensure_topics
from streamrft.kafka.raw import raw_consumer, raw_producer
from streamrft.schemas import Experience, RolloutKind, SingleObjectCodec, pack_f32, pack_i32, schema_json
from streamrft.schemas.codec import HEADER_SIZE, SINGLE_OBJECT_MAGIC
from streamrft.schemas.contract import parsed

console = Console()
TOKENS = 1024


def make_experience(i: int) -> Experience:
    rng = np.random.default_rng(i)
    return Experience(eid=f"req-{i}/0", group_id=f"req-{i}", task_id=f"task-{i}", step=i // 64,
                      kind=RolloutKind.TRAIN, run_index=0, model_version=1,
                      tokens=pack_i32(rng.integers(0, 49152, TOKENS, dtype=np.int32)), prompt_length=0,
                      logprobs=pack_f32(rng.standard_normal(TOKENS).astype(np.float32)), reward=1.0,
                      response_text="x" * 64)


def raw_round(config, bootstrap: str, topic: str, payloads: list[bytes]) -> float:
    producer = raw_producer(config.kafka, bootstrap)
    consumer = raw_consumer(config.kafka, bootstrap, f"raw-{uuid.uuid4().hex}")
    consumer.subscribe([topic])
    while not consumer.assignment():  # the topic is empty: nothing is read before the clock starts
        consumer.poll(0.1)
    n = len(payloads)
    start = time.perf_counter()
    for i, payload in enumerate(payloads):
        while True:
            try:
                producer.produce(topic, payload, key=f"req-{i}".encode())
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    producer.flush()
    got = 0
    while got < n:
        for msg in consumer.consume(500, 1.0):
            if msg.error() is None:
                _ = msg.value()
                got += 1
    elapsed = time.perf_counter() - start
    consumer.close()
    return elapsed


def streamrft_round(clients: KafkaClients, topic: str, records: list[Experience], group: str) -> float:
    producer = clients.producer()
    consumer = clients.consumer([topic], Experience, group)
    while not consumer.assignment():  # as in raw_round: both clocks start with partitions assigned
        early = consumer.poll(10, 0.1)
        assert not early, "the topic should be empty before the clock starts"
    start = time.perf_counter()
    for record in records:
        producer.produce(topic, record)
    producer.flush()
    got = 0
    checksum = 0
    while got < len(records):
        for item in consumer.poll(500, 1.0):
            checksum += int(item.record.token_array[0]) + int(item.record.logprob_array.size)
            got += 1
    elapsed = time.perf_counter() - start
    consumer.close()
    assert checksum > 0
    return elapsed


def codec_costs(records: list[Experience]) -> tuple[float, float]:
    """µs per record of the codec as the data plane uses it: encode, and decode to numpy arrays."""
    codec = SingleObjectCodec()
    start = time.perf_counter()
    encoded = [codec.encode(r) for r in records]
    encode_us = (time.perf_counter() - start) / len(records) * 1e6
    start = time.perf_counter()
    for data in encoded:
        record = codec.decode(data, Experience)
        record.token_array, record.logprob_array
    decode_us = (time.perf_counter() - start) / len(records) * 1e6
    return encode_us, decode_us


def fastavro_costs(records: list[Experience]) -> tuple[float, float]:
    """The same through fastavro's generic writer and reader (the codec's path before the generated code, and
    still its path for payloads of older writer schemas)."""
    codec = SingleObjectCodec()
    schema = parsed(schema_json("Experience"))
    header = SINGLE_OBJECT_MAGIC + codec.fingerprint(Experience)
    start = time.perf_counter()
    encoded = []
    for r in records:
        buf = BytesIO()
        buf.write(header)
        schemaless_writer(buf, schema, r.to_dict())
        encoded.append(buf.getvalue())
    encode_us = (time.perf_counter() - start) / len(records) * 1e6
    start = time.perf_counter()
    for data in encoded:
        record = Experience.from_dict(schemaless_reader(BytesIO(data[HEADER_SIZE:]), schema, None))
        record.token_array, record.logprob_array
    decode_us = (time.perf_counter() - start) / len(records) * 1e6
    return encode_us, decode_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bootstrap", default="", help="existing cluster (default: the embedded broker)")
    args = parser.parse_args()

    config = load_config(overrides={"name": f"bench{uuid.uuid4().hex[:6]}",
                                    "kafka": {"bootstrap_servers": args.bootstrap}})
    records = [make_experience(i) for i in range(args.records)]
    codec = SingleObjectCodec()
    payloads = [codec.encode(r) for r in records]  # (a)'s opaque bytes: (b)'s records, encoded untimed
    payload_size = len(payloads[0])
    mb = sum(map(len, payloads)) / 1e6
    with kafka_for(config) as bootstrap:
        clients = KafkaClients(config, bootstrap)
        raw_times, ours_times = [], []
        for r in range(args.rounds):
            topics = {f"{config.topic_prefix}raw{r}": TopicConfig(partitions=4),
                      f"{config.topic_prefix}exp{r}": TopicConfig(partitions=4),
                      f"{config.topic_prefix}exp{r}.dlq": TopicConfig()}
            ensure_topics(clients.admin(), topics)
            with console.status(f"round {r + 1}/{args.rounds}: raw bytes"):
                raw_times.append(raw_round(config, bootstrap, f"{config.topic_prefix}raw{r}", payloads))
            with console.status(f"round {r + 1}/{args.rounds}: Experience records"):
                ours_times.append(streamrft_round(clients, f"{config.topic_prefix}exp{r}", records,
                                                  f"{config.name}.bench{r}"))
        clients.close()
    sample = records[: min(5000, len(records))]
    encode_us, decode_us = codec_costs(sample)
    generic_encode_us, generic_decode_us = fastavro_costs(sample)

    raw, ours = statistics.median(raw_times), statistics.median(ours_times)
    table = Table(title=f"data plane: {args.records} records of {payload_size} B, median of {args.rounds} rounds")
    for column in ("path", "seconds", "records/s", "MB/s"):
        table.add_column(column, justify="right")
    table.add_row("(a) raw confluent-kafka bytes", f"{raw:.2f}", f"{args.records / raw:,.0f}", f"{mb / raw:.1f}")
    table.add_row("(b) streamrft Experience", f"{ours:.2f}", f"{args.records / ours:,.0f}", f"{mb / ours:.1f}")
    console.print(table)
    console.print(f"ratio b/a (throughput): [bold]{raw / ours:.2f}[/] (goal >= 0.8)")
    codec_table = Table(title=f"codec, µs per record ({len(sample)} Experience records)")
    for column in ("path", "encode", "decode to arrays"):
        codec_table.add_column(column, justify="right")
    codec_table.add_row("fastavro, generic", f"{generic_encode_us:.1f}", f"{generic_decode_us:.1f}")
    codec_table.add_row("generated (schemas/compiled.py)", f"{encode_us:.1f}", f"{decode_us:.1f}")
    console.print(codec_table)


if __name__ == "__main__":
    main()
