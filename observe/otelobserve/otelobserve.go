// Package otelobserve adapts pgfence's [observe.Metrics] to OpenTelemetry
// metrics.
//
//	m, err := otelobserve.New(meterProvider) // an sdk/metric MeterProvider, or otel.GetMeterProvider()
//	locker, err := pglock.New(pool, &pglock.Config{Metrics: m})
//
// [New] creates one instrument per entry of [observe.Catalog], up front, on the
// meter named [ScopeName]: a Float64Counter for a counter, a Float64Histogram
// for a histogram. An instrument has the catalog's name (so an OpenTelemetry
// pipeline that exports to Prometheus keeps pgfence's metric names) and its
// help text as description; *_seconds metrics have unit "s" and explicit
// bucket boundaries from 0.5 ms to 1 day (OpenTelemetry's default boundaries
// are made for milliseconds). Label values become attributes named by the
// catalog's label names.
//
// The context pgfence passes to Add and Observe is the operation's (see
// [observe.Metrics]) and goes to the instrument unchanged, so the SDK's
// exemplar filter can link a measurement to the span in it.
//
// A nil *Metrics records nothing: a typed nil put in a Config (var m
// *otelobserve.Metrics, left nil when metrics are off) is a no-op, as with
// promobserve.
//
// Only programs that import this package link OpenTelemetry: pgfence's other
// packages do not depend on it.
package otelobserve

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgfence/pgfence/observe"
)

// ScopeName is the instrumentation scope (meter name) of pgfence's
// instruments.
const ScopeName = "github.com/pgfence/pgfence"

// bounds are the explicit bucket boundaries of every *_seconds histogram, in
// seconds (the same as promobserve's buckets).
var bounds = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400}

// Metrics records pgfence's metrics into OpenTelemetry instruments created by
// [New]. It is safe for concurrent use.
//
// A measurement that cannot be recorded faithfully is dropped and counted in
// [Metrics.Dropped], never recorded under wrong attributes and never a panic:
// a name outside [observe.Catalog], a name used with the other kind (Add on a
// histogram, Observe on a counter), a number of label values other than the
// catalog's, a negative, infinite or NaN counter delta, a NaN histogram
// value.
//
// A nil *Metrics records nothing and counts nothing: its Add and Observe do
// nothing and its Dropped returns 0.
type Metrics struct {
	insts   map[string]*instrument
	dropped atomic.Int64
}

type instrument struct {
	def       observe.Def
	keys      []attribute.Key
	counter   metric.Float64Counter
	histogram metric.Float64Histogram
}

var _ observe.Metrics = (*Metrics)(nil)

// New creates the instruments of every [observe.Catalog] metric on
// mp.Meter([ScopeName]). It returns an error when mp is nil (nil, or a nil
// pointer such as (*sdkmetric.MeterProvider)(nil)) or when the meter refuses
// an instrument (the error names it); instruments created before the error
// are left to the provider.
func New(mp metric.MeterProvider) (*Metrics, error) {
	if mp == nil {
		return nil, errors.New("otelobserve: nil MeterProvider")
	}
	if isNil(mp) {
		return nil, fmt.Errorf("otelobserve: nil MeterProvider (a nil %T)", mp)
	}
	meter := mp.Meter(ScopeName)
	m := &Metrics{insts: make(map[string]*instrument, len(observe.Catalog))}
	for _, d := range observe.Catalog {
		in := &instrument{def: d, keys: make([]attribute.Key, len(d.Labels))}
		for i, l := range d.Labels {
			in.keys[i] = attribute.Key(l)
		}
		var unit string
		if strings.HasSuffix(d.Name, "_seconds") {
			unit = "s"
		}
		var err error
		switch d.Kind {
		case observe.Counter:
			in.counter, err = meter.Float64Counter(d.Name, metric.WithDescription(d.Help), metric.WithUnit(unit))
		case observe.Histogram:
			opts := []metric.Float64HistogramOption{metric.WithDescription(d.Help), metric.WithUnit(unit)}
			if unit == "s" {
				opts = append(opts, metric.WithExplicitBucketBoundaries(bounds...))
			}
			in.histogram, err = meter.Float64Histogram(d.Name, opts...)
		default:
			err = fmt.Errorf("unknown kind %v", d.Kind)
		}
		if err != nil {
			return nil, fmt.Errorf("otelobserve: instrument %s: %w", d.Name, err)
		}
		m.insts[d.Name] = in
	}
	return m, nil
}

// Add implements observe.Metrics: it adds delta to the counter name with the
// catalog's attributes, passing ctx to the instrument.
// A nil m does nothing.
func (m *Metrics) Add(ctx context.Context, name string, delta float64, labelValues ...string) {
	if m == nil {
		return
	}
	in := m.insts[name]
	if in == nil || in.counter == nil || len(labelValues) != len(in.keys) || !(delta >= 0) || math.IsInf(delta, 1) {
		m.dropped.Add(1)
		return
	}
	in.counter.Add(ctx, delta, in.attrs(labelValues))
}

// Observe implements observe.Metrics: it records value in the histogram name
// with the catalog's attributes, passing ctx to the instrument.
// A nil m does nothing.
func (m *Metrics) Observe(ctx context.Context, name string, value float64, labelValues ...string) {
	if m == nil {
		return
	}
	in := m.insts[name]
	if in == nil || in.histogram == nil || len(labelValues) != len(in.keys) || math.IsNaN(value) {
		m.dropped.Add(1)
		return
	}
	in.histogram.Record(ctx, value, in.attrs(labelValues))
}

// Dropped returns the number of measurements dropped since [New] (see
// [Metrics]). pgfence's own calls are never dropped; a non-zero value means a
// caller outside pgfence used a name or label count the catalog does not have.
// A nil m returns 0.
func (m *Metrics) Dropped() int64 {
	if m == nil {
		return 0
	}
	return m.dropped.Load()
}

// isNil reports whether v is nil or holds a nil pointer, map, slice, func,
// channel or interface (as pgfence's internal/nilcheck does; this module
// does not import pgfence's internal packages, whose API may change between
// pgfence versions).
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan:
		return rv.IsNil()
	}
	return false
}

func (in *instrument) attrs(values []string) metric.MeasurementOption {
	if len(values) == 0 {
		return metric.WithAttributeSet(*attribute.EmptySet())
	}
	kvs := make([]attribute.KeyValue, len(values))
	for i, v := range values {
		kvs[i] = in.keys[i].String(v)
	}
	return metric.WithAttributes(kvs...)
}
