package outbox

import (
	"context"

	"github.com/pgfence/pgfence/skiplocked"
)

// Internals the external tests check against.
const (
	MaxKeyBytes     = maxKeyBytes
	MaxPayloadBytes = maxPayloadBytes
	QueuePrefix     = queuePrefix
)

// Deliver runs d's delivery of the claimed job j, as its Worker does.
func (d *Dispatcher) Deliver(ctx context.Context, j skiplocked.Job) error { return d.deliver(ctx, j) }

// Kept is the number of intents d keeps for deliveries to come.
func (d *Dispatcher) Kept() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.claimed)
}
