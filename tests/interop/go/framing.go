package main

import (
	"bytes"
	"context"
	"fmt"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/sr"
)

// framing turns records into topic values and back: Avro single-object encoding with the contract's headers,
// or the Confluent wire format of a schema registry.
type framing interface {
	encodeTask(task Task) ([]byte, error)
	decode(record contractRecord, value []byte, into any) error
	name() string
}

// singleObject is C3 01, the 8-byte fingerprint, then the Avro binary body.
type singleObject struct {
	task contractRecord
}

func (singleObject) name() string { return "single-object" }

func (f singleObject) encodeTask(task Task) ([]byte, error) {
	body, err := avro.Marshal(f.task.schema, task)
	if err != nil {
		return nil, err
	}
	return append(append([]byte{}, f.task.header...), body...), nil
}

func (singleObject) decode(record contractRecord, value []byte, into any) error {
	if !bytes.HasPrefix(value, record.header) {
		return fmt.Errorf("not a single-object %s of the contract's schema: it starts %x, the contract's "+
			"header is %x", record.name, value[:min(len(value), len(record.header))], record.header)
	}
	return avro.Unmarshal(record.schema, value[len(record.header):], into)
}

// registryFraming is the Confluent wire format (a zero byte, the schema's registry id as 4 big-endian bytes,
// the Avro body): franz-go's Serde writes it, with the Task schema registered under "<topic>-value"; read
// records are decoded with the writer schema their id names, fetched from the registry.
type registryFraming struct {
	client  *sr.Client
	serde   sr.Serde
	writers map[int]avro.Schema
}

func (*registryFraming) name() string { return "confluent" }

func newRegistryFraming(url string) (*registryFraming, error) {
	client, err := sr.NewClient(sr.URLs(url))
	if err != nil {
		return nil, err
	}
	return &registryFraming{client: client, writers: map[int]avro.Schema{}}, nil
}

// registerTask registers the contract's Task schema under the subject of topic (TopicNameStrategy).
func (f *registryFraming) registerTask(ctx context.Context, topic string, task contractRecord) (int, error) {
	registered, err := f.client.CreateSchema(ctx, topic+"-value", sr.Schema{Schema: task.json, Type: sr.TypeAvro})
	if err != nil {
		return 0, fmt.Errorf("registering the Task schema under %s-value: %w", topic, err)
	}
	f.serde.Register(registered.ID, Task{}, sr.EncodeFn(func(v any) ([]byte, error) {
		return avro.Marshal(task.schema, v)
	}))
	return registered.ID, nil
}

func (f *registryFraming) encodeTask(task Task) ([]byte, error) { return f.serde.Encode(task) }

func (f *registryFraming) decode(record contractRecord, value []byte, into any) error {
	id, body, err := (&sr.ConfluentHeader{}).DecodeID(value)
	if err != nil {
		return err
	}
	writer, ok := f.writers[id]
	if !ok {
		fetched, err := f.client.SchemaByID(context.Background(), id)
		if err != nil {
			return fmt.Errorf("schema id %d: %w", id, err)
		}
		if writer, err = avro.ParseWithCache(fetched.Schema, "", &avro.SchemaCache{}); err != nil {
			return fmt.Errorf("schema id %d: %w", id, err)
		}
		f.writers[id] = writer
	}
	if named, ok := writer.(avro.NamedSchema); !ok || named.FullName() != "io.streamrft."+record.name {
		return fmt.Errorf("schema id %d is no io.streamrft.%s", id, record.name)
	}
	return avro.Unmarshal(writer, body, into)
}
