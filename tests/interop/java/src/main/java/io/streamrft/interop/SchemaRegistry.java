package io.streamrft.interop;

import com.fasterxml.jackson.databind.JsonNode;
import java.io.IOException;
import java.net.URI;
import java.net.URLEncoder;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import org.apache.avro.Schema;

/**
 * The two calls of the Confluent schema-registry API a producer and a consumer make (register a schema under a
 * subject, fetch a schema by its id), and the wire format built on them: a zero byte, the schema's id as four
 * big-endian bytes, the Avro binary body. Confluent's own serializer is not published where this build resolves
 * its dependencies; the protocol is small enough to speak with the JDK's HTTP client.
 */
final class SchemaRegistry {
    static final String CONTENT_TYPE = "application/vnd.schemaregistry.v1+json";
    private final String url;
    private final HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10)).build();
    private final Map<Integer, Schema> byId = new HashMap<>();

    SchemaRegistry(String url) {
        this.url = url.endsWith("/") ? url.substring(0, url.length() - 1) : url;
    }

    /** Registers {@code schemaJson} under {@code subject} (or finds it there) and returns its id. */
    int register(String subject, String schemaJson) throws IOException, InterruptedException {
        String body = Main.JSON.writeValueAsString(Map.of("schema", schemaJson));
        HttpRequest request = HttpRequest.newBuilder(URI.create(url + "/subjects/"
                        + URLEncoder.encode(subject, StandardCharsets.UTF_8) + "/versions"))
                .header("Content-Type", CONTENT_TYPE).POST(HttpRequest.BodyPublishers.ofString(body)).build();
        return call(request, "registering a schema under " + subject).get("id").asInt();
    }

    Schema schemaById(int id) throws IOException, InterruptedException {
        Schema known = byId.get(id);
        if (known == null) {
            HttpRequest request = HttpRequest.newBuilder(URI.create(url + "/schemas/ids/" + id)).GET().build();
            known = new Schema.Parser().parse(call(request, "fetching schema id " + id).get("schema").asText());
            byId.put(id, known);
        }
        return known;
    }

    static byte[] frame(int id, byte[] body) {
        return ByteBuffer.allocate(5 + body.length).put((byte) 0).putInt(id).put(body).array();
    }

    private JsonNode call(HttpRequest request, String what) throws IOException, InterruptedException {
        HttpResponse<String> response = http.send(request, HttpResponse.BodyHandlers.ofString());
        if (response.statusCode() != 200) {
            throw new IllegalStateException(what + ": the registry answered " + response.statusCode() + " "
                    + response.body());
        }
        return Main.JSON.readTree(response.body());
    }
}
