// Command interop is a client of streamrft's topics written only against its published contract (the
// `streamrft schemas --json` document) with libraries none of streamrft's code uses: franz-go for Kafka,
// hamba/avro for Avro and franz-go's sr package for the schema registry. tests/interop runs it.
//
//	interop produce -bootstrap B -topic T -contract C.json [-registry URL] -prefix P -count N [-bad KIND]
//	interop consume -bootstrap B -results T -experiences T -contract C.json [-registry URL]
//	                -want-results N -want-experiences M
//
// Both print one JSON object on stdout; errors go to stderr with a non-zero exit.
package main

import (
	"encoding/json"
	"fmt"
	"os"
)

func main() {
	if len(os.Args) < 2 {
		fail(fmt.Errorf("usage: interop produce|consume [flags]"))
	}
	var out any
	var err error
	switch os.Args[1] {
	case "produce":
		out, err = produce(os.Args[2:])
	case "consume":
		out, err = consume(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: use produce or consume", os.Args[1])
	}
	if err != nil {
		fail(err)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "interop:", err)
	os.Exit(1)
}
