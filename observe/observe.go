// Package observe is the instrumentation seam shared by pgfence's packages.
//
// pgfence reports what it does through a [Metrics] value given in each
// package's Config. The default, [Nop], records nothing, so no metrics library
// is linked into programs that do not want one. The Prometheus adapter is
// [github.com/pgfence/pgfence/observe/promobserve]; an OpenTelemetry adapter
// is a dozen lines over the same two methods (see the README).
//
// Every metric pgfence records is listed in [Catalog] with its kind, help text
// and label names; adapters declare them all up front.
package observe

// Metrics receives pgfence's measurements. Implementations must be safe for
// concurrent use. labelValues are given in the order of the metric's
// [Def.Labels].
type Metrics interface {
	// Add adds delta (>= 0) to the counter name.
	Add(name string, delta float64, labelValues ...string)
	// Observe records value in the histogram name (seconds for durations).
	Observe(name string, value float64, labelValues ...string)
}

// Nop is a Metrics that records nothing.
var Nop Metrics = nop{}

type nop struct{}

func (nop) Add(string, float64, ...string)     {}
func (nop) Observe(string, float64, ...string) {}

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

// Def describes one metric.
type Def struct {
	Name   string
	Kind   Kind
	Help   string
	Labels []string
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

// Catalog lists every metric pgfence records.
var Catalog = []Def{
	{LeaseAcquireSeconds, Histogram, "Time of one acquire call, including waiting, by outcome (granted, locked, error).", []string{"outcome"}},
	{LeaseWaitSeconds, Histogram, "Time Acquire waited for a held lock before it was granted.", nil},
	{LeaseHoldSeconds, Histogram, "Time from grant to release or loss of a lease.", nil},
	{LeasesLostTotal, Counter, "Leases lost before release, by reason (renewal_refused, deadline_passed, connection_lost).", []string{"reason"}},
	{LeaseRenewalsTotal, Counter, "Lease renewals by outcome (ok, refused, error).", []string{"outcome"}},
	{LeaderChangesTotal, Counter, "Times this process started or stopped leading, by election name and change (started, stopped).", []string{"election", "change"}},
	{FencedWritesTotal, Counter, "Fenced writes that changed a row.", nil},
	{FencedRefusedTotal, Counter, "Fenced writes refused, by reason (stale, already_applied, not_found, guard).", []string{"reason"}},
	{RowsClaimedTotal, Counter, "Rows claimed, by queue.", []string{"queue"}},
	{RowsCompletedTotal, Counter, "Claimed rows completed, by queue.", []string{"queue"}},
	{RowsFailedTotal, Counter, "Claimed rows failed (to be retried or dead), by queue.", []string{"queue"}},
	{RowsDeadTotal, Counter, "Rows that went to the dead state after their last attempt, by queue.", []string{"queue"}},
	{ClaimsLostTotal, Counter, "Complete/fail/renew refused because the claim expired and was taken over, by queue.", []string{"queue"}},
	{ClaimSeconds, Histogram, "Time of one claim statement, by queue.", []string{"queue"}},
	{OutboxDeliveriesTotal, Counter, "Outbox delivery attempts, by topic and outcome (delivered, failed: retried or dead after the last attempt, permanent: dead at once).", []string{"topic", "outcome"}},
	{OutboxDeliverySeconds, Histogram, "Time of one outbox delivery attempt (the handler's call), by topic.", []string{"topic"}},
}
