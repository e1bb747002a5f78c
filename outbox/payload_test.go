package outbox_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/pgfence/pgfence/outbox"
)

// TestPayloadDeliveredAsJSONB: the payload is stored as jsonb, so it is
// delivered as the same JSON value re-serialised by PostgreSQL (keys sorted,
// the last of duplicate keys kept, PostgreSQL's spacing), not as the bytes
// Enqueue was given. docs/outbox.md and Intent.Payload say so.
func TestPayloadDeliveredAsJSONB(t *testing.T) {
	t.Parallel()
	b := setup(t)
	l := b.grant(t, "payload")
	const sent = `{ "b":1,"a" : [1,2.50], "a":["last"] }`
	const want = `{"a": ["last"], "b": 1}`
	if _, err := outbox.Enqueue(b.ctx, b.pool, l, outbox.Intent{Topic: "payload", Key: "k", Payload: json.RawMessage(sent)}); err != nil {
		t.Fatal(err)
	}
	var got json.RawMessage
	h := func(_ context.Context, d outbox.Delivery) error {
		got = append(json.RawMessage(nil), d.Payload...)
		return nil
	}
	d, err := outbox.NewDispatcher(b.pool, "payload", h, &outbox.Config{PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Drain(b.ctx); err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatalf("delivered payload %s, want %s (sent %s)", got, want, sent)
	}
}
