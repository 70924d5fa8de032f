package io.streamrft.interop;

import com.fasterxml.jackson.databind.JsonNode;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.HexFormat;
import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;

/**
 * The published contract, checked against Avro's reference implementation: each record type's parsing
 * canonical form and fingerprint (a number, in hex) must be what {@link SchemaNormalization} computes from its
 * schema, and its header C3 01 followed by the fingerprint's 8 bytes little-endian.
 */
final class Contract {
    private final JsonNode document;

    /** A record type: its schema and the single-object header records written with it start with. */
    record Entry(String name, Schema schema, String json, byte[] header) {
    }

    Contract(Path path) throws IOException {
        this.document = Main.JSON.readTree(Files.readAllBytes(path));
    }

    Entry entry(String name) {
        JsonNode node = document.get(name);
        if (node == null) {
            throw new IllegalStateException("the contract has no record type " + name);
        }
        String json = node.get("schema").toString();
        Schema schema = new Schema.Parser().parse(json);
        String form = SchemaNormalization.toParsingForm(schema);
        if (!form.equals(node.get("canonical_form").asText())) {
            throw new IllegalStateException(name + ": the published canonical form is not Avro's:\n  published "
                    + node.get("canonical_form").asText() + "\n  Avro      " + form);
        }
        long fingerprint = SchemaNormalization.parsingFingerprint64(schema);
        if (!String.format("%016x", fingerprint).equals(node.get("fingerprint_hex").asText())) {
            throw new IllegalStateException(name + ": the published fingerprint " + node.get("fingerprint_hex").asText()
                    + " is not Avro's " + String.format("%016x", fingerprint));
        }
        String header = "c301" + HexFormat.of().formatHex(
                ByteBuffer.allocate(8).order(ByteOrder.LITTLE_ENDIAN).putLong(fingerprint).array());
        if (!header.equals(node.get("header_hex").asText())) {
            throw new IllegalStateException(name + ": the published header " + node.get("header_hex").asText()
                    + " is not C3 01 + the fingerprint little-endian, " + header);
        }
        return new Entry(name, schema, json, HexFormat.of().parseHex(header));
    }
}
