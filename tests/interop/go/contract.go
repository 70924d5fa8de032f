package main

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"

	"github.com/hamba/avro/v2"
	"github.com/hamba/avro/v2/pkg/crc64"
)

// recordContract is one record type of the published contract.
type recordContract struct {
	Schema         json.RawMessage `json:"schema"`
	CanonicalForm  string          `json:"canonical_form"`
	FingerprintHex string          `json:"fingerprint_hex"`
	HeaderHex      string          `json:"header_hex"`
}

// contractRecord is a record type as this client uses it: its schema and its single-object header.
type contractRecord struct {
	name   string
	json   string
	schema avro.Schema
	header []byte
	// hamba's own parsing canonical form equals the published one; where it does not, hamba's fingerprint is
	// not the contract's and a producer must take the published header instead (reported, not fatal).
	libraryFormMatches bool
}

var singleObjectMagic = []byte{0xc3, 0x01}

func loadContract(path string) (map[string]recordContract, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var c map[string]recordContract
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, fmt.Errorf("%s is not a contract document: %w", path, err)
	}
	return c, nil
}

// record parses name's schema and checks its published fingerprint and header: the fingerprint is the
// CRC-64-AVRO of the published parsing canonical form, as a number in hex; the header is C3 01 and then the
// fingerprint's 8 bytes little-endian, as the Avro specification's single-object encoding says.
func record(c map[string]recordContract, name string) (contractRecord, error) {
	rc, ok := c[name]
	if !ok {
		return contractRecord{}, fmt.Errorf("the contract has no record type %s", name)
	}
	schema, err := avro.ParseBytesWithCache(rc.Schema, "", &avro.SchemaCache{})
	if err != nil {
		return contractRecord{}, fmt.Errorf("%s schema: %w", name, err)
	}
	header, err := hex.DecodeString(rc.HeaderHex)
	if err != nil {
		return contractRecord{}, fmt.Errorf("%s header_hex: %w", name, err)
	}
	hash := crc64.New()
	hash.Write([]byte(rc.CanonicalForm))
	fingerprint := hash.Sum64()
	want := binary.LittleEndian.AppendUint64(append([]byte{}, singleObjectMagic...), fingerprint)
	if number := fmt.Sprintf("%016x", fingerprint); rc.FingerprintHex != number {
		return contractRecord{}, fmt.Errorf("%s: the published fingerprint %s is not the CRC-64-AVRO of the "+
			"published canonical form, %s", name, rc.FingerprintHex, number)
	}
	if !bytes.Equal(header, want) {
		return contractRecord{}, fmt.Errorf("%s: the published header %s is not C3 01 + the fingerprint "+
			"little-endian, %x", name, rc.HeaderHex, want)
	}
	return contractRecord{name: name, json: string(rc.Schema), schema: schema, header: header,
		libraryFormMatches: schema.String() == rc.CanonicalForm}, nil
}
