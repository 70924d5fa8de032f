package io.streamrft.interop;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericDatumWriter;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.BinaryEncoder;
import org.apache.avro.io.EncoderFactory;
import org.apache.avro.message.BinaryMessageEncoder;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * Writes one bad task (if asked for), then {@code count} arithmetic tasks, in that order, with the Kafka
 * client's defaults (an idempotent producer, acks=all). Without a registry the value is Avro's single-object
 * encoding ({@link BinaryMessageEncoder}); with one, the Confluent wire format of the Task schema registered
 * under {@code <topic>-value}.
 */
final class Produce {
    private Produce() {
    }

    static Map<String, Object> run(Map<String, String> args) throws Exception {
        String topic = Main.required(args, "topic");
        String prefix = args.getOrDefault("prefix", "java");
        int count = Integer.parseInt(args.getOrDefault("count", "2"));
        String bad = args.getOrDefault("bad", "");
        Contract.Entry task = new Contract(Path.of(Main.required(args, "contract"))).entry("Task");
        String registryUrl = args.getOrDefault("registry", "");
        Map<String, Object> out = new LinkedHashMap<>();
        Encoder encoder;
        if (registryUrl.isEmpty()) {
            encoder = singleObject(task);
            out.put("framing", "single-object");
        } else {
            int id = new SchemaRegistry(registryUrl).register(topic + "-value", task.json());
            encoder = confluent(task, id);
            out.put("framing", "confluent");
            out.put("schema_id", id);
        }
        List<ProducerRecord<String, byte[]>> records = new ArrayList<>();
        if (!bad.isEmpty()) {
            GenericRecord record = badTask(task, prefix + "-bad", bad);
            records.add(new ProducerRecord<>(topic, prefix + "-bad", encoder.encode(record)));
            out.put("bad", bad);
            out.put("bad_task_id", prefix + "-bad");
        }
        List<String> ids = new ArrayList<>();
        for (int i = 0; i < count; i++) {
            int a = 4 * i + 1;
            int b = i + 5;
            String payload = Main.JSON.writeValueAsString(
                    Map.of("question", "What is " + a + " + " + b + "?", "answer", a + b));
            GenericRecord record = task(task, prefix + "-" + i, "arithmetic", payload);
            records.add(new ProducerRecord<>(topic, prefix + "-" + i, encoder.encode(record)));
            ids.add(prefix + "-" + i);
        }
        out.put("task_ids", ids);

        Properties props = new Properties();
        props.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, Main.required(args, "bootstrap"));
        try (KafkaProducer<String, byte[]> producer = new KafkaProducer<>(props, new StringSerializer(),
                new ByteArraySerializer())) {
            for (ProducerRecord<String, byte[]> record : records) {
                producer.send(record).get();  // one at a time: the bad task first, then the good ones in order
            }
        }
        return out;
    }

    interface Encoder {
        byte[] encode(GenericRecord record) throws IOException;
    }

    private static Encoder singleObject(Contract.Entry task) {
        BinaryMessageEncoder<GenericRecord> encoder = new BinaryMessageEncoder<>(GenericData.get(), task.schema());
        return record -> {
            ByteBuffer buffer = encoder.encode(record);
            byte[] value = new byte[buffer.remaining()];
            buffer.get(value);
            return value;
        };
    }

    private static Encoder confluent(Contract.Entry task, int id) {
        GenericDatumWriter<GenericRecord> writer = new GenericDatumWriter<>(task.schema());
        return record -> {
            ByteArrayOutputStream body = new ByteArrayOutputStream();
            BinaryEncoder encoder = EncoderFactory.get().directBinaryEncoder(body, null);
            writer.write(record, encoder);
            encoder.flush();
            return SchemaRegistry.frame(id, body.toByteArray());
        };
    }

    private static GenericRecord task(Contract.Entry task, String id, String workflow, String payload) {
        GenericRecord record = new GenericData.Record(task.schema());
        record.put("task_id", id);
        record.put("taskset", "interop");
        record.put("workflow", workflow);
        record.put("payload", payload);
        record.put("reward_fn", null);
        record.put("repeat_times", null);
        record.put("created_at", System.currentTimeMillis());
        return record;
    }

    /** A task the explorer must dead-letter: one that names no workflow, or asks for zero samples. */
    private static GenericRecord badTask(Contract.Entry task, String id, String kind) {
        String payload = "{\"question\": \"1 + 1\", \"answer\": 2}";
        switch (kind) {
            case "empty-workflow":
                return task(task, id, "", payload);
            case "zero-repeat-times":
                GenericRecord record = task(task, id, "arithmetic", payload);
                record.put("repeat_times", 0);
                return record;
            default:
                throw new IllegalArgumentException(
                        "unknown bad task " + kind + ": use empty-workflow or zero-repeat-times");
        }
    }
}
