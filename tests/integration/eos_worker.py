"""A consume -> produce -> commit process for the exactly-once test (run as a subprocess so it can be SIGKILLed).

Reads Tasks from IN, writes one Metric per Task to OUT, in transactions with the consumed offsets. With
--crash-after-produce it kills itself with SIGKILL after its first transaction's records reached the broker
but before the commit.
"""
from __future__ import annotations

import argparse
import os
import signal

from streamrft.config import load_config
from streamrft.kafka import KafkaClients, Transactor
from streamrft.schemas import Metric, Task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bootstrap")
    parser.add_argument("run")
    parser.add_argument("in_topic")
    parser.add_argument("out_topic")
    parser.add_argument("expected", type=int)
    parser.add_argument("--crash-after-produce", action="store_true")
    args = parser.parse_args()

    config = load_config(overrides={"name": args.run, "kafka": {"bootstrap_servers": args.bootstrap}}, env={})
    clients = KafkaClients(config, args.bootstrap)
    consumer = clients.consumer([args.in_topic], Task, config.consumer_group("eos"))
    # A stable transactional.id: a restarted instance fences the killed one and aborts its open transaction.
    producer = clients.producer(transactional_id=f"{config.name}.eos-0")
    transactor = Transactor(producer, consumer)
    done = 0
    while done < args.expected:
        batch = consumer.poll(max_records=50, timeout=1.0)
        if not batch:
            continue

        def produce(p, batch=batch):
            for item in batch:
                p.produce(args.out_topic, Metric(source=item.record.task_id, role="eos", name="done", value=1.0,
                                                 step=item.offset))
            if args.crash_after_produce:
                p.raw.flush(10)  # the records are on the broker, inside the open transaction
                print("CRASHING", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        transactor.run(produce)  # raises when it cannot commit; abortable errors retry the same unit
        done += len(batch)
    consumer.close()
    print(f"DONE {done}", flush=True)


if __name__ == "__main__":
    main()
