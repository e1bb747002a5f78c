// Package observe is the instrumentation seam shared by pgfence's packages.
//
// pgfence reports what it does through a [Metrics] value given in each
// package's Config. The default, [Nop], records nothing, so no metrics library
// is linked into programs that do not want one. Two adapters are shipped, each
// in a package of its own so that a program links only the one it imports:
// [github.com/pgfence/pgfence/observe/promobserve] (Prometheus) and
// [github.com/pgfence/pgfence/observe/otelobserve] (OpenTelemetry).
//
// Every metric pgfence records is listed in [Catalog] with its kind, help text
// and label names; adapters declare them all up front.
package observe

import (
	"context"
	"strconv"
)

// Metrics receives pgfence's measurements. Implementations must be safe for
// concurrent use and must not block. labelValues are given in the order of the
// metric's [Def.Labels].
//
// ctx is the context of the operation measured (the caller's context of
// Acquire, Update, Claim, ...), or the context of the background loop that
// measured it (a lease's keep-alive, a worker's loop). It is never nil. It may
// already be cancelled: an adapter uses it to attach exemplars or link the
// measurement to a trace, never to decide whether to record.
type Metrics interface {
	// Add adds delta (>= 0) to the counter name.
	Add(ctx context.Context, name string, delta float64, labelValues ...string)
	// Observe records value in the histogram name (seconds for durations).
	Observe(ctx context.Context, name string, value float64, labelValues ...string)
}

// Nop is a Metrics that records nothing.
var Nop Metrics = nop{}

type nop struct{}

func (nop) Add(context.Context, string, float64, ...string)     {}
func (nop) Observe(context.Context, string, float64, ...string) {}

// OrNop returns m, or [Nop] when m is nil.
func OrNop(m Metrics) Metrics {
	if m == nil {
		return Nop
	}
	return m
}

// Kind is the type of a metric.
type Kind int

// Metric kinds.
const (
	Counter Kind = iota
	Histogram
)

// String returns "counter" or "histogram".
func (k Kind) String() string {
	switch k {
	case Counter:
		return "counter"
	case Histogram:
		return "histogram"
	}
	return "Kind(" + strconv.Itoa(int(k)) + ")"
}

// Def describes one metric.
type Def struct {
	Name   string   // metric name; counters end in _total, durations in _seconds
	Kind   Kind     // Counter or Histogram
	Help   string   // one sentence for the HELP line or the instrument's description
	Labels []string // label names, in the order callers pass their values
}

// Lookup returns the [Catalog] entry of name.
func Lookup(name string) (Def, bool) {
	for _, d := range Catalog {
		if d.Name == name {
			return d, true
		}
	}
	return Def{}, false
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

// Catalog lists every metric pgfence records. Adapters create all of them up
// front; callers must not modify it.
var Catalog = []Def{
	{LeaseAcquireSeconds, Histogram, "Time of one acquire call, including waiting, by outcome (granted, locked, error).", []string{"outcome"}},
	{LeaseWaitSeconds, Histogram, "Time Acquire waited for a held lock before it was granted.", nil},
	{LeaseHoldSeconds, Histogram, "Time from grant to release or loss of a lease.", nil},
	{LeasesLostTotal, Counter, "Leases lost before release, by reason (renewal_refused, deadline_passed, connection_lost).", []string{"reason"}},
	{LeaseRenewalsTotal, Counter, "Lease renewals by outcome (ok, refused, error).", []string{"outcome"}},
	{LeaderChangesTotal, Counter, "Times this process started or stopped leading, by election name and change (started, stopped).", []string{"election", "change"}},
	{FencedWritesTotal, Counter, "Fenced writes that changed a row, by table (schema.name).", []string{"table"}},
	{FencedRefusedTotal, Counter, "Fenced writes refused, by table (schema.name) and reason (stale, already_applied, not_found, guard).", []string{"table", "reason"}},
	{RowsClaimedTotal, Counter, "Rows claimed, by queue.", []string{"queue"}},
	{RowsCompletedTotal, Counter, "Claimed rows completed, by queue.", []string{"queue"}},
	{RowsFailedTotal, Counter, "Claimed rows failed (to be retried or dead), by queue.", []string{"queue"}},
	{RowsDeadTotal, Counter, "Rows that went to the dead state after their last attempt, by queue.", []string{"queue"}},
	{ClaimsLostTotal, Counter, "Complete/fail/renew refused because the claim expired and was taken over, by queue.", []string{"queue"}},
	{ClaimSeconds, Histogram, "Time of one claim statement, by queue.", []string{"queue"}},
	{OutboxDeliveriesTotal, Counter, "Outbox delivery attempts, by topic and outcome (delivered, failed: retried or dead after the last attempt, permanent: dead at once).", []string{"topic", "outcome"}},
	{OutboxDeliverySeconds, Histogram, "Time of one outbox delivery attempt (the handler's call), by topic.", []string{"topic"}},
}

// Counters with label values known up front are created at 0 by the pgfence
// value that records them (a Locker, a prepared Table, a Worker, a
// Dispatcher), through the Init functions below. A series that first appears
// at 1 hides its first event from increase() and rate(), which need a sample
// before it; a series that starts at 0 does not.

// InitLeases adds 0 to the lease counters: pgfence_leases_lost_total for
// every reason and pgfence_lease_renewals_total for every outcome.
func InitLeases(ctx context.Context, m Metrics) {
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
func InitTable(ctx context.Context, m Metrics, table string) {
	m.Add(ctx, FencedWritesTotal, 0, table)
	for _, r := range []string{RefusedStale, RefusedAlreadyApplied, RefusedNotFound, RefusedGuard} {
		m.Add(ctx, FencedRefusedTotal, 0, table, r)
	}
}

// InitQueue adds 0 to the claim counters of queue: rows claimed, completed,
// failed and dead, and claims lost.
func InitQueue(ctx context.Context, m Metrics, queue string) {
	for _, name := range []string{RowsClaimedTotal, RowsCompletedTotal, RowsFailedTotal, RowsDeadTotal, ClaimsLostTotal} {
		m.Add(ctx, name, 0, queue)
	}
}

// InitTopic adds 0 to pgfence_outbox_deliveries_total of topic for every
// outcome.
func InitTopic(ctx context.Context, m Metrics, topic string) {
	for _, o := range []string{DeliveryDelivered, DeliveryFailed, DeliveryPermanent} {
		m.Add(ctx, OutboxDeliveriesTotal, 0, topic, o)
	}
}
