package io.streamrft.interop;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.TreeMap;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.DecoderFactory;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * Reads a run's results and experiences from the beginning with isolation.level=read_committed (the client's
 * default, read_uncommitted, would hand over what a role's aborted transactions wrote), until it has the
 * counts asked for and then one more second, so that records beyond them are seen too.
 */
final class Consume {
    private Consume() {
    }

    static Map<String, Object> run(Map<String, String> args) throws Exception {
        Contract contract = new Contract(Path.of(Main.required(args, "contract")));
        String resultsTopic = Main.required(args, "results");
        String experiencesTopic = Main.required(args, "experiences");
        int wantResults = Integer.parseInt(args.getOrDefault("want-results", "1"));
        int wantExperiences = Integer.parseInt(args.getOrDefault("want-experiences", "1"));
        String registryUrl = args.getOrDefault("registry", "");
        Reader results = new Reader(contract.entry("RolloutResult"), registryUrl);
        Reader experiences = new Reader(contract.entry("Experience"), registryUrl);

        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, Main.required(args, "bootstrap"));
        props.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        Map<String, Integer> framings = new TreeMap<>();
        List<Map<String, Object>> resultRows = new ArrayList<>();
        List<Map<String, Object>> experienceRows = new ArrayList<>();
        List<String> undecodable = new ArrayList<>();
        long deadline = System.currentTimeMillis() + Long.parseLong(args.getOrDefault("timeout-ms", "60000"));
        long lingerUntil = 0;
        try (KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(props, new ByteArrayDeserializer(),
                new ByteArrayDeserializer())) {
            List<TopicPartition> partitions = new ArrayList<>();
            for (String topic : List.of(resultsTopic, experiencesTopic)) {
                consumer.partitionsFor(topic).forEach(p -> partitions.add(new TopicPartition(topic, p.partition())));
            }
            consumer.assign(partitions);
            consumer.seekToBeginning(partitions);
            while (System.currentTimeMillis() < deadline
                    && (lingerUntil == 0 || System.currentTimeMillis() < lingerUntil)) {
                for (ConsumerRecord<byte[], byte[]> r : consumer.poll(Duration.ofMillis(300))) {
                    boolean isResult = r.topic().equals(resultsTopic);
                    try {
                        GenericRecord record = (isResult ? results : experiences).decode(r.value());
                        framings.merge(r.value()[0] == 0 ? "confluent" : "single-object", 1, Integer::sum);
                        (isResult ? resultRows : experienceRows).add(isResult ? result(record) : experience(record));
                    } catch (Exception e) {
                        undecodable.add(r.topic() + "[" + r.partition() + "]@" + r.offset() + ": " + e);
                    }
                }
                if (lingerUntil == 0 && resultRows.size() >= wantResults && experienceRows.size() >= wantExperiences) {
                    lingerUntil = System.currentTimeMillis() + 1000;
                }
            }
        }
        if (lingerUntil == 0) {
            throw new IllegalStateException("read " + resultRows.size() + " results and " + experienceRows.size()
                    + " experiences, waited for " + wantResults + " and " + wantExperiences + "; undecodable: "
                    + undecodable);
        }
        return Map.of("framings", framings, "results", resultRows, "experiences", experienceRows,
                "undecodable", undecodable);
    }

    /** Decodes either framing into the contract's schema of one record type. */
    private static final class Reader {
        private final Contract.Entry entry;
        private final BinaryMessageDecoder<GenericRecord> singleObject;
        private final SchemaRegistry registry;

        Reader(Contract.Entry entry, String registryUrl) {
            this.entry = entry;
            this.singleObject = new BinaryMessageDecoder<>(GenericData.get(), entry.schema());
            this.registry = registryUrl.isEmpty() ? null : new SchemaRegistry(registryUrl);
        }

        GenericRecord decode(byte[] value) throws IOException, InterruptedException {
            if (value.length == 0 || value[0] != 0) {
                return singleObject.decode(value);
            }
            if (registry == null) {
                throw new IllegalStateException("a Confluent-framed record needs --registry");
            }
            ByteBuffer buffer = ByteBuffer.wrap(value);
            buffer.get();
            Schema writer = registry.schemaById(buffer.getInt());
            if (!writer.getFullName().equals(entry.schema().getFullName())) {
                throw new IllegalStateException("the record's schema is " + writer.getFullName() + ", not "
                        + entry.schema().getFullName());
            }
            GenericDatumReader<GenericRecord> reader = new GenericDatumReader<>(writer, entry.schema());
            return reader.read(null, DecoderFactory.get().binaryDecoder(value, 5, value.length - 5, null));
        }
    }

    private static Map<String, Object> result(GenericRecord r) {
        return Map.of("request_id", r.get("request_id").toString(), "step", r.get("step"),
                "task_id", r.get("task_id").toString(), "kind", r.get("kind").toString(),
                "status", r.get("status").toString(), "n", r.get("n"), "reward_mean", r.get("reward_mean"),
                "model_version", r.get("model_version"));
    }

    private static Map<String, Object> experience(GenericRecord e) {
        ByteBuffer tokenBytes = ((ByteBuffer) e.get("tokens")).duplicate().order(ByteOrder.LITTLE_ENDIAN);
        List<Integer> tokens = new ArrayList<>();
        while (tokenBytes.remaining() >= 4) {
            tokens.add(tokenBytes.getInt());
        }
        ByteBuffer logprobBytes = ((ByteBuffer) e.get("logprobs")).duplicate().order(ByteOrder.LITTLE_ENDIAN);
        List<Double> logprobs = new ArrayList<>();
        while (logprobBytes.remaining() >= 4) {
            logprobs.add((double) logprobBytes.getFloat());
        }
        Map<String, Object> row = new TreeMap<>();
        row.put("eid", e.get("eid").toString());
        row.put("group_id", e.get("group_id").toString());
        row.put("task_id", e.get("task_id").toString());
        row.put("step", e.get("step"));
        row.put("kind", e.get("kind").toString());
        row.put("run_index", e.get("run_index"));
        row.put("model_version", e.get("model_version"));
        row.put("tokens", tokens);
        row.put("prompt_length", e.get("prompt_length"));
        row.put("logprobs", logprobs);
        row.put("reward", e.get("reward"));
        row.put("objective", e.get("objective").toString());
        return row;
    }
}
