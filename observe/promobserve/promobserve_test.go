package promobserve_test

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pgfence/pgfence/observe"
	"github.com/pgfence/pgfence/observe/promobserve"
)

func TestAdapter(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.Add(observe.FencedRefusedTotal, 1, observe.RefusedStale)
	m.Add(observe.FencedRefusedTotal, 2, observe.RefusedStale)
	m.Add(observe.FencedRefusedTotal, 1, observe.RefusedGuard)
	m.Add("not_a_pgfence_metric", 1)               // ignored
	m.Add(observe.FencedRefusedTotal, 1, "a", "b") // wrong label count: ignored
	m.Observe(observe.LeaseAcquireSeconds, 0.002, observe.OutcomeGranted)

	want := `
# HELP pgfence_fenced_write_refused_total Fenced writes refused, by reason (stale, already_applied, not_found, guard).
# TYPE pgfence_fenced_write_refused_total counter
pgfence_fenced_write_refused_total{reason="guard"} 1
pgfence_fenced_write_refused_total{reason="stale"} 3
`
	if err := testutil.GatherAndCompare(reg, stringsReader(want), observe.FencedRefusedTotal); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(reg, observe.LeaseAcquireSeconds); n != 1 {
		t.Fatalf("acquire histogram series = %d", n)
	}
	// Registering twice on one registry is an error, not a panic.
	if _, err := promobserve.New(reg); err == nil {
		t.Fatal("second New on the same registry succeeded")
	}
}

func TestNop(t *testing.T) {
	observe.OrNop(nil).Add(observe.FencedWritesTotal, 1)
	if observe.OrNop(nil) != observe.Nop {
		t.Fatal("OrNop(nil) is not Nop")
	}
}

func stringsReader(s string) *strings.Reader { return strings.NewReader(s) }
