package otelobserve_test

import (
	"context"
	"errors"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.opentelemetry.io/otel/trace"

	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/observe"
	"github.com/pgfence/pgfence/observe/otelobserve"
)

func setup(t *testing.T) (*otelobserve.Metrics, *sdkmetric.ManualReader) {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	m, err := otelobserve.New(mp)
	if err != nil {
		t.Fatal(err)
	}
	return m, reader
}

func collect(t *testing.T, r *sdkmetric.ManualReader) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != otelobserve.ScopeName {
			t.Errorf("scope %q", sm.Scope.Name)
		}
		for _, m := range sm.Metrics {
			out[m.Name] = m
		}
	}
	return out
}

// labelValues returns distinct values for d's labels: "<label>-<metric index>".
func labelValues(i int, d observe.Def) []string {
	vs := make([]string, len(d.Labels))
	for j, l := range d.Labels {
		vs[j] = l + "-" + string(rune('a'+i))
	}
	return vs
}

func wantAttrs(lv []string, d observe.Def) attribute.Set {
	kvs := make([]attribute.KeyValue, len(lv))
	for j, l := range d.Labels {
		kvs[j] = attribute.String(l, lv[j])
	}
	return attribute.NewSet(kvs...)
}

// TestEveryCatalogMetric records every catalog metric once and reads it back
// through the SDK: kind, description, unit, attributes and value.
func TestEveryCatalogMetric(t *testing.T) {
	t.Parallel()
	m, reader := setup(t)
	ctx := context.Background()
	for i, d := range observe.Catalog {
		v := float64(i + 1)
		if d.Kind == observe.Counter {
			m.Add(ctx, d.Name, v, labelValues(i, d)...)
		} else {
			m.Observe(ctx, d.Name, v/1000, labelValues(i, d)...)
		}
	}
	got := collect(t, reader)
	if len(got) != len(observe.Catalog) {
		t.Errorf("%d metrics collected for %d catalog entries", len(got), len(observe.Catalog))
	}
	for i, d := range observe.Catalog {
		g, ok := got[d.Name]
		if !ok {
			t.Errorf("%s: not collected", d.Name)
			continue
		}
		if g.Description != d.Help {
			t.Errorf("%s: description %q", d.Name, g.Description)
		}
		wantUnit := ""
		if d.Kind == observe.Histogram {
			wantUnit = "s"
		}
		if g.Unit != wantUnit {
			t.Errorf("%s: unit %q, want %q", d.Name, g.Unit, wantUnit)
		}
		want := wantAttrs(labelValues(i, d), d)
		switch data := g.Data.(type) {
		case metricdata.Sum[float64]:
			if d.Kind != observe.Counter || !data.IsMonotonic || data.Temporality != metricdata.CumulativeTemporality {
				t.Errorf("%s: a sum (monotonic %v) for a %v", d.Name, data.IsMonotonic, d.Kind)
			}
			if len(data.DataPoints) != 1 {
				t.Fatalf("%s: %d points", d.Name, len(data.DataPoints))
			}
			p := data.DataPoints[0]
			if !p.Attributes.Equals(&want) || p.Value != float64(i+1) {
				t.Errorf("%s: %v = %v, want %v = %v", d.Name, p.Attributes.ToSlice(), p.Value, want.ToSlice(), i+1)
			}
		case metricdata.Histogram[float64]:
			if d.Kind != observe.Histogram {
				t.Errorf("%s: a histogram for a %v", d.Name, d.Kind)
			}
			if len(data.DataPoints) != 1 {
				t.Fatalf("%s: %d points", d.Name, len(data.DataPoints))
			}
			p := data.DataPoints[0]
			if !p.Attributes.Equals(&want) || p.Count != 1 || p.Sum != float64(i+1)/1000 {
				t.Errorf("%s: %v count %d sum %v", d.Name, p.Attributes.ToSlice(), p.Count, p.Sum)
			}
			if !slices.Contains(p.Bounds, 0.0005) || !slices.Contains(p.Bounds, 300) {
				t.Errorf("%s: bounds %v are not in seconds", d.Name, p.Bounds)
			}
		default:
			t.Errorf("%s: data %T", d.Name, g.Data)
		}
	}
	if n := m.Dropped(); n != 0 {
		t.Errorf("dropped %d", n)
	}
}

