package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

type consumed struct {
	Framings    map[string]int      `json:"framings"`
	Results     []RolloutResult     `json:"results"`
	Experiences []experienceSummary `json:"experiences"`
	Undecodable []string            `json:"undecodable"`
}

// consume reads a run's results and experiences from the beginning with read_committed (franz-go reads
// uncommitted records by default: the aborted transactions of a role would show up), until it has the counts
// asked for and then one more second, so that records beyond them are seen too.
func consume(args []string) (any, error) {
	fs := flag.NewFlagSet("consume", flag.ContinueOnError)
	bootstrap := fs.String("bootstrap", "", "Kafka bootstrap servers")
	resultsTopic := fs.String("results", "", "the run's results topic")
	experiencesTopic := fs.String("experiences", "", "the run's experiences topic")
	contractPath := fs.String("contract", "", "the contract document (streamrft schemas --json)")
	registry := fs.String("registry", "", "schema registry URL; records in the Confluent wire format need it")
	wantResults := fs.Int("want-results", 1, "results to wait for")
	wantExperiences := fs.Int("want-experiences", 1, "experiences to wait for")
	timeout := fs.Duration("timeout", 60*time.Second, "give up after")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	contract, err := loadContract(*contractPath)
	if err != nil {
		return nil, err
	}
	resultRecord, err := record(contract, "RolloutResult")
	if err != nil {
		return nil, err
	}
	experienceRecord, err := record(contract, "Experience")
	if err != nil {
		return nil, err
	}
	framings := map[string]framing{"single-object": singleObject{}}
	if *registry != "" {
		if framings["confluent"], err = newRegistryFraming(*registry); err != nil {
			return nil, err
		}
	}
	client, err := kgo.NewClient(kgo.SeedBrokers(*bootstrap), kgo.ConsumeTopics(*resultsTopic, *experiencesTopic),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		return nil, err
	}
	defer client.Close()

	out := consumed{Framings: map[string]int{}, Results: []RolloutResult{}, Experiences: []experienceSummary{},
		Undecodable: []string{}}
	decode := func(r *kgo.Record, rec contractRecord, into any) bool {
		name := "single-object"
		if len(r.Value) > 0 && r.Value[0] == 0 {
			name = "confluent"
		}
		frame, ok := framings[name]
		failure := fmt.Errorf("a %s record needs -registry", name)
		if ok {
			failure = frame.decode(rec, r.Value, into)
		}
		if failure != nil {
			out.Undecodable = append(out.Undecodable, fmt.Sprintf("%s[%d]@%d: %v", r.Topic, r.Partition, r.Offset,
				failure))
			return false
		}
		out.Framings[name]++
		return true
	}
	deadline := time.Now().Add(*timeout)
	var lingerUntil time.Time
	for time.Now().Before(deadline) && (lingerUntil.IsZero() || time.Now().Before(lingerUntil)) {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		fetches := client.PollFetches(ctx)
		cancel()
		for _, fetchErr := range fetches.Errors() {
			if !errors.Is(fetchErr.Err, context.DeadlineExceeded) {
				return nil, fmt.Errorf("fetching %s[%d]: %w", fetchErr.Topic, fetchErr.Partition, fetchErr.Err)
			}
		}
		fetches.EachRecord(func(r *kgo.Record) {
			if r.Topic == *resultsTopic {
				var result RolloutResult
				if decode(r, resultRecord, &result) {
					out.Results = append(out.Results, result)
				}
			} else {
				var experience Experience
				if decode(r, experienceRecord, &experience) {
					out.Experiences = append(out.Experiences, experience.summary())
				}
			}
		})
		if lingerUntil.IsZero() && len(out.Results) >= *wantResults && len(out.Experiences) >= *wantExperiences {
			lingerUntil = time.Now().Add(time.Second)
		}
	}
	if lingerUntil.IsZero() {
		return nil, fmt.Errorf("read %d results and %d experiences in %s, waited for %d and %d (undecodable: %v)",
			len(out.Results), len(out.Experiences), *timeout, *wantResults, *wantExperiences, out.Undecodable)
	}
	return out, nil
}
