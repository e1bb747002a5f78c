package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/outbox"
)

// Validation runs before any SQL: a bad intent is refused with a typed error
// and nothing is recorded.
func ExampleEnqueue_badInput() {
	ctx := context.Background()
	var db outbox.DBTX // nil here: validation fails before it is used
	_, err := outbox.Enqueue(ctx, db, 7, outbox.Intent{LockName: "settle:store-7", Topic: "payments", Key: "settle:7:2024-06-01"})
	fmt.Println(errors.Is(err, outbox.ErrNilDB))

	fmt.Println(outbox.ValidateTopic("payments"))
	fmt.Println(errors.Is(outbox.ValidateTopic("x'; DROP TABLE t; --"), outbox.ErrInvalidTopic))
	fmt.Println(errors.Is(outbox.ValidateKey("two words"), outbox.ErrInvalidKey))
	// A stale holder's refusal is the refusal of a stale fenced write.
	fmt.Println(outbox.ErrStaleToken == fencedwrite.ErrStaleToken)
	// Output:
	// true
	// <nil>
	// true
	// true
	// true
}

// A settlement records its payment intent in the transaction of its fenced
// writes; a Dispatcher sends it to the payment provider over HTTP.
func Example() {
	ctx := context.Background()
	_ = func(tx outbox.DBTX, token int64) error {
		r, err := outbox.Enqueue(ctx, tx, token, outbox.Intent{
			LockName: "settle:store-7",
			Topic:    "payments",
			Key:      "settle:store-7:2024-06-01",
			Payload:  json.RawMessage(`{"store":7,"day":"2024-06-01","amount_cents":123456}`),
		})
		if errors.Is(err, outbox.ErrStaleToken) {
			return err // a newer holder exists: stop, nothing was recorded
		}
		if err != nil {
			return err
		}
		if r.Duplicate {
			fmt.Println("already recorded as intent", r.ID)
		}
		return nil
	}
	h, err := outbox.NewHTTPHandler(outbox.HTTPConfig{URL: "https://payments.example/v1/payouts"})
	fmt.Println(h != nil, err)
	// Output: true <nil>
}
