// Package metricdefs holds the names and label values of the metrics
// pgfence's packages record (package observe lists them, with their kinds
// and help, in observe.Catalog) and the helpers the packages share to record
// them.
package metricdefs

import "context"

// Recorder is observe.Metrics (the same methods), so that this package does
// not import a public package.
type Recorder interface {
	Add(ctx context.Context, name string, delta float64, labelValues ...string)
	Observe(ctx context.Context, name string, value float64, labelValues ...string)
}

type nop struct{}

func (nop) Add(context.Context, string, float64, ...string)     {}
func (nop) Observe(context.Context, string, float64, ...string) {}

// OrNop returns m, or a Recorder that records nothing when m is nil.
func OrNop(m Recorder) Recorder {
	if m == nil {
		return nop{}
	}
	return m
}

// Metric names. Durations are in seconds.
const (
	LeaseAcquireSeconds = "pgfence_lease_acquire_seconds"
	LeaseWaitSeconds    = "pgfence_lease_wait_seconds"
	LeaseHoldSeconds    = "pgfence_lease_hold_seconds"
	LeasesLostTotal     = "pgfence_leases_lost_total"
	LeaseRenewalsTotal  = "pgfence_lease_renewals_total"
	LeaderChangesTotal  = "pgfence_leader_changes_total"
	FencedWritesTotal   = "pgfence_fenced_writes_total"
	FencedRefusedTotal  = "pgfence_fenced_write_refused_total"
	RowsClaimedTotal    = "pgfence_rows_claimed_total"
	RowsCompletedTotal  = "pgfence_rows_completed_total"
	RowsFailedTotal     = "pgfence_rows_failed_total"
	RowsDeadTotal       = "pgfence_rows_dead_total"
	ClaimsLostTotal     = "pgfence_claims_lost_total"
	ClaimSeconds        = "pgfence_claim_seconds"

	OutboxDeliveriesTotal = "pgfence_outbox_deliveries_total"
	OutboxDeliverySeconds = "pgfence_outbox_delivery_seconds"
)

// Label values used with the metrics above.
const (
	OutcomeGranted = "granted"
	OutcomeLocked  = "locked"
	OutcomeError   = "error"

	LostRenewalRefused = "renewal_refused"
	LostDeadline       = "deadline_passed"
	LostConnection     = "connection_lost"

	RenewOK      = "ok"
	RenewRefused = "refused"
	RenewError   = "error"

	RefusedStale          = "stale"
	RefusedAlreadyApplied = "already_applied"
	RefusedNotFound       = "not_found"
	RefusedGuard          = "guard"

	DeliveryDelivered = "delivered"
	DeliveryFailed    = "failed"
	DeliveryPermanent = "permanent"
)

// InitLeases adds 0 to the lease counters: pgfence_leases_lost_total for
// every reason and pgfence_lease_renewals_total for every outcome.
func InitLeases(ctx context.Context, m Recorder) {
	for _, r := range []string{LostRenewalRefused, LostDeadline, LostConnection} {
		m.Add(ctx, LeasesLostTotal, 0, r)
	}
	for _, o := range []string{RenewOK, RenewRefused, RenewError} {
		m.Add(ctx, LeaseRenewalsTotal, 0, o)
	}
}

// InitTable adds 0 to the fenced-write counters of table ("schema.name"):
// pgfence_fenced_writes_total and pgfence_fenced_write_refused_total for
// every reason.
func InitTable(ctx context.Context, m Recorder, table string) {
	m.Add(ctx, FencedWritesTotal, 0, table)
	for _, r := range []string{RefusedStale, RefusedAlreadyApplied, RefusedNotFound, RefusedGuard} {
		m.Add(ctx, FencedRefusedTotal, 0, table, r)
	}
}

// InitQueue adds 0 to the claim counters of queue: rows claimed, completed,
// failed and dead, and claims lost.
func InitQueue(ctx context.Context, m Recorder, queue string) {
	for _, name := range []string{RowsClaimedTotal, RowsCompletedTotal, RowsFailedTotal, RowsDeadTotal, ClaimsLostTotal} {
		m.Add(ctx, name, 0, queue)
	}
}

// InitTopic adds 0 to pgfence_outbox_deliveries_total of topic for every
// outcome.
func InitTopic(ctx context.Context, m Recorder, topic string) {
	for _, o := range []string{DeliveryDelivered, DeliveryFailed, DeliveryPermanent} {
		m.Add(ctx, OutboxDeliveriesTotal, 0, topic, o)
	}
}
