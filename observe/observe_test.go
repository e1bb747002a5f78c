package observe_test

import (
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/observe"
)

func TestCatalog(t *testing.T) {
	name := regexp.MustCompile(`^pgfence_[a-z_]+$`)
	label := regexp.MustCompile(`^[a-z][a-z_]*$`)
	seen := map[string]bool{}
	for _, d := range observe.Catalog {
		if !name.MatchString(d.Name) || seen[d.Name] {
			t.Errorf("%q: bad or repeated name", d.Name)
		}
		seen[d.Name] = true
		switch d.Kind {
		case observe.Counter:
			if !strings.HasSuffix(d.Name, "_total") {
				t.Errorf("counter %s does not end in _total", d.Name)
			}
		case observe.Histogram:
			if !strings.HasSuffix(d.Name, "_seconds") {
				t.Errorf("histogram %s does not end in _seconds", d.Name)
			}
		default:
			t.Errorf("%s: kind %v", d.Name, d.Kind)
		}
		if d.Help == "" || !strings.HasSuffix(d.Help, ".") {
			t.Errorf("%s: help %q", d.Name, d.Help)
		}
		for _, l := range d.Labels {
			if !label.MatchString(l) || l == "le" || l == "job" || l == "instance" {
				t.Errorf("%s: label %q", d.Name, l)
			}
		}
		if got, ok := observe.Lookup(d.Name); !ok || got.Name != d.Name {
			t.Errorf("Lookup(%s) = %v, %v", d.Name, got, ok)
		}
	}
	if _, ok := observe.Lookup("pgfence_nothing_total"); ok {
		t.Error("Lookup found an unknown name")
	}
	if observe.Counter.String() != "counter" || observe.Histogram.String() != "histogram" || observe.Kind(7).String() != "Kind(7)" {
		t.Error("Kind.String")
	}
}

// recorder checks every call against the catalog.
type recorder struct {
	t     *testing.T
	calls map[string]int
}

func (r *recorder) Add(ctx context.Context, name string, delta float64, lv ...string) {
	d, ok := observe.Lookup(name)
	if ctx == nil || !ok || d.Kind != observe.Counter || len(lv) != len(d.Labels) || delta != 0 {
		r.t.Errorf("Add(%s, %v, %q): not a zero of a catalog counter", name, delta, lv)
	}
	r.calls[name+"{"+strings.Join(lv, ",")+"}"]++
}

func (r *recorder) Observe(_ context.Context, name string, _ float64, _ ...string) {
	r.t.Errorf("Observe(%s) by an Init function", name)
}

// TestInit: the Init functions create every fixed label combination of their
// counters, at 0.
func TestInit(t *testing.T) {
	ctx := context.Background()
	r := &recorder{t: t, calls: map[string]int{}}
	metricdefs.InitLeases(ctx, r)
	metricdefs.InitTable(ctx, r, "public.items")
	metricdefs.InitQueue(ctx, r, "mail")
	metricdefs.InitTopic(ctx, r, "billing")
	for _, want := range []string{
		"pgfence_leases_lost_total{deadline_passed}", "pgfence_lease_renewals_total{refused}",
		"pgfence_fenced_writes_total{public.items}", "pgfence_fenced_write_refused_total{public.items,guard}",
		"pgfence_fenced_write_refused_total{public.items,stale}", "pgfence_claims_lost_total{mail}",
		"pgfence_rows_dead_total{mail}", "pgfence_outbox_deliveries_total{billing,permanent}",
	} {
		if r.calls[want] != 1 {
			t.Errorf("%s created %d times", want, r.calls[want])
		}
	}
	if len(r.calls) != 6+5+5+3 {
		t.Errorf("%d series created: %v", len(r.calls), r.calls)
	}
}
