package promobserve_test

import (
	"bytes"
	"context"
	"fmt"
	"go/parser"
	"go/token"
	"math"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/observe"
	"github.com/pgfence/pgfence/observe/promobserve"
)

func TestAdapter(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.Add(ctx, metricdefs.FencedRefusedTotal, 1, "public.items", metricdefs.RefusedStale)
	m.Add(ctx, metricdefs.FencedRefusedTotal, 2, "public.items", metricdefs.RefusedStale)
	m.Add(ctx, metricdefs.FencedRefusedTotal, 1, "app.orders", metricdefs.RefusedGuard)
	m.Add(ctx, "not_a_pgfence_metric", 1)                        // ignored
	m.Add(ctx, metricdefs.FencedRefusedTotal, 1, "public.items") // wrong label count: ignored
	m.Observe(ctx, metricdefs.FencedRefusedTotal, 1, "a", "b")   // a counter observed: ignored
	m.Observe(ctx, metricdefs.LeaseAcquireSeconds, 0.002, metricdefs.OutcomeGranted)
	// Deltas Prometheus panics on (negative) or that spoil the series for
	// good (NaN, +Inf), and a NaN observation: ignored, no panic.
	for _, d := range []float64{-1, math.NaN(), math.Inf(1), math.Inf(-1)} {
		m.Add(ctx, metricdefs.FencedRefusedTotal, d, "public.items", metricdefs.RefusedStale)
	}
	m.Observe(ctx, metricdefs.LeaseAcquireSeconds, math.NaN(), metricdefs.OutcomeGranted)

	want := `
# HELP pgfence_fenced_write_refused_total Fenced writes refused, by table (schema.name) and reason (stale, already_applied, not_found, guard).
# TYPE pgfence_fenced_write_refused_total counter
pgfence_fenced_write_refused_total{reason="guard",table="app.orders"} 1
pgfence_fenced_write_refused_total{reason="stale",table="public.items"} 3
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), metricdefs.FencedRefusedTotal); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(reg, metricdefs.LeaseAcquireSeconds); n != 1 {
		t.Fatalf("acquire histogram series = %d", n)
	}
	// A typed nil *Metrics (put in a Config by mistake) records nothing.
	var nilMetrics *promobserve.Metrics
	nilMetrics.Add(ctx, metricdefs.FencedRefusedTotal, 1, "public.items", metricdefs.RefusedStale)
	nilMetrics.Observe(ctx, metricdefs.LeaseAcquireSeconds, 1, metricdefs.OutcomeGranted)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == metricdefs.LeaseAcquireSeconds {
			if h := mf.GetMetric()[0].GetHistogram(); h.GetSampleCount() != 1 || h.GetSampleSum() != 0.002 {
				t.Fatalf("acquire histogram: count %d sum %v, want 1 and 0.002 (the NaN observation ignored)", h.GetSampleCount(), h.GetSampleSum())
			}
		}
	}
	// Registering twice on one registry is an error, not a panic.
	if _, err := promobserve.New(reg); err == nil {
		t.Fatal("second New on the same registry succeeded")
	}
}

// TestEveryCatalogMetricRegistered: New declares the whole catalog with its
// kind, help and label names.
func TestEveryCatalogMetricRegistered(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, d := range observe.Catalog {
		lv := make([]string, len(d.Labels))
		for i := range lv {
			lv[i] = "v"
		}
		if d.Kind == observe.Counter {
			m.Add(ctx, d.Name, 1, lv...)
		} else {
			m.Observe(ctx, d.Name, 0.01, lv...)
		}
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*dto.MetricFamily{}
	for _, f := range fams {
		got[f.GetName()] = f
	}
	for _, d := range observe.Catalog {
		f := got[d.Name]
		if f == nil {
			t.Errorf("%s not registered", d.Name)
			continue
		}
		wantType := dto.MetricType_COUNTER
		if d.Kind == observe.Histogram {
			wantType = dto.MetricType_HISTOGRAM
		}
		if f.GetType() != wantType || f.GetHelp() != d.Help || len(f.Metric) != 1 || len(f.Metric[0].Label) != len(d.Labels) {
			t.Errorf("%s: type %v help %q, %d series", d.Name, f.GetType(), f.GetHelp(), len(f.Metric))
		}
	}
	if len(got) != len(observe.Catalog) {
		t.Errorf("%d families for %d catalog entries", len(got), len(observe.Catalog))
	}
}

type traceKey struct{}

// TestExemplars: with ExemplarFromContext, samples carry the labels it returns
// for the operation's context; labels Prometheus would refuse are dropped and
// the sample is still recorded.
func TestExemplars(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg, promobserve.ExemplarFromContext(func(ctx context.Context) prometheus.Labels {
		id, _ := ctx.Value(traceKey{}).(string)
		if id == "" {
			return nil
		}
		return prometheus.Labels{"trace_id": id}
	}))
	if err != nil {
		t.Fatal(err)
	}
	traced := context.WithValue(context.Background(), traceKey{}, "4bf92f3577b34da6a3ce929d0e0e4736")
	m.Add(traced, metricdefs.RowsClaimedTotal, 3, "mail")
	m.Observe(traced, metricdefs.ClaimSeconds, 0.004, "mail")
	m.Add(context.Background(), metricdefs.RowsClaimedTotal, 1, "sms") // no trace: no exemplar
	tooLong := context.WithValue(context.Background(), traceKey{}, strings.Repeat("x", prometheus.ExemplarMaxRunes))
	m.Add(tooLong, metricdefs.RowsClaimedTotal, 1, "push")   // refused exemplar: plain sample
	m.Observe(tooLong, metricdefs.ClaimSeconds, 0.5, "push") // no panic either

	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	exemplars := map[string]string{} // queue -> trace id of the counter's exemplar
	values := map[string]float64{}
	var histTrace string
	for _, f := range fams {
		for _, s := range f.Metric {
			queue := s.Label[0].GetValue()
			switch f.GetName() {
			case metricdefs.RowsClaimedTotal:
				values[queue] = s.GetCounter().GetValue()
				if e := s.GetCounter().GetExemplar(); e != nil {
					exemplars[queue] = e.Label[0].GetValue()
				}
			case metricdefs.ClaimSeconds:
				for _, b := range s.GetHistogram().GetBucket() {
					if e := b.GetExemplar(); e != nil && queue == "mail" {
						histTrace = e.Label[0].GetValue()
					} else if e != nil {
						t.Errorf("histogram exemplar on queue %s", queue)
					}
				}
			}
		}
	}
	if values["mail"] != 3 || values["sms"] != 1 || values["push"] != 1 {
		t.Errorf("counter values %v", values)
	}
	if len(exemplars) != 1 || exemplars["mail"] != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("counter exemplars %v", exemplars)
	}
	if histTrace != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("histogram exemplar %q", histTrace)
	}

	// Served in the OpenMetrics format, the exemplar is on the sample line.
	h := promhttp.HandlerFor(reg, promhttp.HandlerOpts{EnableOpenMetrics: true})
	req := httptest.NewRequest("GET", "/metrics", nil)
	req.Header.Set("Accept", "application/openmetrics-text; version=1.0.0")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if !bytes.Contains(rec.Body.Bytes(), []byte(`pgfence_rows_claimed_total{queue="mail"} 3.0 # {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 3.0`)) {
		t.Errorf("OpenMetrics exposition lacks the exemplar:\n%s", rec.Body.Bytes())
	}
}

