package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

type produced struct {
	Framing     string   `json:"framing"`
	TaskIDs     []string `json:"task_ids"`
	Bad         string   `json:"bad,omitempty"`
	BadTaskID   string   `json:"bad_task_id,omitempty"`
	SchemaID    int      `json:"schema_id,omitempty"`
	LibraryForm bool     `json:"library_canonical_form_matches"`
}

// produce writes one bad task (if asked for) and then count arithmetic tasks, in that order, with an
// idempotent producer (franz-go's default).
func produce(args []string) (any, error) {
	fs := flag.NewFlagSet("produce", flag.ContinueOnError)
	bootstrap := fs.String("bootstrap", "", "Kafka bootstrap servers")
	topic := fs.String("topic", "", "the run's tasks topic")
	contractPath := fs.String("contract", "", "the contract document (streamrft schemas --json)")
	registry := fs.String("registry", "", "schema registry URL (Confluent API); empty: single-object encoding")
	prefix := fs.String("prefix", "go", "task ids are <prefix>-<i>")
	count := fs.Int("count", 2, "good tasks to produce")
	bad := fs.String("bad", "", "one bad task first: swapped-fingerprint (single-object) or payload-not-object")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	contract, err := loadContract(*contractPath)
	if err != nil {
		return nil, err
	}
	taskRecord, err := record(contract, "Task")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := produced{LibraryForm: taskRecord.libraryFormMatches, Bad: *bad}
	var frame framing = singleObject{task: taskRecord}
	if *registry != "" {
		rf, err := newRegistryFraming(*registry)
		if err != nil {
			return nil, err
		}
		if out.SchemaID, err = rf.registerTask(ctx, *topic, taskRecord); err != nil {
			return nil, err
		}
		frame = rf
	}
	out.Framing = frame.name()

	var records []*kgo.Record
	if *bad != "" {
		value, id, err := badTask(*bad, *prefix, frame)
		if err != nil {
			return nil, err
		}
		out.BadTaskID = id
		records = append(records, &kgo.Record{Topic: *topic, Key: []byte(id), Value: value})
	}
	for i := 0; i < *count; i++ {
		a, b := i+2, 3*i+1
		payload, _ := json.Marshal(map[string]any{"question": fmt.Sprintf("What is %d + %d?", a, b), "answer": a + b})
		task := Task{TaskID: fmt.Sprintf("%s-%d", *prefix, i), Taskset: "interop", Workflow: "arithmetic",
			Payload: string(payload), CreatedAt: time.Now()}
		value, err := frame.encodeTask(task)
		if err != nil {
			return nil, err
		}
		records = append(records, &kgo.Record{Topic: *topic, Key: []byte(task.TaskID), Value: value})
		out.TaskIDs = append(out.TaskIDs, task.TaskID)
	}
	client, err := kgo.NewClient(kgo.SeedBrokers(*bootstrap))
	if err != nil {
		return nil, err
	}
	defer client.Close()
	if err := client.ProduceSync(ctx, records...).FirstErr(); err != nil {
		return nil, fmt.Errorf("producing to %s: %w", *topic, err)
	}
	return out, nil
}

// badTask is a task the explorer must dead-letter: its fingerprint written big-endian (the byte order the
// single-object specification rules out), or a payload that is JSON but no object.
func badTask(kind, prefix string, frame framing) ([]byte, string, error) {
	id := prefix + "-bad"
	task := Task{TaskID: id, Taskset: "interop", Workflow: "arithmetic", Payload: `{"question": "1 + 1", "answer": 2}`,
		CreatedAt: time.Now()}
	switch kind {
	case "swapped-fingerprint":
		value, err := frame.encodeTask(task)
		if err != nil {
			return nil, "", err
		}
		if frame.name() != "single-object" {
			return nil, "", fmt.Errorf("swapped-fingerprint needs single-object encoding (no -registry)")
		}
		for i, j := 2, 9; i < j; i, j = i+1, j-1 {
			value[i], value[j] = value[j], value[i]
		}
		return value, id, nil
	case "payload-not-object":
		task.Payload = `["1 + 1", 2]`
		value, err := frame.encodeTask(task)
		return value, id, err
	}
	return nil, "", fmt.Errorf("unknown bad task %q: use swapped-fingerprint or payload-not-object", kind)
}
