// Apache Avro's own answer for each schema given: its Parsing Canonical Form, its CRC-64-AVRO fingerprint
// (SchemaNormalization.parsingFingerprint64, printed as the unsigned 64-bit number in hex) and a record of the
// schema encoded with Avro's single-object encoder (BinaryMessageEncoder), so the header's byte order is Java's.
//
//   java -cp <avro jars> Fingerprints.java Name=path.avsc ...
// prints one line per schema: name TAB fingerprint TAB encoded record (hex) TAB canonical form
import java.nio.ByteBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.HexFormat;
import java.util.Map;
import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageEncoder;

public class Fingerprints {
  public static void main(String[] args) throws Exception {
    for (String arg : args) {
      String[] nameAndPath = arg.split("=", 2);
      Schema schema = new Schema.Parser().parse(Files.readString(Path.of(nameAndPath[1])));
      long fingerprint = SchemaNormalization.parsingFingerprint64(schema);
      BinaryMessageEncoder<GenericRecord> encoder = new BinaryMessageEncoder<>(GenericData.get(), schema);
      ByteBuffer encoded = encoder.encode((GenericRecord) sample(schema));
      byte[] bytes = new byte[encoded.remaining()];
      encoded.get(bytes);
      System.out.println(nameAndPath[0] + "\t" + String.format("%016x", fingerprint) + "\t"
          + HexFormat.of().formatHex(bytes) + "\t" + SchemaNormalization.toParsingForm(schema));
    }
  }

  // A value of every type: fields take their default where they have one, else the type's first value.
  static Object sample(Schema schema) {
    switch (schema.getType()) {
      case RECORD:
        GenericData.Record record = new GenericData.Record(schema);
        for (Schema.Field field : schema.getFields()) {
          record.put(field.pos(), field.hasDefaultValue() ? GenericData.get().getDefaultValue(field)
                                                          : sample(field.schema()));
        }
        return record;
      case ENUM: return new GenericData.EnumSymbol(schema, schema.getEnumSymbols().get(0));
      case UNION: return sample(schema.getTypes().get(0));
      case MAP: return Map.of();
      case STRING: return "";
      case BYTES: return ByteBuffer.allocate(0);
      case INT: return 0;
      case LONG: return 0L;
      case FLOAT: return 0.0f;
      case DOUBLE: return 0.0;
      case BOOLEAN: return false;
      case NULL: return null;
      default: throw new IllegalArgumentException("no sample for " + schema);
    }
  }
}