// TestDrops: bad calls are dropped and counted, do not panic, and record
// nothing under wrong attributes.
func TestDrops(t *testing.T) {
	t.Parallel()
	m, reader := setup(t)
	ctx := context.Background()
	m.Add(ctx, metricdefs.FencedRefusedTotal, 1, "public.items")                          // one label of two
	m.Add(ctx, metricdefs.FencedRefusedTotal, 1, "public.items", "stale", "extra")        // three
	m.Add(ctx, metricdefs.FencedWritesTotal, 1)                                           // none of one
	m.Add(ctx, "pgfence_no_such_metric_total", 1)                                         // unknown name
	m.Add(ctx, metricdefs.ClaimSeconds, 1, "q")                                           // Add on a histogram
	m.Observe(ctx, metricdefs.RowsClaimedTotal, 1, "q")                                   // Observe on a counter
	m.Add(ctx, metricdefs.RowsClaimedTotal, -1, "q")                                      // counters only go up
	m.Add(ctx, metricdefs.RowsClaimedTotal, math.NaN(), "q")                              // not a number
	m.Add(ctx, metricdefs.RowsClaimedTotal, math.Inf(1), "q")                             // nor infinity
	m.Observe(ctx, metricdefs.ClaimSeconds, math.NaN(), "q")                              // not a number
	m.Add(ctx, metricdefs.FencedRefusedTotal, 2, "public.items", metricdefs.RefusedStale) // the one good call
	if n := m.Dropped(); n != 10 {
		t.Errorf("dropped %d, want 10", n)
	}
	got := collect(t, reader)
	sum, ok := got[metricdefs.FencedRefusedTotal].Data.(metricdata.Sum[float64])
	if !ok || len(sum.DataPoints) != 1 || sum.DataPoints[0].Value != 2 {
		t.Fatalf("refused: %+v", got[metricdefs.FencedRefusedTotal].Data)
	}
	want := attribute.NewSet(attribute.String("table", "public.items"), attribute.String("reason", "stale"))
	if a := sum.DataPoints[0].Attributes; !a.Equals(&want) {
		t.Errorf("attributes %v", a.ToSlice())
	}
	for _, name := range []string{metricdefs.FencedWritesTotal, metricdefs.RowsClaimedTotal, metricdefs.ClaimSeconds} {
		if g, ok := got[name]; ok {
			t.Errorf("%s recorded: %+v", name, g.Data)
		}
	}
}

// TestConcurrent: Add and Observe from many goroutines (run with -race).
func TestConcurrent(t *testing.T) {
	t.Parallel()
	m, reader := setup(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 1000 {
				m.Add(ctx, metricdefs.RowsCompletedTotal, 1, "mail")
				m.Observe(ctx, metricdefs.ClaimSeconds, 0.001, "mail")
			}
		})
	}
	wg.Wait()
	got := collect(t, reader)
	if p := got[metricdefs.RowsCompletedTotal].Data.(metricdata.Sum[float64]).DataPoints; len(p) != 1 || p[0].Value != 8000 {
		t.Fatalf("completed %+v", p)
	}
	if p := got[metricdefs.ClaimSeconds].Data.(metricdata.Histogram[float64]).DataPoints; len(p) != 1 || p[0].Count != 8000 {
		t.Fatalf("claim seconds %+v", p)
	}
}

// refusing is a MeterProvider whose meter refuses one instrument.
type refusing struct {
	noop.MeterProvider
	name string
}

type refusingMeter struct {
	noop.Meter
	name string
}

func (r refusing) Meter(string, ...metric.MeterOption) metric.Meter {
	return refusingMeter{name: r.name}
}

func (r refusingMeter) Float64Histogram(name string, opts ...metric.Float64HistogramOption) (metric.Float64Histogram, error) {
	if name == r.name {
		return nil, errors.New("refused")
	}
	return r.Meter.Float64Histogram(name, opts...)
}

