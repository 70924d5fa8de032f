package io.streamrft.interop;

import com.fasterxml.jackson.databind.ObjectMapper;
import java.util.HashMap;
import java.util.Map;

/**
 * A client of streamrft's topics written only against its published contract (the {@code streamrft schemas
 * --json} document), with Apache Kafka's client and the Apache Avro reference implementation.
 *
 * <pre>
 * produce --bootstrap B --topic T --contract C.json [--registry URL] --prefix P --count N [--bad KIND]
 * consume --bootstrap B --results T --experiences T --contract C.json [--registry URL]
 *         --want-results N --want-experiences M
 * </pre>
 *
 * Each prints one JSON object on stdout; a failure exits non-zero with its reason on stderr.
 */
public final class Main {
    static final ObjectMapper JSON = new ObjectMapper();

    public static void main(String[] argv) throws Exception {
        if (argv.length < 1) {
            fail("usage: produce|consume --option value ...");
        }
        Map<String, String> args = new HashMap<>();
        for (int i = 1; i + 1 < argv.length; i += 2) {
            if (!argv[i].startsWith("--")) {
                fail("expected an --option, got " + argv[i]);
            }
            args.put(argv[i].substring(2), argv[i + 1]);
        }
        Object out;
        try {
            out = switch (argv[0]) {
                case "produce" -> Produce.run(args);
                case "consume" -> Consume.run(args);
                default -> throw new IllegalArgumentException(
                        "unknown command " + argv[0] + ": use produce or consume");
            };
        } catch (IllegalArgumentException | IllegalStateException e) {
            fail(e.getMessage());
            return;
        }
        System.out.println(JSON.writeValueAsString(out));
    }

    static String required(Map<String, String> args, String name) {
        String value = args.get(name);
        if (value == null || value.isEmpty()) {
            throw new IllegalArgumentException("--" + name + " is required");
        }
        return value;
    }

    private static void fail(String message) {
        System.err.println("interop: " + message);
        System.exit(1);
    }
}
