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

	"github.com/pgfence/pgfence/internal/metricdefs"
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

// Catalog lists every metric pgfence records. Adapters create all of them up
// front; callers must not modify it.
var Catalog = []Def{
	{metricdefs.LeaseAcquireSeconds, Histogram, "Time of one acquire call, including waiting, by outcome (granted, locked, error).", []string{"outcome"}},
	{metricdefs.LeaseWaitSeconds, Histogram, "Time Acquire waited for a held lock before it was granted.", nil},
	{metricdefs.LeaseHoldSeconds, Histogram, "Time from grant to release or loss of a lease.", nil},
	{metricdefs.LeasesLostTotal, Counter, "Leases lost before release, by reason (renewal_refused, deadline_passed, connection_lost).", []string{"reason"}},
	{metricdefs.LeaseRenewalsTotal, Counter, "Lease renewals by outcome (ok, refused, error).", []string{"outcome"}},
	{metricdefs.LeaderChangesTotal, Counter, "Times this process started or stopped leading, by election name and change (started, stopped).", []string{"election", "change"}},
	{metricdefs.FencedWritesTotal, Counter, "Fenced writes that changed a row, by table (schema.name).", []string{"table"}},
	{metricdefs.FencedRefusedTotal, Counter, "Fenced writes refused, by table (schema.name) and reason (stale, already_applied, not_found, guard).", []string{"table", "reason"}},
	{metricdefs.RowsClaimedTotal, Counter, "Rows claimed, by queue.", []string{"queue"}},
	{metricdefs.RowsCompletedTotal, Counter, "Claimed rows completed, by queue.", []string{"queue"}},
	{metricdefs.RowsFailedTotal, Counter, "Claimed rows failed (to be retried or dead), by queue.", []string{"queue"}},
	{metricdefs.RowsDeadTotal, Counter, "Rows that went to the dead state after their last attempt, by queue.", []string{"queue"}},
	{metricdefs.ClaimsLostTotal, Counter, "Complete/fail/renew refused because the claim expired and was taken over, by queue.", []string{"queue"}},
	{metricdefs.ClaimSeconds, Histogram, "Time of one claim statement, by queue.", []string{"queue"}},
	{metricdefs.OutboxDeliveriesTotal, Counter, "Outbox delivery attempts, by topic and outcome (delivered, failed: retried or dead after the last attempt, permanent: dead at once).", []string{"topic", "outcome"}},
	{metricdefs.OutboxDeliverySeconds, Histogram, "Time of one outbox delivery attempt (the handler's call), by topic.", []string{"topic"}},
}

// Counters with label values known up front are created at 0 by the pgfence
// value that records them (a Locker, a prepared Table, a Worker, a
// Dispatcher), through the Init functions below. A series that first appears
// at 1 hides its first event from increase() and rate(), which need a sample
// before it; a series that starts at 0 does not.