func TestNewErrors(t *testing.T) {
	t.Parallel()
	if _, err := otelobserve.New(nil); err == nil {
		t.Error("nil MeterProvider accepted")
	}
	_, err := otelobserve.New(refusing{name: metricdefs.ClaimSeconds})
	if err == nil || !strings.Contains(err.Error(), metricdefs.ClaimSeconds) {
		t.Errorf("refused instrument: %v", err)
	}
	// A no-op provider works (and records nothing).
	m, err := otelobserve.New(noop.NewMeterProvider())
	if err != nil {
		t.Fatal(err)
	}
	m.Add(context.Background(), metricdefs.RowsClaimedTotal, 1, "q")
}

// TestNewTypedNilMeterProvider: a nil pointer to a MeterProvider (an
// unset *sdkmetric.MeterProvider) is refused with an error, as a nil
// interface is, instead of a panic when its Meter is called.
func TestNewTypedNilMeterProvider(t *testing.T) {
	t.Parallel()
	var (
		m   *otelobserve.Metrics
		err error
	)
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Fatalf("New((*sdkmetric.MeterProvider)(nil)) panics: %v", r)
			}
		}()
		m, err = otelobserve.New((*sdkmetric.MeterProvider)(nil))
	}()
	if err == nil || m != nil {
		t.Fatalf("New((*sdkmetric.MeterProvider)(nil)) = %v, %v; want nil and an error", m, err)
	}
	if !strings.Contains(err.Error(), "nil MeterProvider") {
		t.Errorf("error %q does not say the MeterProvider is nil", err)
	}
}

// TestNilMetricsRecordsNothing: a typed nil *Metrics in a Config (metrics
// left off: var m *otelobserve.Metrics) records nothing and does not panic,
// neither in what pglock.New, skiplocked.NewWorker and fencedwrite run at
// construction (the Init helpers) nor on any catalog metric later; Dropped
// is 0.
func TestNilMetricsRecordsNothing(t *testing.T) {
	t.Parallel()
	var m *otelobserve.Metrics
	var om observe.Metrics = m // as in pglock.Config{Metrics: m}
	ctx := context.Background()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("typed nil *otelobserve.Metrics panics: %v", r)
		}
	}()
	metricdefs.InitLeases(ctx, om)
	metricdefs.InitTable(ctx, om, "public.items")
	metricdefs.InitQueue(ctx, om, "mail")
	metricdefs.InitTopic(ctx, om, "events")
	for i, d := range observe.Catalog {
		om.Add(ctx, d.Name, 1, labelValues(i, d)...)
		om.Observe(ctx, d.Name, 1, labelValues(i, d)...)
	}
	om.Add(ctx, "pgfence_no_such_metric_total", 1)
	if n := m.Dropped(); n != 0 {
		t.Errorf("nil Metrics: Dropped() = %d, want 0", n)
	}
}

// TestContextReachesExemplars: the operation's context goes to the
// instrument, so the SDK's default exemplar filter (sampled spans) links the
// measurement to the span in it.
func TestContextReachesExemplars(t *testing.T) {
	t.Parallel()
	m, reader := setup(t)
	tid := trace.TraceID{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36}
	sid := trace.SpanID{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7}
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled,
	}))
	m.Add(ctx, metricdefs.RowsClaimedTotal, 3, "mail")
	m.Observe(ctx, metricdefs.ClaimSeconds, 0.004, "mail")
	m.Add(context.Background(), metricdefs.RowsClaimedTotal, 1, "sms") // no span: no exemplar
	got := collect(t, reader)
	for _, p := range got[metricdefs.RowsClaimedTotal].Data.(metricdata.Sum[float64]).DataPoints {
		q, _ := p.Attributes.Value("queue")
		switch n := len(p.Exemplars); {
		case q.AsString() == "mail" && (n != 1 || trace.TraceID(p.Exemplars[0].TraceID) != tid || trace.SpanID(p.Exemplars[0].SpanID) != sid):
			t.Errorf("mail: exemplars %+v", p.Exemplars)
		case q.AsString() == "sms" && n != 0:
			t.Errorf("sms: exemplars %+v", p.Exemplars)
		}
	}
	h := got[metricdefs.ClaimSeconds].Data.(metricdata.Histogram[float64]).DataPoints
	if len(h) != 1 || len(h[0].Exemplars) != 1 || trace.TraceID(h[0].Exemplars[0].TraceID) != tid {
		t.Errorf("histogram exemplars %+v", h)
	}
}