// TestNewNilRegisterer: New with no registry (nil, or a nil
// *prometheus.Registry) returns an error, as otelobserve.New(nil) does,
// instead of panicking on the first Register.
func TestNewNilRegisterer(t *testing.T) {
	t.Parallel()
	for _, reg := range []prometheus.Registerer{nil, (*prometheus.Registry)(nil)} {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("New(%T(nil)) panics: %v", reg, r)
				}
			}()
			m, err := promobserve.New(reg)
			if err == nil || m != nil {
				t.Errorf("New(%T(nil)) = %v, %v; want nil and an error", reg, m, err)
				return
			}
			if !strings.Contains(err.Error(), "nil Registerer") {
				t.Errorf("New(%T(nil)): error %q does not say the Registerer is nil", reg, err)
			}
		}()
	}
}

// TestPackageDocStatesBuckets: the package doc states the histograms'
// bucket range as the code has it (the smallest and largest finite upper
// bounds, in seconds).
func TestPackageDocStatesBuckets(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := promobserve.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.Observe(context.Background(), metricdefs.ClaimSeconds, 1, "q")
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var lo, hi float64
	for _, mf := range mfs {
		if mf.GetName() == metricdefs.ClaimSeconds {
			b := mf.GetMetric()[0].GetHistogram().GetBucket()
			lo, hi = b[0].GetUpperBound(), b[len(b)-1].GetUpperBound()
		}
	}
	if lo == 0 || hi == 0 {
		t.Fatal("no buckets gathered")
	}
	f, err := parser.ParseFile(token.NewFileSet(), "promobserve.go", nil, parser.PackageClauseOnly|parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	doc := strings.Join(strings.Fields(f.Doc.Text()), " ")
	for _, want := range []string{fmt.Sprintf("from %g ms", lo*1000), fmt.Sprintf("(%g s)", hi)} {
		if !strings.Contains(doc, want) {
			t.Errorf("package doc does not say %q (buckets %g s to %g s):\n%s", want, lo, hi, doc)
		}
	}
}

func TestNop(t *testing.T) {
	metricdefs.OrNop(nil).Add(context.Background(), metricdefs.FencedWritesTotal, 1, "public.items")
	metricdefs.OrNop(nil).Observe(context.Background(), metricdefs.ClaimSeconds, 1, "q")
	if metricdefs.OrNop(nil) == nil {
		t.Fatal("OrNop(nil) is nil")
	}
	var m observe.Metrics = &promobserve.Metrics{}
	if metricdefs.OrNop(m) != m {
		t.Fatal("OrNop(m) is not m")
	}
}
