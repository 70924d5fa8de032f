package main

import (
	"encoding/binary"
	"math"
	"time"
)

// Task, RolloutResult and Experience hold the fields of the contract's records this client writes or reads;
// hamba/avro skips the others when it decodes.
type Task struct {
	TaskID      string    `avro:"task_id"`
	Taskset     string    `avro:"taskset"`
	Workflow    string    `avro:"workflow"`
	Payload     string    `avro:"payload"`
	RewardFn    *string   `avro:"reward_fn"`
	RepeatTimes *int      `avro:"repeat_times"`
	CreatedAt   time.Time `avro:"created_at"`
}

type RolloutResult struct {
	RequestID    string  `avro:"request_id" json:"request_id"`
	Step         int64   `avro:"step" json:"step"`
	TaskID       string  `avro:"task_id" json:"task_id"`
	Kind         string  `avro:"kind" json:"kind"`
	Status       string  `avro:"status" json:"status"`
	N            int     `avro:"n" json:"n"`
	RewardMean   float64 `avro:"reward_mean" json:"reward_mean"`
	ModelVersion int64   `avro:"model_version" json:"model_version"`
}

type Experience struct {
	EID          string  `avro:"eid"`
	GroupID      string  `avro:"group_id"`
	TaskID       string  `avro:"task_id"`
	Step         int64   `avro:"step"`
	Kind         string  `avro:"kind"`
	RunIndex     int     `avro:"run_index"`
	ModelVersion int64   `avro:"model_version"`
	Tokens       []byte  `avro:"tokens"`
	PromptLength int     `avro:"prompt_length"`
	Logprobs     []byte  `avro:"logprobs"`
	Reward       float64 `avro:"reward"`
	Objective    string  `avro:"objective"`
}

// experienceSummary is an Experience with its packed arrays unpacked (int32 and float32, little-endian).
type experienceSummary struct {
	EID          string    `json:"eid"`
	GroupID      string    `json:"group_id"`
	TaskID       string    `json:"task_id"`
	Step         int64     `json:"step"`
	Kind         string    `json:"kind"`
	RunIndex     int       `json:"run_index"`
	ModelVersion int64     `json:"model_version"`
	Tokens       []int32   `json:"tokens"`
	PromptLength int       `json:"prompt_length"`
	Logprobs     []float64 `json:"logprobs"`
	Reward       float64   `json:"reward"`
	Objective    string    `json:"objective"`
}

func (e Experience) summary() experienceSummary {
	tokens := make([]int32, len(e.Tokens)/4)
	for i := range tokens {
		tokens[i] = int32(binary.LittleEndian.Uint32(e.Tokens[4*i:]))
	}
	logprobs := make([]float64, len(e.Logprobs)/4)
	for i := range logprobs {
		logprobs[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(e.Logprobs[4*i:])))
	}
	return experienceSummary{EID: e.EID, GroupID: e.GroupID, TaskID: e.TaskID, Step: e.Step, Kind: e.Kind,
		RunIndex: e.RunIndex, ModelVersion: e.ModelVersion, Tokens: tokens, PromptLength: e.PromptLength,
		Logprobs: logprobs, Reward: e.Reward, Objective: e.Objective}
}
