package outbox

import (
	"context"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/nilcheck"
)

// TopicStatus counts the intents of one topic (a row of the
// pgfence.outbox_status view), on the database clock.
type TopicStatus struct {
	// Topic is the topic the counts are of.
	Topic string
	// Pending: due for delivery, not claimed.
	Pending int64
	// RetryWaiting: a failed attempt waits for its retry (or NotBefore).
	RetryWaiting int64
	// InFlight: claimed by a dispatcher, claim not expired.
	InFlight int64
	// ExpiredClaims: claimed by a dispatcher that died or stalled.
	ExpiredClaims int64
	// Delivered: the handler returned nil.
	Delivered int64
	// Dead: every attempt failed, or the handler returned [Permanent].
	Dead int64
	// OldestUndeliveredSeconds is the age of the oldest intent neither
	// delivered nor dead (0 when none).
	OldestUndeliveredSeconds float64
}

// Undelivered is the number of intents neither delivered nor dead.
func (s TopicStatus) Undelivered() int64 {
	return s.Pending + s.RetryWaiting + s.InFlight + s.ExpiredClaims
}

// Status returns one [TopicStatus] per topic that has intents, by topic
// name. It reads every intent.
func Status(ctx context.Context, db pgfence.DBTX) ([]TopicStatus, error) {
	if nilcheck.IsNil(db) {
		return nil, invalid("outbox.Status", "db", "nil: pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx")
	}
	rows, err := queries.OutboxStatus(ctx, db)
	if err != nil {
		return nil, translate("outbox.Status", nil, err)
	}
	out := make([]TopicStatus, len(rows))
	for i, r := range rows {
		out[i] = TopicStatus{Topic: r.Topic, Pending: r.Pending, RetryWaiting: r.RetryWaiting, InFlight: r.InFlight,
			ExpiredClaims: r.ExpiredClaims, Delivered: r.Delivered, Dead: r.Dead, OldestUndeliveredSeconds: r.OldestUndeliveredSeconds}
	}
	return out, nil
}
